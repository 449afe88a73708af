"""A small run of bench/load.py: two router replicas in front of two mock engines under
concurrent load, every request answered once and only once (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "load.py"


def test_no_request_lost_or_duplicated_through_two_replicas() -> None:
    n = 1500
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--requests", str(n), "--concurrency", "48"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["ok"] == n and out["failures"] == {}
    assert out["lost"] == 0 and out["duplicated"] == 0 and out["unknown_ids_at_engines"] == 0
    assert sum(out["per_engine"].values()) == n
    assert sorted(out["per_replica"].values()) == [n // 2, n // 2]  # both replicas served
    assert all(v > 0 for v in out["per_engine"].values())
    assert out["requests_per_s"] > 0 and out["latency_ms"]["p50"] > 0
