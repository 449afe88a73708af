"""The router and the simulator build their policy views with one rule (``WorkerView.of``;
the router's copy of it is inlined)."""

from __future__ import annotations

import asyncio
import json

from index.prefix_index import TierMatch
from policies.base import NO_MATCH, WorkerView
from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterState
from router.workers.load import EngineLoad

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


def test_the_routers_views_follow_the_same_rule() -> None:
    """``Router.views`` builds its views inline, not through ``of``: the same views, an
    out-of-sync rank's and a draining worker's included (DP ranks, an engine report and
    a flight in play)."""
    specs = [
        WorkerSpec("a", "http://127.0.0.1:9000", model="m", dp_size=2),
        WorkerSpec("b", "http://127.0.0.1:9001", model="m"),
        WorkerSpec("c", "http://127.0.0.1:9002", model="m"),
    ]
    st = RouterState(RouterConfig(workers=specs, forecast_tracked=0))
    router, reg = st.router, st.registry
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x " * 200}]})
    prep = asyncio.run(router.prepare(router.parse("chat", raw.encode(), {}), len(raw)))
    hashes, pool = prep.request.block_hashes, prep.pool
    targets = [t for w in reg for t in w.targets]
    for tid in targets:
        pool.index.store(tid, hashes[:3])
    pool.ingest.mark_out_of_sync(targets[1])
    a = reg.get("a")
    assert a is not None
    a.load.report(EngineLoad(running=3, waiting=1, kv_usage=0.25, kv_tokens=4096))
    a.rank_loads[0].begin(40)
    reg.drain("c")
    views = router.views(prep)
    assert [v.worker_id for v in views] == targets[:3]
    assert [v.in_sync for v in views] == [True, False, True]
    assert views[0].match.total == 3 and views[1].match == NO_MATCH
    for v in views:
        ranks = 2 if v.worker_id.startswith("a") else 1
        want = WorkerView.of(
            v.worker_id,
            TierMatch(3, 3, 3, 3),
            v.worker_id != targets[1],
            v.inflight_requests,
            v.inflight_prefill_tokens,
            v.decode_streams,
            v.engine_running,
            v.engine_waiting,
            v.kv_usage,
            (v.running_prefill_tokens, v.running_prefill_ms),
            v.capacity_blocks,
        )
        assert v == want
        assert (v.engine_running, v.kv_usage) == ((2, 0.25) if ranks == 2 else (None, None))
        # the engine's KV size (vLLM's cache_config_info) in the pool's blocks, a rank each
        blocks = 4096 // pool.block_size if ranks == 2 else None
        assert v.capacity_blocks == blocks
    assert views[0].running_prefill_tokens == 40 and views[0].inflight_requests == 1
