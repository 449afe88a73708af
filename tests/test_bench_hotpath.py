"""Smoke test of bench/hotpath.py: it runs (cache-router alone; the peers are optional),
prints one JSON object, every request answered. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# slow: their own CI step (`pytest -m slow`), kept out of the main suite's ~10 minutes
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "hotpath.py"


def _tokenizer(tmp_path: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = "cache router engine prefix token block hash worker latency 0123456789"
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([words] * 10, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path / "tokenizer.json")


def _run(tmp_path: Path, *extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--tokenizer", _tokenizer(tmp_path),
         "--peers-python", str(tmp_path / "no-such-python"), "--processes", "1", *extra],
        capture_output=True, text=True, timeout=240, check=False, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def _answered(rep: dict[str, Any]) -> None:
    """Every request of one interference run answered 200 (failures are counted apart
    from the timed ones, so a fast refusal cannot pass for a fast answer)."""
    assert rep["long_prompts_sent"] > 0 and rep["long_prompt_errors"] == 0
    assert rep["short_errors_idle"] == 0 and rep["short_errors_busy"] == 0
    assert rep["short_requests_busy"] > 0 and rep["busy_p99_ms"] > 0


def test_quick_run_prints_complete_json(tmp_path: Path) -> None:
    out = _run(tmp_path)
    ours = out["cache_router"]
    for key in ("chat_100", "chat_2048", "completion_100", "completion_2048"):
        row = ours["lengths"][key]
        assert row["errors"] == 0 and row["cpu_ms_per_request"] > 0, key
    assert ours["multi_turn"]["errors"] == 0 and ours["multi_turn"]["turns"] >= 3
    _answered(ours["interference"])
    for n in (1, 4, 16):
        assert ours[f"saturation_rps_{n}_workers"] > 0
    assert "sglang_router" not in out
    assert out["tokenizer_alone_cpu_ms"]["100"] > 0


def test_multi_turn_only_runs_both_orders_with_two_conversations(tmp_path: Path) -> None:
    """The machine drifts during a run, so the phase runs the targets in turn and then in
    the reverse order with a second conversation, and gives both passes' mean."""
    out = _run(tmp_path, "--multi-turn-only", "--targets", "cache_router")
    ours = out["cache_router"]
    passes = ours["multi_turn_passes"]
    assert len(passes) == 2 and all(p["errors"] == 0 and p["turns"] >= 3 for p in passes)
    mean = ours["multi_turn"]
    assert mean["turns"] == passes[0]["turns"] + passes[1]["turns"]
    for key in ("cpu_ms_per_turn_mean", "p50_ms"):
        assert mean[key] == pytest.approx((passes[0][key] + passes[1][key]) / 2)
        assert passes[0][key] > 0 and passes[1][key] > 0
    assert len(out["direct"]["multi_turn_passes"]) == 2  # the engine alone, both passes
    assert out["direct"]["multi_turn"]["cpu_ms_per_turn_mean"] is None  # no router CPU


def test_shared_prefix_only_sends_agent_turns_in_both_orders(tmp_path: Path) -> None:
    """Agent chats in one user message each, every turn answered, two passes averaged."""
    out = _run(tmp_path, "--shared-prefix-only", "--targets", "cache_router")
    ours = out["cache_router"]
    passes = ours["shared_prefix_passes"]
    assert len(passes) == 2 and all(p["errors"] == 0 and p["turns"] == 8 for p in passes)
    mean = ours["shared_prefix"]
    assert mean["turns"] == 16 and mean["cpu_ms_per_turn_mean"] > 0
    assert out["direct"]["shared_prefix"]["cpu_ms_per_turn_mean"] is None


def test_interference_only_repeats_with_the_spread(tmp_path: Path) -> None:
    out = _run(tmp_path, "--interference-only", "--repeat", "2", "--targets", "cache_router")
    assert set(out) & {"cache_router", "cache_router_no_forecast", "direct"} == {"cache_router"}
    reps = out["cache_router"]["interference"]
    assert len(reps) == 2
    for rep in reps:
        _answered(rep)
    spread = out["cache_router"]["interference_spread"]
    assert len(spread["p99_busy_over_idle"]) == 2 and spread["errors"] == 0


def test_cpu_counts_a_process_started_after_the_list_was_taken(tmp_path: Path) -> None:
    """A router starts its tokenizer processes at its first long prompt: ``cpu_ns`` of the
    router's pid list, taken before, still counts their run time."""
    sys.path.insert(0, str(ROOT / "bench"))
    from hotpath import cpu_ns

    done = tmp_path / "burnt"
    child = (
        "import pathlib, time\n"
        "x = 0\n"
        "for i in range(3_000_000): x += i\n"
        f"pathlib.Path({str(done)!r}).touch()\n"
        "time.sleep(60)\n"
    )
    start = (
        "import subprocess, sys, time; time.sleep(0.2); "
        f"subprocess.run([sys.executable, '-c', {child!r}])"
    )
    parent = subprocess.Popen([sys.executable, "-c", start])  # the child comes later
    kids = Path(f"/proc/{parent.pid}/task/{parent.pid}/children")
    children: list[int] = []
    try:
        pids = [parent.pid]  # the list a bench takes before the child exists
        for _ in range(600):
            if done.exists():
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert done.exists(), "the child never finished burning"
        children = [int(p) for p in kids.read_text().split()]
        assert children, "the child is not alive"
        child_ns = cpu_ns(children)
        assert child_ns > 0
        assert cpu_ns(pids) >= child_ns
    finally:
        for pid in children:
            subprocess.run(["kill", str(pid)], check=False)
        parent.kill()
        parent.wait()
