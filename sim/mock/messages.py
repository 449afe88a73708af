"""The mock engine's Anthropic Messages API (``/v1/messages``), shaped like vLLM's.

vLLM serves it by turning the request into a chat completion: ``system`` (a string or
text blocks) becomes the system message, each message's text blocks its content. The
answer is a ``message`` with one ``text`` content block, ``stop_reason`` ``end_turn``
or ``max_tokens`` and ``usage.input_tokens`` / ``output_tokens``
(``cache_read_input_tokens``: the prefix-cache hit). Streaming sends named SSE events:
``message_start``, ``content_block_start``, one ``content_block_delta``
(``text_delta``) per token, ``content_block_stop``, ``message_delta`` (stop reason and
output tokens), ``message_stop``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from router.http.errors import ApiError


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(b.get("text", ""))
            for b in content
            if isinstance(b, dict) and b.get("type") == "text"
        )
    raise ApiError(400, f"{where}: content must be text or content blocks", "invalid_value")


def chat_body(body: Any) -> dict[str, Any]:
    """The chat-completion request the Messages request stands for."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_body")
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise ApiError(400, "messages must be a non-empty list", "invalid_value", "messages")
    messages = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(given):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}] needs role user or assistant", "invalid_value",
                           "messages")  # fmt: skip
        messages.append({"role": m["role"], "content": _text(m.get("content"), f"messages[{i}]")})
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, "max_tokens must be a positive integer", "invalid_value", "max_tokens")
    return {"model": body.get("model"), "messages": messages, "max_tokens": max_tokens,
            "stream": bool(body.get("stream"))}  # fmt: skip


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def usage(prompt: int, output: int, cached: int) -> dict[str, int]:
    return {"input_tokens": prompt, "output_tokens": output, "cache_read_input_tokens": cached}


def message(
    mid: str, model: str, text: str | None, stop: str | None, use: dict[str, int]
) -> dict[str, Any]:
    content = [] if text is None else [{"type": "text", "text": text}]
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": use}  # fmt: skip


def stop_reason(finish: str) -> str:
    return "max_tokens" if finish == "length" else "end_turn"


def _event(kind: str, **fields: Any) -> bytes:
    data = orjson.dumps({"type": kind, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def stream_events(
    mid: str,
    model: str,
    prompt_tokens: int,
    pieces: AsyncIterator[str],
    final: Callable[[], tuple[str, dict[str, int]]],
) -> AsyncIterator[bytes]:
    start = message(mid, model, None, None, usage(prompt_tokens, 0, 0))
    yield _event("message_start", message=start)
    block = {"type": "text", "text": ""}
    yield _event("content_block_start", index=0, content_block=block)
    async for piece in pieces:
        yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
    yield _event("content_block_stop", index=0)
    stop, use = final()
    yield _event("message_delta", delta={"stop_reason": stop, "stop_sequence": None}, usage=use)
    yield _event("message_stop")
