"""Router replicas: the event stream rebuilds late ones, and they share load and predictions.

Real parts throughout: nats-server with JetStream, mock engines publishing over ZMQ to
node agents (which create the stream), engine doubles on loopback ports, and every
router replica serving HTTP in-process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import msgpack
import nats
import pytest
from stack import EngineDouble, MockStack, Replica, index_blocks, matches, prompt, send, until

from router.cli import main as cli_main
from router.config import ConfigError, RouterConfig, WorkerSpec, load_config
from router.events.jetstream import StreamSpec, apply_stream
from router.events.replicas import pack_hashes
from sim.mock.natsd import EmbeddedNats


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[MockStack]:
    s = await MockStack(nats_url).start(3)
    yield s
    await s.stop()


async def test_late_and_restarted_replicas_rebuild_from_the_stream(stack: MockStack) -> None:
    """A replica that starts after traffic, and one restarted while traffic flows, read
    the stream and end with the same index as the first replica and the engines."""
    prompts = [prompt(i) for i in range(24)]
    async with AsyncExitStack() as cleanup, httpx.AsyncClient(timeout=30) as http:
        a = await Replica(stack.router_config("a")).start()
        cleanup.push_async_callback(a.stop)
        for p in prompts[:8]:
            await send(http, a, p)
        await until(lambda: stack.synced(a), what="a in sync")

        b = Replica(stack.router_config("b"))  # late: 8 requests of history
        assert b.state.feed.blind(time.monotonic())  # no hits until it has read the stream
        await b.start()
        cleanup.push_async_callback(b.stop)
        await until(lambda: stack.synced(b), what="late b rebuilt")
        assert not b.state.feed.blind(time.monotonic())
        assert matches(b, prompts) == matches(a, prompts)
        assert b.state.events.counts["dumps_loaded"] == 0  # the stream alone rebuilt it
        assert b.state.feed.using == "jetstream" and b.state.feed.reader.stream_seq > 0

        for i, p in enumerate(prompts[8:16]):
            await send(http, (a, b)[i % 2], p)
        await b.stop()

        async def restart_b() -> Replica:
            await asyncio.sleep(0.05)  # traffic is under way
            return await Replica(stack.router_config("b")).start()

        # b comes back while a serves the rest
        b2_task = asyncio.create_task(restart_b())
        for p in prompts[16:]:
            await send(http, a, p)
        b2 = await b2_task
        cleanup.push_async_callback(b2.stop)
        for replica in (a, b2):
            await until(lambda r=replica: stack.synced(r), what="replicas in sync")
        truth = stack.engine_blocks()
        assert index_blocks(a) == truth and index_blocks(b2) == truth
        assert matches(b2, prompts) == matches(a, prompts)
        assert any(m for m in matches(a, prompts))  # the comparison is not of empty indexes


async def test_history_cut_from_the_stream_comes_from_dumps(nats_url: str) -> None:
    """A stream bounded to a few KiB keeps only the latest batches: a late replica sees
    a worker start past seq 0 and asks its agent, whose ring lost the start too: the
    agent sends a dump, and the replica still converges."""
    nc = await nats.connect(nats_url)
    await apply_stream(nc, StreamSpec(max_bytes=4096))  # the agents keep an existing stream
    await nc.close()
    stack = await MockStack(nats_url).start(2, buffer=4)
    prompts = [prompt(i) for i in range(12)]
    try:
        async with AsyncExitStack() as cleanup, httpx.AsyncClient(timeout=30) as http:
            a = await Replica(stack.router_config("a")).start()
            cleanup.push_async_callback(a.stop)
            for p in prompts:
                await send(http, a, p)
            await until(lambda: stack.synced(a), what="a in sync")
            late = await Replica(stack.router_config("late")).start()
            cleanup.push_async_callback(late.stop)
            await until(lambda: stack.synced(late), what="late replica rebuilt")
            assert late.state.events.counts["dumps_loaded"] >= 1
            assert late.pool().ingest.gaps >= 1  # the stream's first batch was not seq 0
            assert index_blocks(late) == index_blocks(a) == stack.engine_blocks()
            assert matches(late, prompts) == matches(a, prompts)
    finally:
        await stack.stop()


async def test_core_nats_when_the_server_has_no_jetstream() -> None:
    """``auto`` falls back to a core subscription: live events still reach the index."""
    with EmbeddedNats(jetstream=False) as server:
        engine = await EngineDouble("w0", nats_url=server.url).start()
        cfg = RouterConfig(
            nats_url=server.url,
            block_size=4,
            workers=[WorkerSpec("w0", engine.url, model="m")],
        )
        replica = await Replica(cfg).start()
        try:
            assert replica.state.feed.using == "core"
            async with httpx.AsyncClient(timeout=10) as http:
                body = {"model": "m", "prompt": "core nats " * 8}
                assert (await http.post(replica.url + "/v1/completions", json=body)).is_success
            pool = replica.pool()
            await until(lambda: pool.ingest.last_seq("w0") == engine.seq, what="events")
            assert pool.index.stats().workers["w0"]["gpu"] == len(engine.cache) > 0
        finally:
            await replica.stop()
            await engine.stop()


# -- shared load ----------------------------------------------------------------------


class Gated:
    """Engine doubles that hold every request until their gate opens (load stays put)."""

    def __init__(self, n: int) -> None:
        self.engines = [EngineDouble(f"g{i}") for i in range(n)]

    async def start(self) -> Gated:
        for e in self.engines:
            e.gate = asyncio.Event()
            await e.start()
        return self

    async def stop(self) -> None:
        for e in self.engines:
            await e.stop()

    def inflight(self) -> list[int]:
        return [e.inflight for e in self.engines]

    def specs(self) -> list[WorkerSpec]:
        return [WorkerSpec(e.worker_id, e.url, model="m") for e in self.engines]


def water_fill(levels: list[int], units: int) -> list[int]:
    """Where ``units`` requests end up if each goes to a least-loaded worker (sorted)."""
    out = sorted(levels)
    for _ in range(units):
        out[0] += 1
        out.sort()
    return out


def views(replica: Replica, ids: list[str]) -> list[tuple[int, int]]:
    return [
        (replica.load(w).inflight_requests, replica.load(w).inflight_prefill_tokens) for w in ids
    ]


@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
async def test_replicas_count_each_others_load(nats_url: str, share: bool) -> None:
    """40 concurrent distinct-prefix requests split over two least-load replicas, then a
    second wave through one of them after two workers finished.

    Shared: each replica's view equals the sum of both replicas' own counts, and the
    second wave fills the idle workers exactly as one router would (water-filling the
    engines' real in-flight counts). Unshared (the control): a replica sees only its
    own requests, so the second wave also lands on the still-busy workers. Provably:
    A holds 7 or 8 on each busy worker, B 2 or 3; B balances its own 20 + 4..6 to 6 or
    7 per worker, adding at least 3 to each busy one, which ends with at least 13
    while an idle one gets at most 7."""
    gated = await Gated(4).start()
    ids = [e.worker_id for e in gated.engines]

    def cfg(replica_id: str) -> RouterConfig:
        return RouterConfig(
            nats_url=nats_url,
            block_size=4,
            policy="least_load",
            health_interval=60,  # no engine scrapes mid-test: the routers' own counts decide
            replica_id=replica_id,
            share_interval=0.005 if share else 0,
            workers=gated.specs(),
        )

    async with AsyncExitStack() as cleanup, httpx.AsyncClient(timeout=60) as http:
        cleanup.push_async_callback(gated.stop)
        a = await Replica(cfg("a")).start()
        cleanup.push_async_callback(a.stop)
        b = await Replica(cfg("b")).start()
        cleanup.push_async_callback(b.stop)

        async def one(replica: Replica, i: int) -> str:
            body = {"model": "m", "prompt": f"{i:04d} distinct request " + "x" * (4 * i % 64)}
            r = await http.post(replica.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.headers["x-cache-router-worker"]

        wave1 = [asyncio.create_task(one(a if i % 4 else b, i)) for i in range(40)]
        await until(lambda: sum(gated.inflight()) == 40, what="wave 1 held")
        own = {r: [r.load(w).own() for w in ids] for r in (a, b)}
        assert [sum(o[0] for o in own[r]) for r in (a, b)] == [30, 10]
        truth = [(oa[0] + ob[0], oa[1] + ob[1]) for oa, ob in zip(own[a], own[b], strict=True)]
        if share:
            for r in (a, b):
                await until(lambda r=r: views(r, ids) == truth, what="views converge")
            assert [t[0] for t in truth] == gated.inflight()
        else:
            assert views(a, ids) == [o[:2] for o in own[a]]
            assert views(b, ids) == [o[:2] for o in own[b]]

        for e in gated.engines[:2]:  # two workers finish everything they hold
            assert e.gate is not None
            e.gate.set()
        await until(
            lambda: all(r.load(w).own()[0] == 0 for r in (a, b) for w in ids[:2]),
            what="two workers done",
        )
        for e in gated.engines[:2]:
            e.gate = asyncio.Event()
        before = gated.inflight()
        assert before[:2] == [0, 0] and sum(before) > 0
        if share:
            for r in (a, b):
                await until(lambda r=r: [v[0] for v in views(r, ids)] == before, what="settle")

        wave2 = [asyncio.create_task(one(b, 100 + i)) for i in range(20)]
        await until(lambda: sum(gated.inflight()) == sum(before) + 20, what="wave 2 held")
        after = gated.inflight()
        added = [x - y for x, y in zip(after, before, strict=True)]
        if share:  # exactly what one router seeing every request would have done
            assert sorted(after) == water_fill(before, 20), (before, after)
        else:
            assert min(added[2:]) >= 3, (before, after)
            assert max(after) - min(after) >= 6, (before, after)

        for e in gated.engines:
            assert e.gate is not None
            e.gate.set()
        await asyncio.gather(*wave1, *wave2)
        for r in (a, b):
            await until(lambda r=r: views(r, ids) == [(0, 0)] * 4, what="all released")


# -- shared predictions ---------------------------------------------------------------


class HeldStream(EngineDouble):
    """Sends response headers at once, then holds the first token until ``hold`` opens:
    the router has predicted the prompt on it, and its prefill is still queued."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)  # no NATS: no KV event ever reaches the routers
        self.hold = asyncio.Event()

    async def _sse(self, *args: Any) -> Any:
        await self.hold.wait()
        async for chunk in super()._sse(*args):
            yield chunk


@pytest.mark.parametrize("b_predicts", [True, False], ids=["shared", "b-ignores-marks"])
async def test_siblings_meet_across_replicas_before_any_event(
    nats_url: str, b_predicts: bool
) -> None:
    """Six requests sharing a long prefix alternate between two cache-aware replicas;
    engines publish no KV events at all, so only predict-on-route marks can bring them
    together. With marks shared, all six land on the worker of the first. When the
    second replica takes no marks (control), its siblings avoid that worker, which it
    sees busy (load is shared) without seeing the prefix there."""
    engines = [HeldStream(f"p{i}") for i in range(4)]
    for e in engines:
        await e.start()
    prefix = ("shared long system prompt of a sibling burst. " * 50)[:2048]  # 128 blocks

    def cfg(replica_id: str, ttl: float) -> RouterConfig:
        return RouterConfig(
            nats_url=nats_url,
            block_size=4,
            health_interval=60,
            replica_id=replica_id,
            predict_ttl=ttl,
            workers=[WorkerSpec(e.worker_id, e.url, model="m") for e in engines],
        )

    async with AsyncExitStack() as cleanup, httpx.AsyncClient(timeout=60) as http:
        for e in engines:
            cleanup.push_async_callback(e.stop)
        a = await Replica(cfg("a", 30.0)).start()
        cleanup.push_async_callback(a.stop)
        b = await Replica(cfg("b", 30.0 if b_predicts else 0.0)).start()
        cleanup.push_async_callback(b.stop)
        chosen: list[tuple[str, str]] = []

        async def sibling(replica: Replica, i: int) -> None:
            body = {"model": "m", "prompt": prefix + f"question {i}: why?", "stream": True}
            async with http.stream("POST", replica.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                chosen.append((replica.state.replicas.id, r.headers["x-cache-router-worker"]))
                await r.aread()

        tasks = []
        for i in range(6):
            sender, other = (a, b) if i % 2 == 0 else (b, a)
            tasks.append(asyncio.create_task(sibling(sender, i)))
            await until(lambda i=i: len(chosen) == i + 1, what="routed")
            worker = chosen[-1][1]
            await until(
                lambda o=other, n=i + 1: sum(o.load(e.worker_id).inflight_requests
                                             for e in engines) == n,
                what="load shared",
            )  # fmt: skip
            if other.state.cfg.predict_ttl > 0 and sender.state.cfg.predict_ttl > 0:
                hashes = _hashes(other, prefix)
                await until(
                    lambda o=other, h=hashes, w=worker: o.pool().index.match(h).get(w, 0) >= len(h),
                    what="mark shared",
                )
        for e in engines:
            e.hold.set()
        await asyncio.gather(*tasks)

    first = chosen[0][1]
    if b_predicts:
        assert [w for _, w in chosen] == [first] * 6, chosen
        assert a.state.replicas.counts["route_marks_applied"] >= 3
    else:
        assert all(w != first for r, w in chosen if r == "b"), chosen
        assert all(w == first for r, w in chosen if r == "a"), chosen


def _hashes(replica: Replica, text: str) -> list[int]:
    pool = replica.pool()
    return pool.hasher.hash_tokens(replica.state.tokenizers.get("m").encode(text, True))


# -- the sharing protocol's edges -----------------------------------------------------


async def test_bad_route_messages_are_counted_and_silent_peers_expire(nats_url: str) -> None:
    engine = await EngineDouble("e0").start()
    cfg = RouterConfig(
        nats_url=nats_url,
        block_size=4,
        replica_id="me",
        peer_ttl=0.6,
        predict_ttl=5.0,
        workers=[WorkerSpec("e0", engine.url, model="m")],
    )
    replica = await Replica(cfg).start()
    nc = await nats.connect(nats_url)
    try:
        share = replica.state.replicas
        load = replica.load("e0")
        junk = [
            b"\xc1",  # not msgpack
            msgpack.packb([1, "x"]),  # too short
            msgpack.packb([1, "x", True, [["e0", -1, 0, 0]], []]),  # a negative count
            msgpack.packb([1, "x", False, [], [["e0", 5.0, b"\x01\x02\x03"]]]),  # 3-byte hashes
        ]
        for data in junk:
            await nc.publish("kv.route.x", data)
        await until(lambda: share.counts["route_malformed"] == 4, what="junk counted")
        assert load.inflight_requests == 0

        marks = [["e0", 5.0, pack_hashes([11, 22, 33])], ["nobody", 5.0, pack_hashes([1])]]
        ghost = msgpack.packb([1, "ghost", True, [["e0", 3, 120, 1], ["nobody", 9, 9, 9]], marks])
        await nc.publish("kv.route.ghost", ghost)
        await until(lambda: load.inflight_requests == 3, what="ghost load counted")
        assert (load.inflight_prefill_tokens, load.decode_streams, load.own()) == (
            120,
            1,
            (0, 0, 0),
        )
        assert replica.pool().index.match([11, 22, 33]) == {"e0": 3}
        assert share.counts["route_marks_unknown_worker"] == 1
        # a row replaces the last one (absolute numbers, not increments)
        await nc.publish(
            "kv.route.ghost", msgpack.packb([1, "ghost", False, [["e0", 1, 40, 0]], []])
        )
        await until(lambda: load.inflight_requests == 1, what="row replaced")
        assert load.inflight_prefill_tokens == 40
        # the ghost stops talking: its load is taken back after peer_ttl
        await until(lambda: load.inflight_requests == 0, timeout=5, what="ghost expired")
        assert (load.inflight_prefill_tokens, load.decode_streams) == (0, 0)
        assert share.counts["route_peers_expired"] == 1 and share.peers() == {}
    finally:
        await nc.close()
        await replica.stop()
        await engine.stop()


def test_streams_command_creates_and_retunes_the_stream(
    nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["streams", "--nats-url", nats_url, "--max-age", "60", "--max-bytes", "100000"]
    assert cli_main(args) == 0
    assert cli_main([*args[:-2], "--max-bytes", "200000"]) == 0
    out = capsys.readouterr().out
    assert "stream KV_EVENTS on kv.events.>: max_age 60s, max_bytes 200000" in out

    async def limits() -> tuple[float, int]:
        nc = await nats.connect(nats_url)
        info = await nc.jsm().stream_info("KV_EVENTS")
        await nc.close()
        return info.config.max_age or 0, info.config.max_bytes or 0

    assert asyncio.run(limits()) == (60, 200000)
    with EmbeddedNats(jetstream=False) as plain:
        assert cli_main(["streams", "--nats-url", plain.url]) == 1
    assert "start nats-server with -js" in capsys.readouterr().err
    assert cli_main(["streams", "--nats-url", nats_url, "--max-age", "0"]) == 2


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CACHE_ROUTER_EVENTS_TRANSPORT": "kafka"}, "events_transport"),
        ({"CACHE_ROUTER_REPLICA_ID": "a.b"}, "replica_id"),
        ({"CACHE_ROUTER_EVENTS_STREAM": "kv events"}, "events_stream"),
        ({"CACHE_ROUTER_PEER_TTL": "0"}, "peer_ttl"),
        ({"CACHE_ROUTER_SHARE_INTERVAL": "-1"}, "share_interval"),
    ],
)
def test_replica_settings_are_checked(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)
    cfg = load_config(env={"CACHE_ROUTER_REPLICA_ID": "r-1", "CACHE_ROUTER_SHARE_INTERVAL": "0"})
    assert (cfg.replica_id, cfg.share_interval, cfg.events_transport) == ("r-1", 0.0, "auto")


async def test_a_replica_alone_sends_only_its_full_messages_until_a_peer_appears(
    nats_url: str,
) -> None:
    """With no peer to tell, a replica does not publish its rows every ``share_interval``
    (an idle router with NATS woke 226 times a second for that): only its full message
    each ``peer_ttl / 3``. Once a peer speaks, it answers with a full message and shares
    its load changes again."""
    engine = await EngineDouble("e0").start()
    cfg = RouterConfig(
        nats_url=nats_url,
        block_size=4,
        replica_id="alone",
        peer_ttl=30.0,  # a full message every 10 s: one at start, then none in this test
        health_interval=60,
        workers=[WorkerSpec("e0", engine.url, model="m")],
    )
    replica = await Replica(cfg).start()
    nc = await nats.connect(nats_url)
    seen: list[tuple[bool, list[Any]]] = []

    async def on_route(msg: Any) -> None:
        _, _, full, rows, _ = msgpack.unpackb(msg.data)
        seen.append((full, rows))

    try:
        await nc.subscribe("kv.route.alone", cb=on_route)
        await nc.flush()
        share = replica.state.replicas
        await until(lambda: share.counts["route_published"] >= 1, what="the first full message")
        published = share.counts["route_published"]
        flight = replica.load("e0").begin(100)  # a change only a peer would want to hear
        await asyncio.sleep(0.3)  # ~60 messages' worth of share_interval
        assert share.counts["route_published"] == published  # nothing for nobody
        seen.clear()
        await nc.publish("kv.route.ghost", msgpack.packb([1, "ghost", True, [], []]))
        await until(lambda: any(full for full, _ in seen), what="a full message for the peer")
        assert next(rows for full, rows in seen if full) == [["e0", 1, 100, 0]]
        flight.finish()
        await until(lambda: ["e0", 0, 0, 0] in [r for _, rows in seen for r in rows],
                    what="the change shared")  # fmt: skip
    finally:
        await nc.close()
        await replica.stop()
        await engine.stop()
