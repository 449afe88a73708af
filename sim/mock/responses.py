"""The mock engine's Responses API (``/v1/responses``), shaped like vLLM's.

As in vLLM (``serving_responses.py``, non-Harmony models), a request's messages are its
``instructions`` as a system message, then, with ``previous_response_id``, the stored
messages of that response and its output text as an assistant message, then its own
``input`` (a string is one user message). ``store`` (true by default) keeps both
response and messages in *this* engine's memory: a follow-up that reaches another
engine gets vLLM's 404 ``Response with id '...' not found.``, which is why a router
must send it back to the engine that made the response. The mock behaves as vLLM with
``VLLM_ENABLE_RESPONSES_API_STORE=1``, but bounds its store (vLLM never evicts).

Streaming sends named SSE events (``event: <type>``) with rising ``sequence_number``:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per token,
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, ``response.completed``.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from router.http.errors import ApiError

MAX_STORED = 10_000


@dataclass(slots=True)
class Stored:
    messages: list[dict[str, Any]]
    response: dict[str, Any]


@dataclass(slots=True)
class ResponseStore:
    """Stored responses, oldest dropped past ``limit``."""

    limit: int = MAX_STORED
    items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def get(self, rid: str) -> Stored | None:
        return self.items.get(rid)

    def put(self, rid: str, stored: Stored) -> None:
        self.items[rid] = stored
        while len(self.items) > self.limit:
            self.items.popitem(last=False)


def not_found(rid: str) -> ApiError:
    return ApiError(404, f"Response with id '{rid}' not found.", "response_not_found")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict)
        )  # input_text / output_text parts
    raise ApiError(400, "message content must be text or a list of parts", "invalid_value")


def input_messages(body: Any, store: ResponseStore) -> list[dict[str, Any]]:
    """The chat messages the request stands for (see the module docstring)."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_body")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    prev_id = body.get("previous_response_id")
    if prev_id is not None:
        prev = store.get(prev_id) if isinstance(prev_id, str) else None
        if prev is None:
            raise not_found(str(prev_id))
        messages.extend(prev.messages)
        for item in prev.response["output"]:
            if item.get("type") == "message":
                messages.extend(
                    {"role": "assistant", "content": c["text"]} for c in item["content"]
                )
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            if not isinstance(item, dict) or not isinstance(item.get("role"), str):
                raise ApiError(400, f"input[{i}] must be a message with a role",
                               "invalid_value", "input")  # fmt: skip
            messages.append({"role": item["role"], "content": _content_text(item.get("content"))})
    else:
        raise ApiError(400, "input must be a string or a non-empty list of messages",
                       "invalid_value", "input")  # fmt: skip
    return messages


def new_ids() -> tuple[str, str]:
    """A response id and its message item's id, vLLM's prefixes."""
    return f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"


def response_object(
    rid: str,
    mid: str,
    body: dict[str, Any],
    model: str,
    text: str | None,
    usage: dict[str, Any] | None,
    created: int,
) -> dict[str, Any]:
    """The ``response`` object; ``text`` None: still in progress (no output yet)."""
    output: list[dict[str, Any]] = []
    if text is not None:
        part: dict[str, Any] = {
            "type": "output_text",
            "text": text,
            "annotations": [],
            "logprobs": None,
        }
        output.append({"id": mid, "type": "message", "role": "assistant",
                       "status": "completed", "content": [part]})  # fmt: skip
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": "completed" if text is not None else "in_progress",
        "output": output,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": [],
        "top_p": body.get("top_p", 1.0),
        "background": False,
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": None,
        "service_tier": "auto",
        "store": body.get("store", True),
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": usage,
        "user": body.get("user"),
    }


def usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def event(kind: str, seq: int, **fields: Any) -> bytes:
    data = orjson.dumps({"type": kind, "sequence_number": seq, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def stream_events(
    rid: str,
    mid: str,
    body: dict[str, Any],
    model: str,
    created: int,
    pieces: AsyncIterator[str],
    final: Any,
) -> AsyncIterator[bytes]:
    """The SSE events of one streamed response; ``final()`` gives (text, usage) at the end."""
    seq = iter(range(1 << 62))
    start = response_object(rid, mid, body, model, None, None, created)
    yield event("response.created", next(seq), response=start)
    yield event("response.in_progress", next(seq), response=start)
    item = {"id": mid, "type": "message", "role": "assistant", "status": "in_progress",
            "content": []}  # fmt: skip
    yield event("response.output_item.added", next(seq), output_index=0, item=item)
    empty: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": None}
    at = {"item_id": mid, "output_index": 0, "content_index": 0}
    yield event("response.content_part.added", next(seq), **at, part=empty)
    async for piece in pieces:
        yield event("response.output_text.delta", next(seq), **at, delta=piece, logprobs=[])
    text, use = final()
    yield event("response.output_text.done", next(seq), **at, text=text, logprobs=[])
    part = {**empty, "text": text}
    yield event("response.content_part.done", next(seq), **at, part=part)
    done = {**item, "status": "completed", "content": [part]}
    yield event("response.output_item.done", next(seq), output_index=0, item=done)
    whole = response_object(rid, mid, body, model, text, use, created)
    yield event("response.completed", next(seq), response=whole)


def now() -> int:
    return int(time.time())
