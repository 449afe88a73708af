"""Trace readers: deterministic Mooncake token synthesis, derived sessions, plain JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.synth import write_mooncake
from sim.traces import MOONCAKE_BLOCK, TraceError, load_trace

B = MOONCAKE_BLOCK


def test_mooncake_blocks_share_tokens_exactly_where_hash_ids_do(tmp_path: Path) -> None:
    path = write_mooncake(
        tmp_path / "t.jsonl",
        [
            (0, 3 * B + 100, 5, [0, 1, 2, 3]),
            (10, 2 * B + 100, 5, [0, 1, 9]),  # shares two whole blocks
            (20, 3 * B + 100, 5, [0, 1, 2, 3]),  # same ids, its own partial tail
            (30, B, 5, [7]),
        ],
    )
    trace = load_trace(path, block_size=64)
    toks = [trace.tokens(i) for i in range(4)]
    assert [len(t) for t in toks] == [3 * B + 100, 2 * B + 100, 3 * B + 100, B]
    assert toks[0][: 2 * B] == toks[1][: 2 * B]
    assert toks[0][2 * B : 2 * B + 64] != toks[1][2 * B : 2 * B + 64]
    assert toks[0][: 3 * B] == toks[2][: 3 * B]
    assert toks[0][3 * B :] != toks[2][3 * B :]  # partial tails are per request
    assert trace.tokens(0) == toks[0]  # regenerated identically
    r = trace.requests
    assert list(r[0].router_hashes[:16]) == list(r[1].router_hashes[:16])
    assert r[0].router_hashes[16] != r[1].router_hashes[16]
    assert len(r[0].router_hashes) == (3 * B + 100) // 64
    assert list(r[0].engine_hashes[:16]) == list(r[1].engine_hashes[:16])
    assert set(r[0].engine_hashes).isdisjoint(r[0].router_hashes)
    other = load_trace(path, block_size=64, seed=1)
    assert other.tokens(0) != toks[0]


def test_mooncake_sessions_follow_prefix_extension(tmp_path: Path) -> None:
    path = write_mooncake(
        tmp_path / "t.jsonl",
        [
            (0, 2 * B + 10, 1, [0, 1, 2]),  # new conversation A
            (1, 2 * B + 10, 1, [0, 5, 6]),  # shares only the system block: new B
            (2, 4 * B + 10, 1, [0, 1, 3, 4, 8]),  # extends A's chain [0, 1]
            (3, 5 * B + 10, 1, [0, 1, 3, 4, 11, 12]),  # extends the previous turn
        ],
    )
    sessions = [r.session for r in load_trace(path).requests]
    assert sessions[0] != sessions[1]
    assert sessions[2] == sessions[3] == sessions[0]


def test_ideal_hit_rate_counts_prior_blocks_and_keeps_the_last_token(tmp_path: Path) -> None:
    path = write_mooncake(tmp_path / "t.jsonl", [(0, B, 1, [4]), (1, B, 1, [4])])
    trace = load_trace(path, block_size=64)
    # The second request may reuse all but the block holding its last token.
    assert trace.ideal_hit_rate() == pytest.approx((B - 64) / (2 * B))


def test_pooled_lru_hit_rate_is_bounded_by_the_ideal(tmp_path: Path) -> None:
    rows = [(i, 2 * B + 7, 1, [i % 5, 100 + i % 5, 200 + i]) for i in range(40)]
    trace = load_trace(write_mooncake(tmp_path / "t.jsonl", rows), block_size=64)
    ideal = trace.ideal_hit_rate()
    assert trace.pooled_lru_hit_rate(10**6) == pytest.approx(ideal)
    # Five prompt families of 16 blocks in a cycle: LRU keeps them all or thrashes.
    assert trace.pooled_lru_hit_rate(80) == pytest.approx(ideal)
    assert trace.pooled_lru_hit_rate(79) == 0.0


def test_plain_jsonl_tokens_text_and_speedup(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = [
        {"timestamp": 100, "token_ids": list(range(40)), "session_id": 7},
        {"timestamp": 300, "text": "héllo world", "output_length": 3},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    trace = load_trace(path, block_size=16, speedup=2.0)
    a, b = trace.requests
    assert (a.arrival_ms, b.arrival_ms) == (50.0, 150.0)
    assert a.session == "7" and b.session is None
    assert list(trace.tokens(1)) == list("héllo world".encode())
    assert (a.output_len, b.output_len) == (16, 3)
    assert len(a.router_hashes) == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ('{"timestamp": 0}', "expected 'hash_ids'"),
        ('{"token_ids": [1, -2]}', "u32"),
        ('{"input_length": 600, "output_length": 1, "hash_ids": [1]}', "do not cover"),
        ('{"input_length": 10, "output_length": -1, "hash_ids": [1]}', "output_length"),
        ('{"text": "abc", "timestamp": "soon"}', "timestamp"),
    ],
)
def test_bad_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert "bad.jsonl:2" in str(info.value)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such trace"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl")
