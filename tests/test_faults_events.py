"""KV-event faults through a real NATS: dropped, duplicated, reordered, truncated and
garbage batches, wrong block sizes, unknown workers and bad headers.

An engine double keeps every batch it made (and answers replays from them) but
publishes none itself: the test delivers them, damaged as it likes, on the live
subject. Each fault must be counted where an operator looks (``/admin/index``,
``/metrics``), skipped or repaired by a replay, and the router must end with exactly
the engine's blocks and keep serving.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import nats
import pytest
from nats.aio.client import Client
from stack import EngineDouble, Served, until

from index.codec import BlockStored
from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp

AUTH = {"authorization": "Bearer t"}
SILENT = 1 << 30  # the double publishes nothing live: the test delivers its batches


class Feed:
    """The engine double, the router, and a NATS client to inject batches with."""

    def __init__(self, engine: EngineDouble, app: RouterApp, url: str, nc: Client) -> None:
        self.engine = engine
        self.app = app
        self.url = url
        self.nc = nc
        self.pool = app.state.registry.pools["default"]
        self.sent = 0

    async def deliver(
        self, seq: int, payload: bytes | None = None, worker: str = "w0", **headers: str
    ) -> None:
        data = dict(self.engine.ring)[seq] if payload is None else payload
        hdrs = {"Kv-Seq": str(seq), "Kv-Epoch": self.engine.epoch, **headers}
        await self.nc.publish(f"kv.events.{worker}", data, headers=hdrs)
        await self.nc.flush()

    async def make_batches(self, n: int) -> list[int]:
        """Have the engine cache ``n`` new prompts (and evict): one batch each."""
        first = self.engine.seq + 1
        for _ in range(n):
            self.sent += 1
            ids = [self.sent % 7] * 4 + list(range(self.sent * 100, self.sent * 100 + 12))
            await self.engine.admit(ids)
        return list(range(first, self.engine.seq + 1))

    def settled(self) -> bool:
        """The event feed read up to date and no resync in flight (the one every
        connection starts is over): what a test does next meets a router at rest."""
        return self.app.state.feed.up_to_date and not self.app.state.events._resync

    def caught_up(self) -> bool:
        ingest = self.pool.ingest
        return ingest.last_seq("w0") == self.engine.seq and ingest.in_sync("w0")

    def index_is_engine(self) -> bool:
        held = self.pool.index.stats().workers.get("w0", {}).get("gpu", 0)
        return self.caught_up() and held == len(self.engine.cache)


@pytest.fixture
async def feed(nats_url: str) -> AsyncIterator[Feed]:
    engine = await EngineDouble("w0", nats_url=nats_url, capacity=40).start()
    engine.drop_next = SILENT
    cfg = RouterConfig(
        nats_url=nats_url,
        block_size=4,
        admin_token="t",
        workers=[WorkerSpec("w0", engine.url, model="m")],
    )
    app = RouterApp(cfg)
    served = await Served(app).start()
    nc = await nats.connect(nats_url)
    try:
        f = Feed(engine, app, served.url, nc)
        await until(lambda: app.state.bus.connected and f.settled(), what="router on NATS")
        yield f
    finally:
        await nc.close()
        await served.stop()
        await engine.stop()


async def test_every_event_fault_is_counted_and_the_index_ends_right(feed: Feed) -> None:
    ingest = feed.pool.ingest
    counts = feed.app.state.events.counts
    [s0, s1] = await feed.make_batches(2)
    await feed.deliver(s0)
    await feed.deliver(s1)
    await until(feed.index_is_engine, what="clean start")

    # duplicated: the same batch twice is applied once
    await feed.deliver(s1)
    await until(lambda: ingest.duplicates >= 1, what="duplicate counted")

    # dropped: the next batch is lost; the one after shows the gap, a replay fills it
    [_lost, after] = await feed.make_batches(2)
    await feed.deliver(after)
    await until(feed.index_is_engine, what="gap replayed")
    assert ingest.gaps >= 1 and counts["replayed_batches"] >= 1

    # reordered: the later batch first
    [a, b] = await feed.make_batches(2)
    await feed.deliver(b)
    await feed.deliver(a)
    await until(feed.index_is_engine, what="reorder repaired")

    # truncated and garbage payloads under a valid seq: counted, not applied, replayed
    [t] = await feed.make_batches(1)
    whole = dict(feed.engine.ring)[t]
    await feed.deliver(t, whole[: len(whole) // 2])
    await until(feed.index_is_engine, what="truncated batch replayed")
    [g] = await feed.make_batches(1)
    await feed.deliver(g, b"\x93\xffnot msgpack at all")
    await until(feed.index_is_engine, what="garbage batch replayed")
    assert ingest.errors["malformed_batch"] == 2

    # a block of the wrong size (not a multiple of the router's 4, which would be k router
    # blocks): that event is skipped and counted, the batch applied
    before = len(feed.engine.cache)
    await feed.engine.publish([BlockStored([12345], None, list(range(6)), 6, medium="GPU")])
    await feed.deliver(feed.engine.seq)
    await until(feed.caught_up, what="odd batch applied")
    assert ingest.errors["block_size_mismatch"] == 1 and len(feed.engine.cache) == before

    # an unknown worker and unreadable headers: counted, nothing applied anywhere
    await feed.deliver(s0, worker="ghost")
    await feed.nc.publish("kv.events.w0", dict(feed.engine.ring)[s0], headers={"Kv-Seq": "x"})
    await feed.nc.publish("kv.events.w0", dict(feed.engine.ring)[s0])
    await until(lambda: counts["unknown_worker"] == 1, what="unknown worker counted")
    await until(lambda: counts["bad_headers"] == 2, what="bad headers counted")
    assert "ghost" not in feed.pool.index.stats().workers

    # still live: a normal batch is applied as it comes, the index is the engine's
    [last] = await feed.make_batches(1)
    await feed.deliver(last)
    await until(feed.index_is_engine, what="live again")

    async with httpx.AsyncClient(base_url=feed.url, timeout=10) as http:
        stats = (await http.get("/admin/index", headers=AUTH)).json()
        pool = stats["pools"]["default"]
        assert pool["duplicates"] >= 1 and pool["gaps"] >= 2
        assert pool["dropped_events"]["malformed_batch"] == 2
        assert pool["dropped_events"]["block_size_mismatch"] == 1
        assert pool["in_sync"] == {"w0": True}
        nats_counts = stats["nats"]["counts"]
        assert nats_counts["unknown_worker"] == 1 and nats_counts["bad_headers"] == 2
        assert nats_counts["malformed"] == 2
        text = (await http.get("/metrics")).text
        for line in (
            'cache_router_event_errors_total{pool="default",reason="malformed_batch"} 2.0',
            'cache_router_event_errors_total{pool="default",reason="block_size_mismatch"} 1.0',
            'cache_router_nats_total{kind="unknown_worker"} 1.0',
            'cache_router_nats_total{kind="bad_headers"} 2.0',
        ):
            assert line in text, line
        r = await http.post("/v1/completions", json={"model": "m", "prompt": "still here"})
        assert r.status_code == 200


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_fault_schedule_ends_with_the_engines_index(feed: Feed, seed: int) -> None:
    """A random mix of faults over 40 batches (with evictions): whatever the order of
    arrival, the router's index converges on exactly the engine's blocks."""
    rng = random.Random(seed)
    seqs = await feed.make_batches(40)
    ring: dict[int, Any] = dict(feed.engine.ring)
    schedule: list[tuple[int, bytes]] = []
    for seq in seqs:
        payload = ring[seq]
        fault = rng.choice(["ok", "ok", "drop", "dup", "truncate", "garbage", "late"])
        if fault == "drop":
            continue
        if fault == "truncate":
            payload = payload[: rng.randrange(1, len(payload))]
        elif fault == "garbage":
            payload = rng.randbytes(rng.randrange(1, 64))
        schedule.append((seq, payload))
        if fault == "dup":
            schedule.append((seq, payload))
        elif fault == "late":  # shows up a few batches later
            schedule.insert(max(0, len(schedule) - rng.randrange(2, 5)), schedule.pop())
    for seq, payload in schedule:
        await feed.deliver(seq, payload)
    # whatever was lost or damaged at the end, one more good batch reveals it
    [last] = await feed.make_batches(1)
    await feed.deliver(last)
    await until(feed.index_is_engine, timeout=15, what="converged")
    # and the index answers a prompt exactly as the engine would
    ids = [feed.sent % 7] * 4 + list(range(feed.sent * 100, feed.sent * 100 + 12))
    hashes = feed.pool.hasher.hash_tokens(ids)
    assert feed.pool.index.match(hashes) == {"w0": len(hashes)}
