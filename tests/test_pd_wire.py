"""The request bodies of both PD wire protocols, as the engines' own proxies build them."""

from __future__ import annotations

import orjson

from router.pd import sglang_body, transfer_params, vllm_decode_body, vllm_prefill_body


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
