"""The wire names are a contract: scripts, ACLs and other agents use these exact strings."""

from __future__ import annotations

from index.wire import DEFAULT_PREFIX, DP_RANK_HEADER, EPOCH_HEADER, SEQ_HEADER, Subjects


def test_subjects_are_the_documented_strings() -> None:
    s = Subjects()
    assert DEFAULT_PREFIX == "kv"
    assert s.events("w0") == "kv.events.w0" and s.all_events == "kv.events.>"
    assert s.replay("w0") == "kv.replay.w0"
    assert s.load("w0") == "kv.load.w0" and s.all_loads == "kv.load.*"
    assert s.prefetch("w0") == "kv.prefetch.w0"
    assert s.blocks("w0") == "kv.blocks.w0"
    assert s.route("r1") == "kv.route.r1" and s.all_routes == "kv.route.*"
    assert Subjects("a.b").events("w") == "a.b.events.w"


def test_headers_are_the_documented_names() -> None:
    assert (SEQ_HEADER, EPOCH_HEADER, DP_RANK_HEADER) == ("Kv-Seq", "Kv-Epoch", "Kv-Dp-Rank")
