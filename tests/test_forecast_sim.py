"""The forecast against the simulator (the proof of issue 16, on a small seeded trace).

At several GPU sizes: the pooled forecast within 2 points of the simulator's pooled LRU,
and each worker's forecast under ``cache_aware`` routing within 3 points of the hit
rate its simulated engine delivered. (BENCHMARKS.md has the Mooncake and agent-trace
comparison at 4K..256K blocks per engine, with and without a host tier.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from sim.forecast import forecast
from sim.simulator import SimConfig
from sim.synth import write_sessions
from sim.traces import load_trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("forecast") / "sessions.jsonl"
    write_sessions(
        path, sessions=48, turns=8, gap_ms=40, system_tokens=512, turn_tokens=128, seed=5
    )
    return load_trace(path, 16)


@pytest.mark.parametrize("l1", [128, 256, 512, 1024])
def test_forecast_matches_the_simulated_caches(trace, l1: int) -> None:
    r = forecast(trace, SimConfig(workers=4, l1_blocks=l1), policy="cache_aware")
    assert r["pooled"]["predicted_hit_rate"] == pytest.approx(r["pooled_lru_hit_rate"], abs=0.02)
    sim = r["simulated"]["workers"]
    assert len(r["workers"]) >= 2
    for wid, w in r["workers"].items():
        assert w["predicted_hit_rate"] == pytest.approx(sim[wid]["hit_rate"], abs=0.03), wid
    assert r["predicted_routed_hit_rate"] == pytest.approx(r["simulated"]["hit_rate"], abs=0.02)


def test_forecast_command(trace, tmp_path: Path) -> None:
    src = tmp_path / "t.jsonl"
    write_sessions(src, sessions=12, turns=4, gap_ms=40, system_tokens=256, turn_tokens=64)
    png = tmp_path / "curves.png"
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "forecast", f"--trace={src}", "--block-size=16",
         "--workers=2", "--l1-blocks=64", "--l2-blocks=64", "--json=-", f"--plot={png}"],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    result = orjson.loads(out.stdout)
    assert result["requests"] == 48
    assert result["pooled"]["capacity_blocks"] == 2 * (64 + 64)
    assert 0 < result["ceiling_hit_rate"] < 1
    assert png.stat().st_size > 10_000
    table = subprocess.run(
        [sys.executable, "-m", "router.cli", "forecast", f"--trace={src}", "--block-size=16",
         "--workers=2", "--l1-blocks=64", "--policy=cache_aware"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "under cache_aware: predicted" in table and "saturates" in table
    bad = subprocess.run(
        [sys.executable, "-m", "router.cli", "forecast", "--trace=/nonexistent.jsonl"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "no such trace file" in bad.stderr
