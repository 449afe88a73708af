"""Smoke test of bench/decide.py: it runs against this checkout and prints every part
at every worker count as a positive number of microseconds (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "decide.py"
PARTS = {"decide_path", "views", "match_tiers", "select", "for_model", "hit_blocks"}


def test_one_round_prints_every_part() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--rounds", "1", "--calls", "20", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(proc.stdout)
    assert set(result) == {"ours"}
    assert set(result["ours"]) == {"1", "4", "16"}
    for parts in result["ours"].values():
        assert set(parts) >= PARTS
        for values in parts.values():
            assert len(values) == 1 and values[0] > 0
