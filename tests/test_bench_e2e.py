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
    keys |= {f"burst_{n}x{e2e.BURST_TOKENS // n}" for n in e2e.BURSTS}
    assert set(model) == keys
    # the model charges tokens, not prompts: 8 prompts of 128 cost less than one of 1,024
    # (less attention), never more
    assert model["burst_8x128"] < model["burst_1x1024"] == model["prefill_1024"]


def test_the_variants_are_cache_aware_started_with_their_settings() -> None:
    e2e = _e2e()
    for kind in ("cache_aware_open", "cache_aware_blind", "cache_aware_predict"):
        cmd = e2e.router_command(kind, 1, 2, [], Path("/m"), "/p/python", "nats://n")
        assert cmd[cmd.index("--policy") + 1] == "cache_aware" and "nats://n" in cmd
        assert kind in e2e.OURS and kind not in e2e.ROUTERS
    assert e2e.VARIANTS["_open"] == {"CACHE_ROUTER_ADMISSION": "false"}
    cmd = e2e.router_command("round_robin", 1, 2, [], Path("/m"), "/p/python", None)
    assert cmd[cmd.index("--policy") + 1] == "round_robin"
    # round robin beside cache_aware's event path: its policy, the events' nats
    cmd = e2e.router_command("round_robin_events", 1, 2, [], Path("/m"), "/p/python", "nats://n")
    assert cmd[cmd.index("--policy") + 1] == "round_robin" and "nats://n" in cmd
    assert "round_robin_events" in e2e.OURS


def _runs(ttft: dict[str, list[list[float]]], cached: dict[str, list[float]] | None = None) -> Any:
    """Made-up reports: router -> its runs' TTFTs by round (the same requests in each
    round, keyed as aiperf's records are); ``cached``: each router's cached share."""
    runs, samples = [], {}
    for router, by_round in ttft.items():
        for rnd, values in enumerate(by_round):
            tag = f"{rnd}-conv-{router}"
            runs.append({"router": router, "workload": "conv", "tag": tag, "round": rnd})
            share = (cached or {}).get(router, 0.0)
            samples[tag] = {f"session_{i:06d}:0": (t, 100.0, 100.0 * share)
                            for i, t in enumerate(values)}  # fmt: skip
    return runs, samples


def test_paired_diffs_cancel_the_rounds_drift_and_judge_a_small_steady_gap() -> None:
    e2e = _e2e()
    rng = __import__("random").Random(1)
    base = [[rng.uniform(100, 2000) for _ in range(100)] for _ in range(6)]
    # each round slows both routers alike (x1 .. x2.5: the machine's drift between rounds,
    # far more than the gap); round robin is 30 ms slower on every request
    ours = [[t * (1 + 0.3 * r) for t in ts] for r, ts in enumerate(base)]
    rr = [[t + 30 for t in ts] for ts in ours]
    runs, samples = _runs({"cache_aware": ours, "round_robin": rr},
                          {"cache_aware": 0.3, "round_robin": 0.1})  # fmt: skip
    out = e2e.paired(runs, samples, boot=300)["conv"]["round_robin"]
    assert out["rounds"] == 6
    for m in ("p50", "p90", "p99"):
        assert out[m]["diffs"] == [30.0] * 6 and out[m]["diff_mean"] == 30.0
        assert out[m]["noise_sd"] == 0.0 and out[m]["sd"] > 100  # the drift, paired away
        assert out[m]["verdict"] == "ahead"  # round robin's TTFT is higher: cache_aware ahead
    assert out["hit"]["diff_mean"] == -0.2 and out["hit"]["verdict"] == "ahead"
    assert (out["p50"]["forward"], out["p50"]["reversed"]) == (30.0, 30.0)


def test_a_gap_that_changes_sides_between_rounds_is_within_noise() -> None:
    e2e = _e2e()
    base = [[float(100 + 10 * i) for i in range(100)] for _ in range(4)]
    # the other router 300 ms slower in the forward rounds, 300 ms faster in reversed ones:
    # no standing either way, and the order effect shows
    other = [[t + (300 if r % 2 == 0 else -300) for t in ts] for r, ts in enumerate(base)]
    runs, samples = _runs({"cache_aware": base, "sglang_router": other})
    out = e2e.paired(runs, samples, boot=300)["conv"]["sglang_router"]
    p50 = out["p50"]
    assert p50["diff_mean"] == 0.0 and p50["verdict"] == "within noise"
    assert p50["ci"][0] < 0 < p50["ci"][1] and p50["ci_t"][0] < 0 < p50["ci_t"][1]
    assert (p50["forward"], p50["reversed"]) == (300.0, -300.0)
    assert round(p50["noise_sd"]) == round((300**2 * 4 / 3) ** 0.5)  # sd of +-300 over 4
    assert out["hit"]["verdict"] == "within noise"  # equal hit rates: no side


def test_a_behind_verdict_and_rounds_without_both_routers_left_out() -> None:
    e2e = _e2e()
    rng = __import__("random").Random(2)
    ours = [[rng.uniform(200, 900) for _ in range(100)] for _ in range(5)]
    rr = [[t - 50 + rng.uniform(-5, 5) for t in ts] for ts in ours]  # round robin faster
    runs, samples = _runs({"cache_aware": ours, "round_robin": rr})
    runs[1]["failed"] = "boom"  # cache_aware's round 1 failed: that round has no pair
    out = e2e.paired(runs, samples, boot=300)["conv"]["round_robin"]
    assert out["rounds"] == 4
    assert -56 < out["p50"]["diff_mean"] < -44 and out["p50"]["verdict"] == "behind"
    assert out["p50"]["ci"][1] < 0 and out["p50"]["ci_t"][1] < 0
    # one round is no interval: never a verdict on it
    one = e2e.paired(runs[:1] + runs[5:6], samples, boot=50)["conv"]["round_robin"]
    assert one["rounds"] == 1 and one["p50"]["verdict"] == "within noise"
    # the hit rate's side: a higher hit rate is better
    assert e2e.verdict("hit", [0.01, 0.02], [0.005, 0.03]) == "behind"
    assert e2e.verdict("p99", [5.0, 20.0], [-1.0, 30.0]) == "within noise"  # t includes 0


def test_the_printed_table_has_a_paired_line_under_each_other_router() -> None:
    e2e = _e2e()
    ours = [[float(100 + i) for i in range(100)] for _ in range(4)]
    rr = [[t + 20 for t in ts] for ts in ours]
    runs, samples = _runs({"cache_aware": ours, "round_robin": rr})
    pooled = {"runs": 4, "client_hit_rate": 0.05, "router_cpu_ms_per_request_net": 7.5,
              "ttft_ms": {"p50": 150.0, "p90": 190.0, "p99": 199.0}}  # fmt: skip
    report = {"results": {"conv": {"cache_aware": pooled, "round_robin": pooled}},
              "runs": runs, "paired": e2e.paired(runs, samples, boot=50)}  # fmt: skip
    lines = e2e.table(report).splitlines()
    paired_lines = [x for x in lines if x.startswith("| round_robin - cache_aware, 4 rounds")]
    assert len(paired_lines) == 1 and "p50 +20 [+20, +20] ahead" in paired_lines[0]
    assert not any(x.startswith("| cache_aware - ") for x in lines)
