"""``GET /admin/index``: per pool the index and its ingest counters, the NATS side, the
hit audit: is the index's view of the engines' caches to be trusted? And how late the
router's own event loop ran of late (``loop``, router.observe.loop)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import Response

from router.admin.common import AdminDeps, json_response

if TYPE_CHECKING:
    from router.events.feed import EventFeed


def mount(api: APIRouter, state: AdminDeps) -> None:
    @api.get("/index")
    async def index_stats() -> Response:
        if state.feed is not None and state.feed.native is not None:
            state.feed.native.collect()  # the counts the native reader applied since its tick
        pools = {}
        for pool in state.registry.pools.values():
            ing = pool.ingest
            pools[pool.name] = {
                "block_size": pool.block_size,
                "index": pool.index.stats(),
                "events_applied": ing.events_applied,
                "batches_applied": ing.batches_applied,
                "gaps": ing.gaps,
                "restarts": ing.restarts,
                "duplicates": ing.duplicates,
                "dropped_events": dict(ing.errors),
                "in_sync": {w: state.in_sync(w, pool) for w in pool.index.workers},
                # vLLM's sha256 block names, which only prefetch hints read (router/http/app.py)
                "engine_names_kept": ing.keep_names,
            }
        nats = {
            "connected": state.bus.connected if state.bus else False,
            "events_up_to_date": state.feed.up_to_date if state.feed else False,
            "reconnects": state.bus.reconnects if state.bus else 0,
            "dropped_publishes": state.bus.dropped_publishes if state.bus else 0,
            "counts": dict(state.events.counts),
            "hints_published": state.hints.published,
            "hints_skipped": state.hints.skipped,
            "reader": reader(state.feed),
        }
        # the router's own loop: a late one delays every decision and answer (router.observe.loop)
        loop = state.loop.recent() if state.loop is not None else None
        return json_response(
            {"pools": pools, "nats": nats, "audit": state.audit.snapshot(), "loop": loop}
        )


def reader(feed: EventFeed | None) -> dict[str, object]:
    """Which reader takes the live batches and, for the native one, its own counters and
    queue: its oversized messages are counted nowhere else, and /metrics' event lag adds
    the ingest thread's queue to this one."""
    native = feed.native if feed is not None else None
    if native is None or feed is None or not feed.native_live:
        return {"kind": "python"}  # nats-py (the stream reader, until its hand-off)
    queued, oldest = native.lag()
    return {"kind": "native", **native.stats(), "queued": queued, "oldest_s": oldest}
