"""A Responses request (``/v1/responses``) sent as the router's token ids, and the answer
vLLM's Responses layer would have given, built from the tokens-in answer.

``router.forward.tokens_in`` decides which requests go (``request_reason`` here, the
rendering's exactness in ``router.routing.responses.render_reason``) and which engines
take them (its probe compares this module's answer with the engine's own). This module
builds the ``/inference/v1/generate`` request and shapes its answer as vLLM 0.32's
``serving.py`` (``OpenAIServingResponses``, a non-Harmony model, no parsers, a
``SimpleContext``) does:

- sampling: what ``ResponsesRequest.to_sampling_params`` takes (temperature, top_p,
  top_k, min_p and the penalties defaulting to the engine's generation config, which
  the probe read from ``/v1/responses/render``); ``max_tokens`` the engine's default
  (the context left) clamped by ``max_output_tokens``; ``logprobs`` the
  ``top_logprobs`` when ``include`` asks for ``message.output_text.logprobs``;
- the whole answer: the ``response`` object (``ResponsesResponse.from_request``): the
  request's echoed fields, the sampling parameters as the engine holds them (a
  temperature under 1e-5 is greedy: top_p 1.0; one under 0.01 is raised to it), one
  ``message`` output item (no content part when the text is empty), ``status``
  ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens`` when the
  length ran out, ``usage`` with ``input_tokens_details.cached_tokens`` and
  ``cache_write_tokens`` (the prompt's whole blocks less its cached tokens, vLLM's
  count);
- the stream (named SSE events, ``sequence_number`` rising from 0):
  ``response.created`` and ``response.in_progress`` at once, then with the first text
  ``response.output_item.added`` and ``response.content_part.added``, one
  ``response.output_text.delta`` per engine event with text (an event without text is
  dropped, its logprobs too, as vLLM does), then ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done`` and
  ``response.completed`` with the whole response (its output the streamed item, none
  if no text came). No ``[DONE]``.

Ids: the response's is the request's ``request_id`` or ``resp_`` and 16 hex digits; the
message's ``msg_`` and 16 hex digits (vLLM's ``random_uuid``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from router.tokens.media import as_ints

if TYPE_CHECKING:
    from router.routing.decide import Prepared

GENERATE = "/inference/v1/generate"
LOGPROBS = "message.output_text.logprobs"
_SAMPLING = ("seed", "stop", "ignore_eos", "skip_special_tokens",
             "include_stop_str_in_output", "logit_bias")  # fmt: skip
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
              "presence_penalty", "frequency_penalty")  # fmt: skip
_SERVICE_TIERS = frozenset(("auto", "default", "flex", "scale", "priority"))
# fields this module reproduces (checked by value in ``request_reason``)
_TAKEN = frozenset(
    (
        "model", "input", "instructions", "stream", "store", "request_id",
        "max_output_tokens", "include", "top_logprobs", "tool_choice", "tools",
        "background", "truncation", "include_reasoning", "prompt_cache_key", "cache_salt",
        "priority", "metadata", "user", "service_tier", "parallel_tool_calls",
        "max_tool_calls", "stop_token_ids", *_SAMPLING, *_DEFAULTED,
    )
)  # fmt: skip
_REASON_OF = {
    "previous_response_id": "stored", "reasoning": "reasoning", "text": "structured_output",
    "structured_outputs": "structured_output", "mm_processor_kwargs": "media",
    "media_io_kwargs": "media",
}  # fmt: skip


class Capability(Protocol):
    """What the probe learnt of the engine that this module reads
    (``router.forward.tokens_in.Capability``)."""

    @property
    def defaults(self) -> dict[str, Any]: ...
    @property
    def stop_token_ids(self) -> list[int]: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def served(self) -> str: ...


def random_hex() -> str:
    """vLLM's ``random_uuid``: 16 hex digits."""
    return f"{uuid.uuid4().int & (1 << 64) - 1:016x}"


def request_reason(body: Mapping[str, Any]) -> str | None:
    """Why this Responses body needs the engine's Responses layer, beyond its rendering
    (None: this module answers it as that layer would): a stored or background
    response (``stored``), tools, reasoning, a text format, or a field this module does
    not reproduce, or one whose value the engine would refuse (``field``)."""
    for key, value in body.items():
        if key in _TAKEN:
            continue
        if value is None or value is False or value == []:
            continue  # an absent feature, spelt out
        return _REASON_OF.get(key, "field")
    if "background" in body and body["background"] is not False:
        return "stored"
    if body.get("tools"):
        return "tools"
    if body.get("tool_choice", "auto") not in ("auto", "none"):
        return "tools"
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or set(include) - {LOGPROBS}):
        return "field"
    top = body.get("top_logprobs", 0)
    if not _int(top) or not 0 <= top <= 20:
        return "field"
    limit = body.get("max_output_tokens")
    if limit is not None and not (_int(limit) and limit > 0):
        return "field"  # the engine's own error
    if body.get("truncation", "disabled") != "disabled":
        return "field"
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        return "field"
    for key in ("user", "request_id", "prompt_cache_key"):
        if body.get(key) is not None and not isinstance(body[key], str):
            return "field"
    if body.get("service_tier", "auto") not in _SERVICE_TIERS:
        return "field"
    if body.get("parallel_tool_calls") not in (None, True, False):
        return "field"
    if body.get("max_tool_calls") is not None and not _int(body["max_tool_calls"]):
        return "field"
    if not isinstance(body.get("include_reasoning", True), bool):
        return "field"
    for key in ("presence_penalty", "frequency_penalty"):
        value = body.get(key)
        if value is not None and not (_number(value) and -2.0 <= value <= 2.0):
            return "field"  # the Responses request's own bounds (its error, not generate's)
    return None


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def wants_logprobs(body: Mapping[str, Any]) -> bool:
    include = body.get("include")
    return isinstance(include, list) and LOGPROBS in include


