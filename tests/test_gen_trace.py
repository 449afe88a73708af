"""``cache-router gen-trace``: seeded, shaped as documented, readable by the replay."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import pytest

from router.cli import main
from sim.gen_trace import generate, write
from sim.traces import MOONCAKE_BLOCK, load_trace


def _sessions(lines: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = defaultdict(list)
    for line in lines:
        by[line["session_id"]].append(line)
    return by


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a = generate("chat", sessions=40, seed=3)
    assert a == generate("chat", sessions=40, seed=3)
    assert a != generate("chat", sessions=40, seed=4)
    # more sessions extend the same draw: the first ones are unchanged
    first = [x for x in generate("agent", sessions=6) if x["session_id"] in {"agent0", "agent1"}]
    assert first == [
        x for x in generate("agent", sessions=3) if x["session_id"] in {"agent0", "agent1"}
    ]


@pytest.mark.parametrize("shape", ["chat", "agent"])
def test_lines_are_valid_mooncake_sorted_and_sessions_grow_by_prefix(shape: str) -> None:
    lines = generate(shape, sessions=50, seed=1)
    times = [x["timestamp"] for x in lines]
    assert times == sorted(times)
    for x in lines:
        assert len(x["hash_ids"]) == -(-x["input_length"] // MOONCAKE_BLOCK)
    for turns in _sessions(lines).values():
        for prev, nxt in itertools.pairwise(turns):
            full = prev["input_length"] // MOONCAKE_BLOCK
            # the next turn repeats every full block of the previous prompt, then grows
            assert nxt["hash_ids"][:full] == prev["hash_ids"][:full]
            grown = nxt["input_length"] - prev["input_length"]
            if shape == "chat":
                assert prev["output_length"] + 200 <= grown <= prev["output_length"] + 2000
            else:
                assert prev["output_length"] + 512 <= grown <= prev["output_length"] + 4096


def test_chat_shape() -> None:
    lines = generate("chat", sessions=200, seed=0)
    sessions = _sessions(lines)
    assert len(sessions) == 200
    assert all(3 <= len(t) <= 10 for t in sessions.values())
    # sessions share a few system prompts (first block), popular ones by many sessions
    firsts = defaultdict(int)
    for turns in sessions.values():
        firsts[turns[0]["hash_ids"][0]] += 1
    assert 5 <= len(firsts) <= 20 and max(firsts.values()) >= 20
    assert all(2048 + 200 <= t[0]["input_length"] <= 8192 + 2000 for t in sessions.values())


def test_agent_shape() -> None:
    sessions = _sessions(generate("agent", sessions=40, seed=0))
    for turns in sessions.values():
        assert 5120 <= turns[0]["input_length"] <= 20480
        assert turns[-1]["input_length"] <= 102_400
        assert all(50 <= t["output_length"] <= 300 for t in turns)
    assert max(t[-1]["input_length"] for t in sessions.values()) > 30_720
    firsts = {t[0]["hash_ids"][0] for t in sessions.values()}
    assert len(firsts) <= 4  # the shared tool prompts


def test_cli_writes_a_trace_the_replay_reads_with_its_sessions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chat.jsonl"
    assert (
        main(["gen-trace", "--shape", "chat", "--sessions", "5", "--seed", "2", "--out", str(out)])
        == 0
    )
    assert "requests" in capsys.readouterr().err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == generate("chat", sessions=5, seed=2)
    trace = load_trace(out, 64)
    assert {r.session for r in trace.requests} == {f"chat{i}" for i in range(5)}
    assert 0.3 < trace.ideal_hit_rate() < 1
    assert main(["gen-trace", "--shape", "chat", "--sessions", "0", "--out", str(out)]) == 2
    assert "sessions" in capsys.readouterr().err


def test_written_file_round_trips(tmp_path: Path) -> None:
    lines = generate("agent", sessions=2, seed=5)
    path = write(tmp_path / "a.jsonl", lines)
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines


def test_think_time_sets_the_gaps_between_a_sessions_turns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--think-time 0.1-1``: turns 0.1-1 s apart (issue 31's short think times); the
    default stays 3-30 s, and a range that is empty or not chat's fails."""
    out = tmp_path / "chat.jsonl"
    argv = ["gen-trace", "--shape", "chat", "--sessions", "20", "--out", str(out)]
    assert main([*argv, "--think-time", "0.1-1"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == generate("chat", sessions=20, think_s=(0.1, 1.0))
    for think, (lo, hi) in ((None, (3000, 30000)), ((0.1, 1.0), (100, 1000))):
        by: dict[str, list[float]] = {}
        for x in generate("chat", sessions=20, think_s=think):
            by.setdefault(str(x["session_id"]), []).append(float(str(x["timestamp"])))
        gaps = [b - a for ts in by.values() for a, b in itertools.pairwise(ts)]
        assert gaps and all(lo - 1 <= g <= hi + 1 for g in gaps)
    assert main([*argv, "--think-time", "2-1"]) == 2
    assert "think time" in capsys.readouterr().err
    assert main(["gen-trace", "--shape", "agent", "--think-time", "1-2", "--out", str(out)]) == 2
