"""OpenAI request parsing and response bodies shaped like vLLM's (chat and completions).

Streaming chunks follow vLLM: the first chat chunk carries ``role``, each token its own
chunk, the last token's chunk the ``finish_reason``; with ``stream_options.include_usage``
a final chunk with ``"choices": []`` and ``usage`` comes before ``data: [DONE]``.
``usage.prompt_tokens_details.cached_tokens`` is always filled in (vLLM needs
``--enable-prompt-tokens-details`` for it; the mock behaves as if it were given). Chat
answers have vLLM 0.32's fields (its message's null ``refusal`` ... ``reasoning``, the
``system_fingerprint``, ``created_cache_tokens``), so a router's tokens-in translation
(``router.forward.tokens_in``) can be compared with them field for field. ``stop`` strings
end the text where one first appears (kept with ``include_stop_str_in_output``), with
``finish_reason`` "stop" and the string as ``stop_reason``, as vLLM's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from router.http.errors import ApiError

Kind = Literal["chat", "completion"]


@dataclass(slots=True)
class Params:
    """What the mock engine takes from a request body (everything else is ignored)."""

    kind: Kind
    model: str
    max_tokens: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool
    request_id: str
    created: int
    stop: tuple[str, ...] = ()  # stop strings
    include_stop: bool = False  # include_stop_str_in_output

    def use_request_id(self, header: str | None) -> None:
        """vLLM names the answer after the request's ``X-Request-Id`` when it has one."""
        if header:
            self.request_id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + header


FINGERPRINT = "vllm-0.32.0-mock"  # vLLM stamps its version and config hash on chat answers


def stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``stop`` field as a tuple of strings (vLLM takes one string or a list)."""
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        return tuple(x for x in stop if x)
    raise ApiError(400, "stop must be a string or a list of strings", "invalid_value", "stop")


def stop_at(
    pieces: list[str], stop: tuple[str, ...], include: bool
) -> tuple[list[str], str | None]:
    """The output pieces up to the first stop string, and the string (None: no stop).
    The piece it ends in is the last generated; the text ends where the string starts
    (after it with ``include``), the pieces cut to that text."""
    if not stop:
        return pieces, None
    text = ""
    for i, piece in enumerate(pieces):
        start = len(text)
        text += piece
        # the earliest match that ends in this piece
        found = [(text.find(s, max(0, start - len(s) + 1)), s) for s in stop]
        hits = [(at, s) for at, s in found if at >= 0]
        if hits:
            at, s = min(hits)
            kept = text[: at + len(s) if include else at]
            out, pos = [], 0
            for p in pieces[: i + 1]:
                out.append(kept[pos : pos + len(p)])
                pos += len(out[-1])
            return out, s
    return pieces, None


def _int_field(body: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ApiError(400, f"{name} must be a positive integer", "invalid_value", name)
        return value
    return None


def parse_params(kind: Kind, body: Any, served_model: str) -> Params:
    """Validate the fields the mock acts on; ApiError (OpenAI error body) when wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_body")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", "invalid_value", "messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ApiError(400, "each message needs a role", "invalid_value", "messages")
        # vLLM's check (its add_generation_prompt defaults to true, as here); the chat is
        # rendered with the final message continued (router.tokens.tokenize._continued)
        if body.get("continue_final_message") and body.get("add_generation_prompt", True):
            raise ApiError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "invalid_value",
                "continue_final_message",
            )
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            if len(prompt) != 1:
                raise ApiError(400, "the mock engine takes one prompt", "invalid_value", "prompt")
            prompt = prompt[0]
        ok_ids = isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in prompt
        )
        if not (isinstance(prompt, str) and prompt) and not (ok_ids and prompt):
            raise ApiError(400, "prompt must be text or token ids", "invalid_value", "prompt")
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model_not_found", "model")
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, "the mock engine supports n=1 only", "invalid_value", "n")
    options = body.get("stream_options") or {}
    return Params(
        kind=kind,
        model=served_model,
        max_tokens=_int_field(body, "max_completion_tokens", "max_tokens"),
        ignore_eos=bool(body.get("ignore_eos", False)),
        stream=bool(body.get("stream", False)),
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        request_id=("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex,
        created=int(time.time()),
        stop=stops(body),
        include_stop=bool(body.get("include_stop_str_in_output", False)),
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, created: int, whole: bool
) -> dict[str, Any]:
    """vLLM 0.32's chat usage: ``created_cache_tokens`` (the prompt's tokens it wrote to
    the prefix cache), and in a whole answer its null fields too."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens, "created_cache_tokens": created}
    use = usage(prompt_tokens, completion_tokens, cached_tokens)
    use["prompt_tokens_details"] = details
    if whole:
        details["multimodal_tokens"] = None
        use["completion_tokens_details"] = None
    return use


def _envelope(p: Params, chunk: bool) -> dict[str, Any]:
    if p.kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": p.request_id, "object": obj, "created": p.created, "model": p.model}


def full_response(
    p: Params, text: str, finish: str, use: dict[str, Any], stop_reason: str | None = None
) -> dict[str, Any]:
    if p.kind == "chat":
        message = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                   "audio": None, "function_call": None, "reasoning": None}  # fmt: skip
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "token_ids": None,
            "routed_experts": None,
        }
        return {
            **_envelope(p, False), "choices": [choice], "service_tier": None,
            "system_fingerprint": FINGERPRINT, "usage": use, "prompt_logprobs": None,
            "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None,
        }  # fmt: skip
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": stop_reason,
    }
    return {**_envelope(p, False), "choices": [choice], "usage": use}


def sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def role_chunk(p: Params) -> bytes:
    """vLLM's first chat chunk: the role and empty content."""
    delta = {"role": "assistant", "content": ""}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    chunk = {**_envelope(p, True), "choices": [choice], "prompt_token_ids": None}
    return sse({**chunk, "prompt_text": None})


def token_chunk(p: Params, piece: str, finish: str | None, stop_reason: str | None = None) -> bytes:
    if p.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "logprobs": None}
    else:
        choice = {"index": 0, "text": piece, "logprobs": None}
    choice["finish_reason"] = finish
    if finish is not None:
        choice["stop_reason"] = stop_reason
    chunk = {**_envelope(p, True), "choices": [choice]}
    if p.kind == "chat":
        choice["token_ids"] = None
        if finish is not None and not p.include_usage:  # else the usage chunk has it
            chunk["system_fingerprint"] = FINGERPRINT
    return sse(chunk)


def usage_chunk(p: Params, use: dict[str, Any]) -> bytes:
    chunk = {**_envelope(p, True), "choices": [], "usage": use}
    if p.kind == "chat":
        chunk["system_fingerprint"] = FINGERPRINT
    return sse(chunk)