class ResponsesPlan:
    """One Responses request as a tokens-in request, and the shaping of its answer."""

    __slots__ = ("block_size", "body", "cap", "created", "done", "echo", "finish", "gone",
                 "id", "item", "logprobs", "lps", "model", "path", "prompt", "raw", "seq",
                 "stream", "text", "top")  # fmt: skip

    def __init__(
        self,
        request: Mapping[str, Any],
        ids: list[int],
        cap: Capability,
        model: str,
        block_size: int,
        gone: Callable[[], object],
    ) -> None:
        self.gone = gone  # the engine no longer serves the path: probe it again first
        sp: dict[str, Any] = {}
        for key in _DEFAULTED:
            value = request.get(key)
            sp[key] = cap.defaults.get(key) if value is None else value
        for key in _SAMPLING:
            value = request.get(key)
            if value is not None:
                sp[key] = value
        stop_ids = list(request.get("stop_token_ids") or [])
        if cap.stop_token_ids:
            stop_ids = list(dict.fromkeys([*stop_ids, *cap.stop_token_ids]))
        if stop_ids:
            sp["stop_token_ids"] = stop_ids
        room = cap.max_model_len - len(ids)
        limit = request.get("max_output_tokens")
        sp["max_tokens"] = room if limit is None else min(limit, room)
        self.logprobs = wants_logprobs(request)
        self.top = request.get("top_logprobs") or 0
        if self.logprobs:
            sp["logprobs"] = self.top
        out: dict[str, Any] = {
            "model": request["model"],
            "token_ids": ids,
            "sampling_params": sp,
            "output_mode": "text",
        }
        self.stream = bool(request.get("stream"))
        if self.stream:  # usage: the end of the answer, with cached_tokens
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
        for key in ("cache_salt", "priority"):
            if request.get(key) is not None:
                out[key] = request[key]
        self.path = GENERATE
        self.body = out
        self.raw = orjson.dumps(out)
        self.cap = cap
        self.model = model
        self.prompt = len(ids)
        self.block_size = block_size
        rid = request.get("request_id")
        self.id = rid if isinstance(rid, str) else "resp_" + random_hex()
        self.created = int(time.time())
        self.echo = self._echo(request, sp)
        self.seq = 0
        self.text = ""
        self.lps: list[dict[str, Any]] = []
        self.item = ""  # the message item's id, once its first text came
        self.finish: str | None = None
        self.done = False

    @classmethod
    def of(
        cls, prep: Prepared, cap: Capability, lora: bool, gone: Callable[[], object]
    ) -> ResponsesPlan:
        assert prep.ids is not None
        model = prep.parsed.model if lora else cap.served
        return cls(prep.parsed.body, as_ints(prep.ids), cap, model, prep.pool.block_size, gone)

    def _echo(self, request: Mapping[str, Any], sp: Mapping[str, Any]) -> dict[str, Any]:
        """The response object's fields taken from the request and its sampling
        parameters, as ``ResponsesResponse.from_request`` writes them, in its order."""
        temperature = float(sp["temperature"])
        if 0 < temperature < 0.01:
            temperature = 0.01  # SamplingParams raises it
        top_p = 1.0 if temperature < 1e-5 else float(sp["top_p"])
        parallel = request.get("parallel_tool_calls")
        return {
            "instructions": request.get("instructions"),
            "metadata": request.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": [],
            "parallel_tool_calls": True if parallel is None else parallel,
            "temperature": temperature,
            "tool_choice": "none",  # no tools: vLLM's validator makes auto none
            "tools": [],
            "top_p": top_p,
            "background": False,
            "max_output_tokens": sp["max_tokens"],
            "max_tool_calls": request.get("max_tool_calls"),
            "previous_response_id": None,
            "prompt": None,
            "reasoning": None,
            "service_tier": request.get("service_tier") or "auto",
            "status": "in_progress",
            "text": None,
            "top_logprobs": self.top if self.logprobs else None,
            "truncation": "disabled",
            "usage": None,
            "user": request.get("user"),
            "presence_penalty": float(sp["presence_penalty"]),
            "frequency_penalty": float(sp["frequency_penalty"]),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    # -- the response object ------------------------------------------------------
    def response(
        self, output: list[dict[str, Any]], finish: str | None, use: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """The ``response`` object: in progress (``use`` None) or finished."""
        incomplete = use is not None and finish == "length"
        details = {"reason": "max_output_tokens"} if incomplete else None
        head = {"id": self.id, "created_at": self.created, "incomplete_details": details}
        out = {**head, **self.echo, "output": output}
        if use is not None:
            out["status"] = "incomplete" if incomplete else "completed"
            out["usage"] = self.usage(use)
        return out

    def usage(self, use: Mapping[str, Any]) -> dict[str, Any]:
        """The Responses usage from the tokens-in answer's (whose ``cached_tokens`` the
        engine reports with ``--enable-prompt-tokens-details``: the probe saw them)."""
        prompt, completion = use["prompt_tokens"], use["completion_tokens"]
        cached = use["prompt_tokens_details"]["cached_tokens"]
        whole_blocks = min(self.prompt // self.block_size * self.block_size, prompt)
        return {
            "input_tokens": prompt,
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": max(0, whole_blocks - cached),
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": completion,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": prompt + completion,
        }

    def _logprobs(self, lp: Any) -> list[dict[str, Any]]:
        """A tokens-in answer's logprobs (the chat shape) as the Responses output text's."""
        if not self.logprobs or not lp:
            return []
        out = []
        for e in lp.get("content") or ():
            top = []
            if self.top:
                top = [{"token": t["token"], "bytes": t["bytes"], "logprob": t["logprob"]}
                       for t in e.get("top_logprobs") or ()]  # fmt: skip
            out.append({"token": e["token"], "bytes": e["bytes"], "logprob": e["logprob"],
                        "top_logprobs": top})  # fmt: skip
        return out

    @staticmethod
    def part(text: str, logprobs: Any) -> dict[str, Any]:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}

    @staticmethod
    def message(mid: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
        return {"id": mid, "content": content, "role": "assistant", "status": status,
                "type": "message", "phase": None}  # fmt: skip

    def whole(self, gen: Mapping[str, Any]) -> dict[str, Any]:
        """The whole response from a whole tokens-in answer."""
        (c,) = gen["choices"]
        text = c["text"]
        lps = self._logprobs(c.get("logprobs"))
        content = [self.part(text, lps or None)] if text else []
        item = self.message("msg_" + random_hex(), content, "completed")
        return self.response([item], c.get("finish_reason"), gen["usage"])

    # -- the stream -----------------------------------------------------------------
    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        fields["sequence_number"] = self.seq
        fields["type"] = kind
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(fields) + b"\n\n"

    def start(self) -> bytes:
        """The events vLLM sends before any token: created, in progress."""
        start = self.response([], None, None)
        return self._event("response.created", {"response": start}) + self._event(
            "response.in_progress", {"response": start}
        )

    def event(self, data: bytes) -> bytes:
        """One tokens-in SSE event's data as the Responses events (b"": none)."""
        if data == b"[DONE]":
            if not self.done:
                raise ValueError("the engine's stream ended without its usage")
            return b""
        gen = orjson.loads(data)
        if "error" in gen:
            err = gen["error"]
            fields = {"code": err.get("code"), "message": err.get("message"),
                      "param": err.get("param")}  # fmt: skip
            return self._event("error", fields)
        choices = gen["choices"]
        if not choices:
            use = gen.get("usage")
            return b"" if use is None else self._finish(use)
        out = b""
        for c in choices:
            if c.get("finish_reason") is not None:
                self.finish = c["finish_reason"]
            text = c["text"]
            if not text:
                continue  # vLLM sends no event for a step without text
            at = {"content_index": 0, "item_id": self.item, "output_index": 0}
            if not self.item:
                self.item = "msg_" + random_hex()
                at["item_id"] = self.item
                item = self.message(self.item, [], "in_progress")
                out += self._event("response.output_item.added",
                                   {"item": item, "output_index": 0})  # fmt: skip
                part = self.part("", [])
                out += self._event("response.content_part.added", {**at, "part": part})
            lps = self._logprobs(c.get("logprobs"))
            self.text += text
            self.lps += lps
            deltas = [{"token": e["token"], "logprob": e["logprob"],
                       "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                                        for t in e["top_logprobs"]]} for e in lps]  # fmt: skip
            fields = {"content_index": 0, "delta": text, "item_id": self.item,
                      "logprobs": deltas, "output_index": 0}  # fmt: skip
            out += self._event("response.output_text.delta", fields)
        return out

    def _finish(self, use: Mapping[str, Any]) -> bytes:
        self.done = True
        out = b""
        output = []
        if self.item:
            at = {"content_index": 0, "item_id": self.item, "output_index": 0}
            out += self._event("response.output_text.done",
                               {**at, "logprobs": [], "text": self.text})  # fmt: skip
            part = self.part(self.text, self.lps or None)
            out += self._event("response.content_part.done", {**at, "part": part})
            item = self.message(self.item, [part] if self.text else [], "completed")
            out += self._event("response.output_item.done", {"item": item, "output_index": 0})
            output.append(item)
        whole = self.response(output, self.finish, use)
        return out + self._event("response.completed", {"response": whole})
