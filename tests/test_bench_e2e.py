"""bench/e2e.py's own arithmetic (the engines and aiperf run in .ci/real_engines.sh's smoke):
trace lines scaled to 32-token hash blocks the way aiperf builds prompts from them, and the
per-run summary from aiperf's records."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent.parent / "bench" / "e2e.py"


def _e2e() -> Any:
    spec = importlib.util.spec_from_file_location("e2e", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["e2e"] = module
    spec.loader.exec_module(module)
    return module


def test_lines_are_scaled_to_32_token_blocks_and_filtered() -> None:
    e2e = _e2e()
    rows = [
        {
            "timestamp": 1000,
            "input_length": 6758,
            "output_length": 500,
            "hash_ids": list(range(14)),
        },
        {"timestamp": 3000, "input_length": 120_000, "output_length": 10, "hash_ids": [1] * 235},
        {"timestamp": 5000, "input_length": 512, "output_length": 3, "hash_ids": [7]},
    ]
    out = e2e.scaled(rows, 10, 4096, 16, 2.0)
    assert [r["timestamp"] for r in out] == [0.0, 2000.0]  # from 0, halved; the long one left
    first, last = out
    # aiperf: (len(hash_ids) - 1) full blocks and a last one of the rest, so 13 * 32 < n <= 14 * 32
    assert first["input_length"] == 423 and 13 * 32 < 423 <= 14 * 32
    assert first["output_length"] == 16  # 500 / 16, capped
    assert (last["input_length"], last["output_length"]) == (32, 1)
    assert len(e2e.scaled(rows, 1, 4096, 16, 1.0)) == 1


def test_a_run_is_summarized_from_aiperf_records() -> None:
    e2e = _e2e()

    def rec(ttft: float | None, start: int, end: int, cached: int = 0) -> dict[str, Any]:
        metrics = {"usage_prompt_tokens": {"value": 100}}
        metrics["usage_prompt_cache_read_tokens"] = {"value": cached}
        if ttft is not None:
            metrics["time_to_first_token"] = {"value": ttft}
        meta = {"request_start_ns": start * 10**9, "request_end_ns": end * 10**9}
        return {"metadata": meta, "metrics": metrics, **({} if ttft else {"error": {"code": 400}})}

    recs = [rec(100, 0, 1, 50), rec(300, 1, 2), rec(2000, 2, 4, 100), rec(None, 3, 3)]
    assert e2e.span_s(recs) == 4.0
    out = e2e.summarize(recs, 1000, e2e.span_s(recs))
    assert out["requests"] == 4 and out["errors"] == 1
    assert out["ttft_ms"]["p50"] == 300 and out["ttft_ms"]["p99"] == 2000
    assert out["client_hit_rate"] == 0.5  # 150 of the answered requests' 300 prompt tokens
    assert out["goodput_rps"] == 0.5 and out["within_slo"] == 0.5  # 2 of 4 within 1 s, in 4 s


def test_placement_names_each_requests_engine_parent_and_the_queue_it_met() -> None:
    e2e = _e2e()

    def rec(row: int, rid: str, start: float, ttft: float, end: float, cached: int) -> Any:
        meta = {"conversation_id": f"session_{row:06d}", "x_request_id": rid,
                "request_start_ns": int(start * 1e9), "request_end_ns": int(end * 1e9)}  # fmt: skip
        metrics = {"time_to_first_token": {"value": ttft}, "usage_prompt_tokens": {"value": 100},
                   "usage_prompt_cache_read_tokens": {"value": cached}}  # fmt: skip
        return {"metadata": meta, "metrics": metrics}

    rows = [{"hash_ids": [1, 2, 3]}, {"hash_ids": [9]}, {"hash_ids": [1, 2, 3, 4]}]
    recs = [rec(0, "a", 0.0, 500, 2.0, 0), rec(1, "b", 0.1, 100, 0.5, 0),
            rec(2, "c", 1.0, 900, 3.0, 90)]  # fmt: skip
    where = {"a-0": "e0", "b": "e1", "c-0": "e1"}  # vLLM's ids: the header's, a suffix
    out = e2e.placement(recs, rows, where)
    a, b, c = out["requests"]
    assert (a["engine"], b["engine"], c["engine"]) == ("e0", "e1", "e1")
    # c builds on a (3 blocks shared), sent after a's first token, to the other engine
    assert (c["parent"], c["shared_blocks"], c["parent_engine"], c["parent_done"]) == (
        0, 3, "e0", True,
    )  # fmt: skip
    # when c was sent a was decoding on e0; b had finished
    assert c["ahead"] == {"e0": {"prefilling": 0, "decoding": 1, "tokens": 0}}
    assert b["ahead"] == {"e0": {"prefilling": 1, "decoding": 0, "tokens": 100}}
    assert out["steps"] == 1 and out["left"]["n"] == 1 and out["stayed"]["n"] == 0


def test_measure_engine_sets_the_simulators_cpu_engine_beside_what_it_measures() -> None:
    # the numbers --measure-engine prints against one vLLM engine alone: the simulator's
    # ``cpu`` costs (bench/sweep.py, the engines on a shared machine) over 1.5
    e2e = _e2e()
    model = e2e.modelled()
    # one step of 8 ms and 1,024 prompt tokens at 0.1 ms each, with their attention
    assert model["prefill_1024"] == round(8 + 1024 * (0.1 + 2e-4 / 1.5 * 512), 1)
    assert model[f"step_7_ctx{e2e.CONTEXTS[-1]}"] > model["step_1_ctx32"] > 8.0
    keys = {f"prefill_{n}" for n in e2e.PREFILL_SIZES}
    keys |= {f"{k}_{d}_ctx{c}" for k in (f"prefill_{e2e.PROBE}_beside", "step")
             for d in e2e.DECODES for c in e2e.CONTEXTS}  # fmt: skip
    assert set(model) == keys


def test_the_variants_are_cache_aware_started_with_their_settings() -> None:
    e2e = _e2e()
    for kind in ("cache_aware_open", "cache_aware_blind", "cache_aware_predict"):
        cmd = e2e.router_command(kind, 1, 2, [], Path("/m"), "/p/python", "nats://n")
        assert cmd[cmd.index("--policy") + 1] == "cache_aware" and "nats://n" in cmd
        assert kind in e2e.OURS and kind not in e2e.ROUTERS
    assert e2e.VARIANTS["_open"] == {"CACHE_ROUTER_ADMISSION": "false"}
    cmd = e2e.router_command("round_robin", 1, 2, [], Path("/m"), "/p/python", None)
    assert cmd[cmd.index("--policy") + 1] == "round_robin"
