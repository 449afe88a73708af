"""Smoke test of bench/scale.py: it runs, prints one JSON object, the numbers are sane.

No timing assertions: values only have to exist and be positive; every batch applied.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
