"""Smoke test of bench/scale.py: it runs, prints one JSON object, the numbers are sane.

No timing assertions: values only have to exist and be positive; every batch applied.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# slow: their own CI step (`pytest -m slow`), kept out of the main suite's ~10 minutes
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parent.parent / "bench" / "scale.py"


def test_quick_run_prints_complete_json() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--workers", "4"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["config"]["workers"] == 4
    ingest = out["ingest"]
    assert ingest["lost_batches"] == 0 and ingest["python_blocks_per_s"] > 0
    assert ingest["python_blocks_per_s_best"] >= ingest["python_blocks_per_s"]
    if out["config"]["native"]:
        assert ingest["native_blocks_per_s"] > 0
        under = out["under_ingest"]
        assert under["achieved_blocks_per_s"] > 0 and under["match_8k_idle_p99_us"] > 0
        assert out["memory"]["native_heap_bytes_per_pair"] > 0
        assert ingest["native_runs_blocks_per_s"] > 0
        rows = out["nats"]
        assert [(r["transport"], r["reader"]) for r in rows] == [
            ("core", "python"),
            ("core", "native"),
            ("jetstream", "python"),
            ("jetstream", "native"),
        ]
        for row in rows:
            assert row["published_batches"] > 0 and row["requests_idle"] > 0
            assert row["request_under_ingest_p99_us"] > 0


def test_targets_section_shape_and_same_decisions() -> None:
    """``--only targets`` at two small sizes (the larger past the pruning threshold):
    every part at every size, the ratios, and ``least_load``'s pruned decisions the
    unpruned ones (its board key is the policy's)."""
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--only", "targets"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)["targets"]
    if not out["by_size"]:
        return  # no native core: nothing to measure
    assert out["sizes"] == [16, 72] and set(out["by_size"]) == {"16", "72"}
    for size, row in out["by_size"].items():
        match = row["match"]
        assert match["targets"] == int(size) and match["holders_mean"] > 0
        assert match["match_tiers_us"] > 0 and match["pick_us"] > 0
        for policy, d in row["decide"].items():
            assert d["pruned_us"] > 0 and d["unpruned_us"] > 0
            assert d["candidates"] == int(size) and d["decisions"] == 64
            if int(size) <= 64:  # below the threshold: nothing pruned, every decision alike
                assert d["kept_candidates_max"] == d["candidates"]
                assert d["same_decisions"] == 64, policy
            else:
                assert d["kept_candidates_max"] < d["candidates"]
        least = row["decide"]["least_load"]
        assert least["same_decisions"] + least["same_tie_class"] == 64 and least["missed"] == 0
        assert row["ingest"]["lost_batches"] == 0
        assert row["memory"]["native_heap_bytes_per_pair"] > 0
    assert "decide.cache_aware.pruned_us" in out["ratio_72_over_16"]
