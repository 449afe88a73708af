"""``cache-router tune``: the coordinate search over host size and cache_aware's parameters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from sim.synth import write_sessions
from sim.traces import load_trace
from sim.tune import host_candidates


def test_tune_searches_and_picks_the_lowest_ttft(tmp_path: Path) -> None:
    src = write_sessions(
        tmp_path / "t.jsonl", sessions=24, turns=6, gap_ms=40, system_tokens=256,
        turn_tokens=96, seed=2,
    )  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "tune", f"--trace={src}", "--block-size=16",
         "--workers=3", "--l1-blocks=128", "--hosts=0,256", "--weights=0",
         "--fractions=1", "--jobs=2", "--json=-"],
        capture_output=True, timeout=300, check=True,
    )  # fmt: skip
    result = orjson.loads(out.stdout)
    runs = result["runs"]
    assert len(runs) == 2 + 1 + 1  # hosts, then one weight, then one fraction
    assert {r["l2"] for r in runs[:2]} == {0, 256}
    assert runs[2]["params"] == {"recompute_weight": 0.0}
    assert "prefetch_fraction" in runs[3]["params"]
    best = result["best"]
    assert best in runs
    assert best["ttft_mean_ms"] <= 1.01 * result["default"]["ttft_mean_ms"]
    assert all(0 <= r["hit_rate"] <= 1 for r in runs)
    bad = subprocess.run(
        [sys.executable, "-m", "router.cli", "tune", f"--trace={src}", "--fractions=2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--fractions" in bad.stderr


def test_host_candidates_come_from_the_saturation_point(tmp_path: Path) -> None:
    src = write_sessions(
        tmp_path / "t.jsonl", sessions=24, turns=6, gap_ms=40, system_tokens=256,
        turn_tokens=96, seed=2,
    )  # fmt: skip
    trace = load_trace(src, 16)
    hosts = host_candidates(trace, workers=3, l1=16)
    assert hosts[0] == 0 and len(hosts) == 4
    assert hosts[1:] == sorted(hosts[1:]) and hosts[2] == 2 * hosts[1]
    assert host_candidates(trace, workers=3, l1=1 << 20) == [0]  # GPU holds it all
