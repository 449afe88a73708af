"""Anthropic's Messages API (``/v1/messages``) as the router sees it.

vLLM and SGLang serve it by rendering the request as a chat: ``system`` (a string or
text blocks) first, then each message's text blocks. The router renders it the same
way to tokenize and hash it, so a conversation's prefix is matched as a chat's is; the
body goes to the engine unchanged.
"""

from __future__ import annotations

from typing import Any

from router.http.errors import ApiError
from router.routing.responses import content_text


def check_messages(body: dict[str, Any]) -> None:
    """Validate the fields routing reads; ``ApiError`` 400 naming the field."""
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise ApiError(400, "messages must be a non-empty array", "missing_field", "messages")
    for i, m in enumerate(given):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role",
                           "invalid_request", "messages")  # fmt: skip
        if not isinstance(m.get("content"), str | list):
            raise ApiError(400, f"messages[{i}].content must be text or content blocks",
                           "invalid_request", "messages")  # fmt: skip
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        raise ApiError(400, "system must be text or content blocks", "invalid_request", "system")


def as_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """``system`` + ``messages`` as chat messages, for tokenizing and hashing."""
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": content_text(system)})
    for m in body.get("messages") or []:
        if isinstance(m, dict) and isinstance(m.get("role"), str):
            out.append({"role": m["role"], "content": content_text(m.get("content"))})
    return out
