"""The router and the simulator build their policy views with one rule (``WorkerView.of``)."""

from __future__ import annotations

from index.prefix_index import TierMatch
from policies.base import NO_MATCH, WorkerView

LOAD = {
    "inflight_requests": 2,
    "inflight_prefill_tokens": 64,
    "decode_streams": 1,
    "engine_running": 3,
    "engine_waiting": 0,
    "kv_usage": 0.5,
}


def test_an_out_of_sync_worker_shows_no_match_but_keeps_its_load() -> None:
    match = TierMatch(4, 4, 4, 4)
    synced = WorkerView.of("w0", match, in_sync=True, **LOAD)  # type: ignore[arg-type]
    stale = WorkerView.of("w0", match, in_sync=False, **LOAD)  # type: ignore[arg-type]
    assert synced.match == match and synced.in_sync
    assert stale.match == NO_MATCH and not stale.in_sync
    for view in (synced, stale):
        assert view.healthy and view.inflight_requests == 2 and view.kv_usage == 0.5
