"""The request bodies of both PD wire protocols, as the engines' own proxies build them."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest.mock import patch

import orjson
import pytest

from router.pd.exchange import (
    _TpotClock,
    sglang_body,
    transfer_params,
    vllm_decode_body,
    vllm_prefill_body,
)


def test_vllm_prefill_asks_for_a_remote_decode_of_one_token() -> None:
    body = {"model": "m", "messages": [], "stream": True, "max_tokens": 50,
            "max_completion_tokens": 50, "stream_options": {"include_usage": True},
            "min_tokens": 5, "temperature": 0.3}  # fmt: skip
    sent = orjson.loads(vllm_prefill_body(body))
    assert sent["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }  # fmt: skip
    assert sent["stream"] is False and sent["max_tokens"] == 1
    assert sent["max_completion_tokens"] == 1
    assert "stream_options" not in sent and "min_tokens" not in sent
    assert sent["temperature"] == 0.3 and body["max_tokens"] == 50  # the client's is untouched


def test_vllm_decode_carries_the_prefill_engines_params() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_host": "h"}
    sent = orjson.loads(vllm_decode_body({"model": "m", "stream": True}, params))
    assert sent == {"model": "m", "stream": True, "kv_transfer_params": params}


def test_transfer_params_of_an_answer() -> None:
    assert transfer_params(b'{"kv_transfer_params": {"remote_host": "h"}}') == {"remote_host": "h"}
    for answer in (b'{"kv_transfer_params": null}', b'{"id": 1}', b"not json", b"[1]",
                   b'{"kv_transfer_params": {}}'):  # fmt: skip
        assert transfer_params(answer) is None  # the decode request goes as sent


def test_sglang_adds_the_bootstrap_fields_for_both_engines() -> None:
    sent = orjson.loads(sglang_body({"model": "m", "stream": False}, "10.0.0.2", 8998, 1 << 62))
    assert sent == {"model": "m", "stream": False, "bootstrap_host": "10.0.0.2",
                    "bootstrap_port": 8998, "bootstrap_room": 1 << 62}  # fmt: skip


def _tpot_of(bodies: list[tuple[float, bytes]]) -> _TpotClock:
    """Feed ``(time, body)`` pairs through a clock whose time is ours."""
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        sent.append(message["body"])

    clock = _TpotClock(send)

    async def run() -> None:
        for at, body in bodies:
            with patch("router.pd.exchange.time.perf_counter", return_value=at):
                await clock.send({"type": "http.response.body", "body": body})

    asyncio.run(run())
    assert sent == [b for _, b in bodies]  # the client gets every body unchanged
    return clock


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_tpot_counts_the_usage_tokens_not_the_events() -> None:
    # 3 events carrying 4 tokens each (as with a stream interval of 4), then the usage
    token = {"choices": [{"index": 0, "delta": {"content": "abcd"}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 12}}
    bodies = [(1.0, _event(token)), (1.3, _event(token)), (1.6, _event(token))]
    bodies += [(1.6, _event(usage) + b"data: [DONE]\n\n")]
    clock = _tpot_of(bodies)
    assert clock.events == 3 and clock.tokens == 12
    assert clock.tpot() == pytest.approx(0.6 / 11)


def test_tpot_without_usage_counts_one_token_per_event() -> None:
    token = {"choices": [{"index": 0, "text": "a"}]}
    clock = _tpot_of([(2.0, _event(token)), (2.1, _event(token) + _event(token)), (2.3, b"")])
    assert clock.tokens == 3 and clock.tpot() == pytest.approx(0.05)
    assert _tpot_of([(1.0, _event(token) + b"data: [DONE]\n\n")]).tpot() is None


def test_tpot_reads_a_usage_cut_between_two_bodies() -> None:
    usage = _event({"choices": [], "usage": {"completion_tokens": 40}})
    cut = usage.index(b"tokens") + 2
    token = _event({"choices": [{"index": 0, "text": "a"}]})
    clock = _tpot_of([(0.0, token), (3.9, token + usage[:cut]), (3.9, usage[cut:])])
    assert clock.tokens == 40 and clock.tpot() == pytest.approx(0.1)
