"""The wire names are a contract: scripts, ACLs and other agents use these exact strings."""

from __future__ import annotations

import msgpack
import pytest

from index.gapfill import GapFillMessage
from index.wire import DEFAULT_PREFIX, DP_RANK_HEADER, EPOCH_HEADER, SEQ_HEADER, Subjects


def test_subjects_are_the_documented_strings() -> None:
    s = Subjects()
    assert DEFAULT_PREFIX == "kv"
    assert s.events("w0") == "kv.events.w0" and s.all_events == "kv.events.>"
    assert s.gap_fill("w0") == "kv.replay.w0"
    assert s.load("w0") == "kv.load.w0" and s.all_loads == "kv.load.*"
    assert s.prefetch("w0") == "kv.prefetch.w0"
    assert s.blocks("w0") == "kv.blocks.w0"
    assert s.route("r1") == "kv.route.r1" and s.all_routes == "kv.route.*"
    assert Subjects("a.b").events("w") == "a.b.events.w"


def test_headers_are_the_documented_names() -> None:
    assert (SEQ_HEADER, EPOCH_HEADER, DP_RANK_HEADER) == ("Kv-Seq", "Kv-Epoch", "Kv-Dp-Rank")


def test_a_gap_fill_end_with_a_non_string_epoch_is_refused() -> None:
    """The epoch keys the ingest's engine life (the native one takes only a string):
    anyone who can publish on NATS could send another type."""
    ok = GapFillMessage("end", 7, epoch="e1").encode()
    assert GapFillMessage.decode(ok) == GapFillMessage("end", 7, epoch="e1")
    for bad in (5, ["e1"], {"e": 1}, b"e1"):
        forged = msgpack.packb({"kind": "end", "epoch": bad, "last_seq": 7}, use_bin_type=True)
        with pytest.raises(ValueError):
            GapFillMessage.decode(forged)
