"""Smoke test of bench/index.py: it runs, prints one JSON object, every number is sane.

No timing assertions: the values only have to exist and be positive. When Dynamo's
``RadixTree`` is importable here, the side-by-side section must be there and agree.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "index.py"
SECTIONS = ("hash", "match", "match_tiers", "match_linear", "ingest", "memory")


def _positive_numbers(section: dict[str, object]) -> None:
    assert section, "empty section"
    for key, value in section.items():
        assert isinstance(value, int | float) and value > 0, (key, value)


def test_quick_run_prints_complete_json() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--workers", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)

    config = out["config"]
    assert config["workers"] == 3  # explicit flags win over the --quick preset
    assert config["prompt_blocks"] == 512 and config["block_size"] == 64
    assert 0 < config["index_blocks"] <= config["pairs"]
    assert config["store_events"] > 0 and config["mean_match_depth_blocks"] > 0
    for name in SECTIONS:
        _positive_numbers(out[name])
    assert {"p50_us", "p99_us", "full_hit_p50_us"} <= out["match"].keys()
    assert {"ours_list_mtok_s", "ours_array_mtok_s"} <= out["hash"].keys()
    assert {"index_bytes_per_block", "index_bytes_per_pair", "ingest_bytes_per_pair"} <= out[
        "memory"
    ].keys()

    if importlib.util.find_spec("dynamo") is None:
        assert out["dynamo"] is None and out["ratios"] is None
        return
    dynamo = out["dynamo"]
    assert dynamo["agree"] is True and dynamo["mismatches"] == 0
    _positive_numbers(dynamo["find_matches"])
    _positive_numbers(dynamo["ingest"])
    assert dynamo["rss_bytes_per_pair_approx"] >= 0
    _positive_numbers(out["ratios"])
    assert "ingest_rate_ours_over_dynamo" in out["ratios"]
