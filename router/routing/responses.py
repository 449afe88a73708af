"""The Responses API (``/v1/responses``) as the router sees it.

A create request is routed cache-aware like a chat completion: its ``instructions`` and
``input`` rendered as chat messages (a string input is one user message; content parts
contribute their text) are what the engine's template sees first, so their blocks are
the prefix the index matches. The body goes to the engine unchanged.

With ``previous_response_id`` the engine that stored that response is the only one
that can answer (``router.routing.affinity``); the routing decision pins it. The stored
conversation the engine prepends is not in the request, so the router does not try
to match it: the pinned engine holds it anyway.

``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` go to the engine that
made ``id`` (``router.forward.passthrough``).
"""

from __future__ import annotations

from typing import Any

from router.http.errors import ApiError


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, "invalid_request", param)


def check_responses(body: dict[str, Any]) -> None:
    """Validate the fields routing reads; ``ApiError`` 400 naming the field."""
    given = body.get("input")
    if isinstance(given, str):
        if not given:
            raise _bad("input must not be empty", "input")
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            if not isinstance(item, dict):
                raise _bad(f"input[{i}] must be an object", "input")
    else:
        raise ApiError(400, "input must be a string or a non-empty array", "missing_field",
                       "input")  # fmt: skip
    for key in ("instructions", "previous_response_id"):
        value = body.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise _bad(f"{key} must be a non-empty string", key)
    value = body.get("max_output_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise _bad("max_output_tokens must be an integer", "max_output_tokens")


def content_text(content: Any) -> str:
    """The text of a content value, a string or a list of text parts (Responses input items
    and Anthropic blocks alike); other parts carry no text to tokenize."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return ""


def as_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """``instructions`` + ``input`` as chat messages, for tokenizing and hashing."""
    messages = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            if isinstance(item, dict) and isinstance(item.get("role"), str):
                text = content_text(item.get("content"))
                messages.append({"role": item["role"], "content": text})
            elif isinstance(item, dict):  # a tool call or its output: its text, if any
                messages.append({"role": "user", "content": content_text(item.get("output"))})
    return messages
