"""The disaggregated-pool simulator: prefill engines, the KV transfer, decode engines,
through the real index, codec and the router's two-sided choice."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from index.hashing import cacheable_blocks
from policies import EngineCosts
from router.cli import main
from sim.pd import PD_RULES, PdSimulation, parse_rule
from sim.simulator import SimConfig
from sim.synth import write_sessions
from sim.traces import Trace, TraceRequest, load_trace

BS = 16
BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    path = tmp_path_factory.mktemp("pd") / "sessions.jsonl"
    write_sessions(path, sessions=16, turns=4, gap_ms=4.0, turn_tokens=40, output=6)
    return load_trace(path, block_size=BS)


class Counted(PdSimulation):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.closed: Counter[str] = Counter()

    def _close(self, req):  # type: ignore[no-untyped-def]
        self.closed[req.rid] += 1
        super()._close(req)


@pytest.mark.parametrize("rule", [*PD_RULES, "least_load+decode_load"])
def test_every_request_is_prefilled_moved_and_decoded_once(trace: Trace, rule: str) -> None:
    config = SimConfig(workers=2, prefill_workers=2, l1_blocks=256, max_num_seqs=16)
    sim = Counted(trace, rule, config)
    report = sim.run()
    n = len(trace.requests)
    assert sim.closed == Counter({f"r{i}": 1 for i in range(n)})
    assert report["rejected"] == 0 and report["local_prefill_share"] == 0
    for r in sim.requests:
        leg = sim.prefill_leg[r.idx]
        assert r.arrival_ms <= leg.admit_ms <= leg.first_token_ms
        assert leg.first_token_ms <= sim.prefilled_ms[r.idx] <= sim.landed_ms[r.idx]
        assert sim.landed_ms[r.idx] <= r.admit_ms <= r.first_token_ms <= r.finish_ms
        # every block arrived by transfer: the decode engine computed only the tail (the
        # block of the last prompt token is never served from cache)
        assert r.computed == r.input_len
        assert (r.hit_gpu_blocks + r.hit_host_blocks) == cacheable_blocks(r.input_len, BS)
        assert sim.ids[leg.worker].startswith("p") and sim.ids[r.worker].startswith("d")
    decode_computed = sum(sim.engines[i].prefill_tokens for i in sim.decode_slots)
    assert decode_computed <= n * BS  # at most the last block each
    assert 0 < report["hit_rate"] <= trace.ideal_hit_rate() + 1e-12
    assert report["tpot_mean_ms"] > 0 and report["transfer_mean_ms"] > 0
    # every timed prefill was released (at its first token or its rejection)
    assert all(len(p) == 0 for p in sim.prefills.values())


def test_the_decode_side_index_comes_from_its_kv_events(trace: Trace) -> None:
    config = SimConfig(workers=2, prefill_workers=2, l1_blocks=256)
    sim = PdSimulation(trace, "cache_router", config)
    sim.run()
    for req in trace.requests:
        matches = sim.index.match_tiers(req.router_hashes.tolist(), speculative=False)
        for i in sim.decode_slots:
            gpu, host = sim.engines[i].cache.lookup(req.engine_hashes)
            assert matches.get(sim.ids[i], None) is None or matches[sim.ids[i]].total == gpu + host


def test_a_high_threshold_keeps_every_prefill_on_the_decode_engines(trace: Trace) -> None:
    config = SimConfig(workers=2, prefill_workers=2, local_prefill_tokens=1 << 20)
    report = PdSimulation(trace, "cache_router", config).run()
    sim = PdSimulation(trace, "cache_router", config)
    sim.run()
    assert report["local_prefill_share"] == 1.0 and report["transfer_blocks"] == 0
    assert all(sim.engines[i].prefill_tokens == 0 for i in sim.prefill_slots)


def test_transfer_time_follows_the_link(trace: Trace) -> None:
    slow = EngineCosts(prefetch_gbps=0.5)
    fast = EngineCosts(prefetch_gbps=100.0)
    reports = [
        PdSimulation(trace, "cache_router", SimConfig(workers=2, prefill_workers=2, costs=c)).run()
        for c in (slow, fast)
    ]
    assert reports[0]["transfer_mean_ms"] > 20 * reports[1]["transfer_mean_ms"]
    assert reports[0]["ttft_mean_ms"] > reports[1]["ttft_mean_ms"]


def test_a_prefill_sent_away_from_its_holder_hits_the_blocks_its_hint_moved(
    tmp_path: Path,
) -> None:
    # 1K-token system prompt, 200-token turns every 4 ms: the holder's queue grows and a few
    # prefills go to the other prefill engine with a hint; host memory takes the copies
    path = write_sessions(
        tmp_path / "t.jsonl", sessions=32, turns=4, gap_ms=4.0, system_tokens=1024,
        turn_tokens=200, output=6,
    )  # fmt: skip
    trace = load_trace(path, block_size=BS)
    config = SimConfig(workers=2, prefill_workers=2, l1_blocks=4096, l2_blocks=256, max_num_seqs=16)
    sim = PdSimulation(trace, "cache_router", config)
    report = sim.run()
    hinted = [leg for leg in sim.prefill_leg.values() if leg.hint_deadline_ms >= 0]
    assert hinted and report["prefetch_hints"] == sim.counters["prefetch_hints"] == len(hinted)
    assert all(sim.ids[leg.worker].startswith("p") for leg in hinted)
    # blocks crossed to the prefill engines, and the hinted prefills found all of them in
    # host memory, where nothing else put prefill-side blocks
    moved = report["prefetch_blocks"]
    assert moved > 0 and sum(leg.hit_host_blocks for leg in hinted) == moved
    assert sum(leg.hit_host_blocks for leg in sim.prefill_leg.values()) == moved
    # without hints nothing moves, and no prefill hits host memory
    off = PdSimulation(trace, "cache_router", config, policy_params={"prefetch": False})
    off.run()
    assert off.counters["prefetch_hints"] == off.counters["prefetch_blocks"] == 0
    assert sum(leg.hit_host_blocks for leg in off.prefill_leg.values()) == 0


def test_rules_by_name() -> None:
    assert parse_rule("sglang_pd") == ("sglang_cache_aware", "power_of_two")
    assert parse_rule("cache_aware+decode_load") == ("cache_aware", "decode_load")
    for bad in ("cache_aware", "decode_load+cache_aware", "x+y"):
        with pytest.raises(ValueError, match="PREFILL\\+DECODE"):
            parse_rule(bad)


def test_replay_runs_a_pd_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_sessions(tmp_path / "t.jsonl", sessions=6, turns=3, gap_ms=10.0)
    argv = ["replay", "--trace", str(path), "--block-size", "16", "--workers", "2"]
    argv += ["--prefill-workers", "2", "--jobs", "1", "--json", "-"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prefill_workers"] == 2 and out["workers"] == 2
    assert [r["policy"] for r in out["results"]] == list(PD_RULES)
    assert {"hit_rate", "ttft_p90_ms", "tpot_p90_ms", "transfer_mean_ms"} <= set(out["results"][0])
    argv = ["replay", "--trace", str(path), "--block-size", "16", "--prefill-workers", "1"]
    assert main([*argv, "--policies", "round_robin+nope"]) == 2
    assert "PREFILL+DECODE" in capsys.readouterr().err
    assert main([*argv, "--policies", "round_robin", "--jobs", "1"]) == 0
    assert "PD rule" in capsys.readouterr().out


def test_bench_pd_hits_decomposes_the_prefill_hit_rate(tmp_path: Path) -> None:
    path = write_sessions(tmp_path / "t.jsonl", sessions=8, turns=4, gap_ms=4.0, turn_tokens=40)
    argv = [sys.executable, str(BENCH / "pd_hits.py"), "--trace", str(path), "--block-size", "16"]
    argv += ["--workers", "2", "--prefill-workers", "2", "--rules", "cache_router,sglang_pd"]
    argv += ["--params", '{"recompute_weight": 4}', "--decode-params", '{"transfer_weight": 0}']
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["rule"] for r in rows] == ["cache_router", "sglang_pd"]
    assert rows[0]["params"] == {"recompute_weight": 4} and rows[1]["params"] == {}
    assert rows[0]["decode_params"] == {"transfer_weight": 0} and rows[1]["decode_params"] == {}
    for r in rows:
        assert 0 <= r["index_chosen"] <= r["index_best"] <= 1
        assert r["left_holder_hit_rate"] == pytest.approx(r["index_best"] - r["index_chosen"])
        assert 0 < r["hit_rate"] <= 1 and sum(r["prefills_per_engine"].values()) == 32
        assert 0 <= r["left_holder_lost_requests"] <= r["left_holder_requests"]
        assert r["left_holder_lost_hit_rate"] >= 0 and r["chosen_lost_hit_rate"] >= 0
        bands = r["reuse_bands"]
        assert list(bands) == ["<30s", "30-60s", "60-100s", "100-200s", ">=200s", "first"]
        assert sum(b["requests"] for b in bands.values()) == 32
        # all share one system prompt (4 blocks) and arrive within 128 ms: only the
        # first request is new
        assert bands["first"] == {"requests": 1, "reachable": 0, "hit": 0}
        assert bands["<30s"]["requests"] == 31 and bands["<30s"]["reachable"] >= r["hit_rate"]
        assert sum(b["hit"] for b in bands.values()) == pytest.approx(r["hit_rate"])
        per_engine = r["prefill_tokens_per_engine"]
        assert len(per_engine) == 2 and sum(per_engine) == r["prefill_tokens_computed"] > 0
        assert r["intake_cv"] >= 0
        assert r["intake_cv_150s"] is None  # the run lasts well under one 150 s window


def _pd_hits() -> Any:
    spec = importlib.util.spec_from_file_location("pd_hits", BENCH / "pd_hits.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_pd_hits_reuse_gap_is_to_the_latest_request_holding_the_shared_run() -> None:
    def req(at_s: float, n: int, hashes: list[int]) -> TraceRequest:
        return TraceRequest(at_s * 1000.0, n, 2, None, array("q", hashes), array("q", hashes))

    trace = Trace(
        "t",
        BS,
        0,
        [
            req(0, 49, [1, 2, 3]),
            req(40, 49, [1, 2, 9]),  # 2 blocks, last had by request 0
            req(45, 33, [1, 2]),  # 2 blocks: request 1 had them 5 s ago
            req(300, 17, [7]),  # no block seen
            # request 2 had blocks 1-2 more recently, but only request 0 had all three
            req(550, 49, [1, 2, 3]),
            req(560, 32, [7, 8]),  # 1 cacheable block: block 8 holds the last token
        ],
    )
    pd_hits = _pd_hits()
    inf = float("inf")
    assert pd_hits.last_shared(trace) == [
        (0, inf),
        (2, 40_000.0),
        (2, 5_000.0),
        (0, inf),
        (3, 550_000.0),
        (1, 260_000.0),
    ]
    tokens = sum(r.input_len for r in trace.requests)
    bands = pd_hits.reuse_bands(trace, {0: 0, 1: 2, 2: 1, 3: 0, 4: 0}, tokens)
    assert {k: v["requests"] for k, v in bands.items()} == {
        "<30s": 1,
        "30-60s": 1,
        "60-100s": 0,
        "100-200s": 0,
        ">=200s": 1,
        "first": 2,
    }  # request 5 was not served: not counted
    assert bands["30-60s"]["hit"] == pytest.approx(2 * BS / tokens)
    assert bands["<30s"]["reachable"] == pytest.approx(2 * BS / tokens)
    assert bands[">=200s"] == {"requests": 1, "reachable": pytest.approx(3 * BS / tokens), "hit": 0}


def test_bench_pd_hits_intake_cv_per_window() -> None:
    pd_hits = _pd_hits()
    assert pd_hits.cv([5, 5, 5]) == 0 and pd_hits.cv([0, 0]) == 0
    assert pd_hits.cv([1, 3]) == pytest.approx(0.5)  # sd 1, mean 2
    samples = [
        (0.0, [0, 0]),
        (50.0, [10, 0]),
        (100.0, [10, 10]),  # window (0, 100]: 10 / 10 added, cv 0
        (150.0, [30, 10]),  # window from 50: 20 / 10, cv 1/3
        (260.0, [30, 10]),  # window from 160: nothing added, skipped
    ]
    assert pd_hits.windowed_cv(samples, 100.0) == pytest.approx((0 + 1 / 3) / 2)
    assert pd_hits.windowed_cv(samples, 1000.0) is None


def test_bench_pd_hits_seed_reaches_the_trace_as_replay_seed_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Mooncake lines: the seed synthesizes their tokens (and the engines their hashes);
    # bench/pd_hits.py once passed it to the policies only
    path = tmp_path / "mooncake.jsonl"
    lines = []
    for i in range(48):
        shared = [1000 + i % 5, 2000 + i % 3] if i % 4 else [3000 + i]
        lines.append(
            {
                "timestamp": i * 3,
                "input_length": 512 * len(shared) + 100 + i,
                "output_length": 4 + i % 3,
                "hash_ids": [*shared, 5000 + i],
            }
        )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert load_trace(path, block_size=BS, seed=7).tokens(0) != load_trace(path, BS).tokens(0)
    pd_hits = _pd_hits()
    seen: list[tuple[int, int, int]] = []

    class Seen(pd_hits.Recorded):  # type: ignore[name-defined,misc]
        def __init__(self, trace: Trace, rule: str, config: SimConfig, **kw: object) -> None:
            seen.append((trace.seed, config.engine_seed, config.seed))
            super().__init__(trace, rule, config, **kw)

    monkeypatch.setattr(pd_hits, "Recorded", Seen)
    argv = ["--trace", str(path), "--block-size", str(BS), "--workers", "2"]
    argv += ["--prefill-workers", "2", "--rules", "cache_router", "--seed", "7"]
    assert pd_hits.main(argv) == 0
    row = json.loads(capsys.readouterr().out)
    assert seen == [(7, 7, 7)]
    argv = ["replay", "--trace", str(path), "--block-size", str(BS), "--workers", "2"]
    argv += ["--prefill-workers", "2", "--policies", "cache_router", "--seed", "7"]
    argv += ["--l1-blocks", str(SimConfig().l1_blocks), "--jobs", "1"]
    argv += ["--json", str(tmp_path / "r")]
    assert main(argv) == 0
    replayed = json.loads((tmp_path / "r").read_text())["results"][0]
    for key in ("hit_rate", "ttft_p90_ms", "tpot_p90_ms", "prefill_queue_mean_ms"):
        assert row[key] == replayed[key], key
