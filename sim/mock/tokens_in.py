"""vLLM's tokens-in endpoints (``--enable-scale-out``) for the mock engine, in vLLM 0.32's shapes.

``POST /v1/chat/completions/render`` answers a chat with what the engine would run: its
``token_ids`` and the ``sampling_params`` its chat layer fills in (defaults included).
``POST /inference/v1/generate`` runs ``token_ids`` with ``sampling_params``; with
``output_mode: "text"`` each choice has its ``text`` (stop strings applied), with
``"tokens"`` only ids. Streamed, each output token is one event, the last with its
``finish_reason``; usage (``cached_tokens`` only: the generate layer does not count
``created_cache_tokens``) comes in a last event with no choices when
``stream_options.include_usage`` asks, then ``data: [DONE]``. The generated token ids
are stand-ins (one per output piece): the mock makes text, not ids.
"""

from __future__ import annotations

import time
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.http.errors import ApiError
from sim.mock.openai_api import Params, stops

# what vLLM's chat layer fills in when a request leaves them out (no generation config)
DEFAULTS: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "min_p": 0.0,
}


@dataclass(slots=True)
class Generate:
    """A parsed ``/inference/v1/generate`` request."""

    params: Params
    token_ids: list[int]
    text: bool  # output_mode "text"


def parse_generate(body: Any, served_model: str, header_id: str | None) -> Generate:
    """Validate a generate request as vLLM's ``GenerateRequest`` does (what the mock uses)."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_body")
    ids = body.get("token_ids")
    if not (
        isinstance(ids, list)
        and ids
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise ApiError(400, "token_ids must be a non-empty list of token ids", "invalid_value")
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise ApiError(400, "sampling_params is required", "invalid_value", "sampling_params")
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model_not_found", "model")
    if sp.get("n", 1) != 1:
        raise ApiError(400, "the mock engine supports n=1 only", "invalid_value", "n")
    limit = sp.get("max_tokens")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ApiError(400, "max_tokens must be at least 1", "invalid_value", "max_tokens")
    mode = body.get("output_mode", "tokens")
    if mode not in ("tokens", "text"):
        raise ApiError(400, "output_mode must be tokens or text", "invalid_value")
    options = body.get("stream_options") or {}
    base = header_id or body.get("request_id") or uuid.uuid4().hex
    params = Params(
        kind="completion",
        model=served_model,
        max_tokens=limit,
        ignore_eos=bool(sp.get("ignore_eos", False)),
        stream=bool(body.get("stream", False)),
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        request_id=f"generate-tokens-{base}",
        created=int(time.time()),
        stop=stops(sp),
        include_stop=bool(sp.get("include_stop_str_in_output", False)),
    )
    return Generate(params, ids, mode == "text")


def rendered(body: Mapping[str, Any], ids: list[int], model: str, max_len: int) -> dict[str, Any]:
    """``/v1/chat/completions/render``'s answer: the generate request the chat becomes."""
    sp: dict[str, Any] = {**DEFAULTS}
    for key in DEFAULTS:
        if body.get(key) is not None:
            sp[key] = body[key]
    sp["stop"] = list(stops(body))
    sp["stop_token_ids"] = list(body.get("stop_token_ids") or [])
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    room = max_len - len(ids)
    sp["max_tokens"] = room if limit is None else min(limit, room)
    return {
        "request_id": f"chatcmpl-{uuid.uuid4().hex}",
        "token_ids": ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sp,
        "model": model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": False,
        "stream_options": None,
        "cache_salt": body.get("cache_salt"),
        "priority": 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def piece_id(piece: str) -> int:
    """A stand-in token id for one output piece."""
    return zlib.crc32(piece.encode()) % 32000


def usage(prompt: int, completion: int, cached: int, whole: bool) -> dict[str, Any]:
    details: dict[str, Any] = {"cached_tokens": cached}
    use: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
    }
    if whole:
        details["created_cache_tokens"] = None
        details["multimodal_tokens"] = None
        use["completion_tokens_details"] = None
    return use


def _choice(
    g: Generate, pieces: list[str], finish: str | None, stop: str | None, total: int
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": finish,
        "stop_reason": stop,
        "token_ids": [piece_id(p) for p in pieces],
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": None,
    }
    if finish is not None:
        choice["weight_versions"] = [{"version": "default", "start": 0, "end": total}]
    if g.text:
        choice["text"] = "".join(pieces)
    choice["logprobs"] = None
    return choice


def whole(
    g: Generate, pieces: list[str], finish: str, stop: str | None, use: dict[str, Any]
) -> dict[str, Any]:
    """A whole generate answer."""
    choice = _choice(g, pieces, finish, stop, len(pieces))
    return {
        "request_id": g.params.request_id,
        "model": g.params.model,
        "created": g.params.created,
        "usage": use,
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "text" if g.text else "tokens",
        "choices": [choice],
    }


def chunk(
    g: Generate, piece: str, finish: str | None, stop: str | None, total: int
) -> dict[str, Any]:
    """One streamed event's data: one output token (``total``: the tokens so far)."""
    mode = "text" if g.text else "tokens"
    out = {"request_id": g.params.request_id, "usage": None, "output_mode": mode}
    return {**out, "choices": [_choice(g, [piece], finish, stop, total)]}


def usage_chunk(g: Generate, use: dict[str, Any]) -> dict[str, Any]:
    mode = "text" if g.text else "tokens"
    return {"request_id": g.params.request_id, "usage": use, "output_mode": mode, "choices": []}
