"""The native KV-event reader (router/events/native_reader.py, index/native/nats_reader.hpp)
against a real nats-server: it gives the index the Python path gives on the same
batches (gaps, reorders, duplicates, garbage), and it never loses a batch silently: a
dropped message, a restarted server or a full queue marks the worker out of sync at
once and a resync brings it back; credentials work and bad ones are reported.

The engine double keeps every batch it made and answers replays but publishes none
itself: the test delivers them, as in test_faults_events.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import nats
import pytest
from nats.aio.client import Client
from stack import EngineDouble, Served, until
from test_faults_events import SILENT, Feed

from index import _native
from index.backend import NATIVE
from index.codec import BlockStored
from index.ingest import SeqStatus
from router.admin import index as admin_index
from router.config import ConfigError, RouterConfig, WorkerSpec, validate
from router.events import native_reader as native_events
from router.events.jetstream import StreamSpec, ensure_stream
from router.http.app import RouterApp
from sim.mock.natsd import EmbeddedNats, free_port

pytestmark = pytest.mark.skipif(
    not NATIVE or not hasattr(_native, "EventReader"), reason="no native event reader built"
)


class Pair:
    """One engine double, a router on the native reader and one on nats-py, one NATS."""

    def __init__(self, engine: EngineDouble, native: Feed, python: Feed) -> None:
        self.engine = engine
        self.native = native
        self.python = python

    @property
    def feeds(self) -> tuple[Feed, Feed]:
        return self.native, self.python

    async def deliver(self, seq: int, payload: bytes | None = None) -> None:
        await self.native.deliver(seq, payload)  # one publish: both routers read it

    def both_are_engine(self) -> bool:
        return all(f.index_is_engine() for f in self.feeds)


async def start_router(
    engine: EngineDouble, url: str, nc: Client, reader: str, **kw: object
) -> tuple[Feed, Served]:
    cfg = RouterConfig(
        nats_url=url,
        block_size=4,
        admin_token="t",
        events_transport="core",
        events_reader=reader,  # type: ignore[arg-type]
        workers=[WorkerSpec("w0", engine.url, model="m")],
        **kw,  # type: ignore[arg-type]
    )
    app = RouterApp(cfg)
    served = await Served(app).start()
    feed = Feed(engine, app, served.url, nc)
    await until(
        lambda: app.state.bus.connected and feed.settled(), timeout=15, what="router on NATS"
    )
    return feed, served


@pytest.fixture
async def pair(nats_url: str) -> AsyncIterator[Pair]:
    engine = await EngineDouble("w0", nats_url=nats_url, capacity=40).start()
    engine.drop_next = SILENT
    nc = await nats.connect(nats_url)
    native, s1 = await start_router(engine, nats_url, nc, "native")
    python, s2 = await start_router(engine, nats_url, nc, "python")
    try:
        assert native.app.state.feed.native is not None
        assert python.app.state.feed.native is None
        await until(lambda: native.app.state.feed.native.up, what="native reader subscribed")
        yield Pair(engine, native, python)
    finally:
        await nc.close()
        await s1.stop()
        await s2.stop()
        await engine.stop()


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_the_native_reader_builds_the_index_the_python_path_does(
    pair: Pair, seed: int
) -> None:
    rng = random.Random(seed)
    [s0] = await pair.native.make_batches(1)
    await pair.deliver(s0)
    await until(pair.both_are_engine, timeout=15, what="clean start")
    for _ in range(6):
        batches = await pair.native.make_batches(rng.randint(1, 6))
        order = list(batches)
        fault = rng.choice(["in_order", "gap", "reorder", "duplicate", "garbage"])
        if fault == "gap" and len(order) > 1:
            order.pop(rng.randrange(len(order) - 1))  # the last one shows the gap
        elif fault == "reorder":
            rng.shuffle(order)
        elif fault == "duplicate":
            order += order[: rng.randint(1, len(order))]
        for seq in order:
            if fault == "garbage" and seq == order[-1]:
                await pair.deliver(seq, b"\x93\xffnot msgpack")
            else:
                await pair.deliver(seq)
        await until(pair.both_are_engine, timeout=20, what=f"both repaired after {fault}")
        native_index = pair.native.pool.index.stats().workers
        python_index = pair.python.pool.index.stats().workers
        assert native_index == python_index, fault
    counts = pair.native.app.state.events.counts
    await until(lambda: counts["native_applied"] > 0, what="the reader applied some itself")


async def test_in_order_batches_are_applied_off_the_loop(pair: Pair) -> None:
    [first, *rest] = await pair.native.make_batches(12)
    await pair.deliver(first)  # applied by Python, which routes the worker to the reader
    applied = [f.pool.ingest for f in pair.feeds]
    await until(lambda: all(i.last_seq("w0") == first for i in applied), what="first applied")
    for seq in rest:
        await pair.deliver(seq)
    await until(pair.both_are_engine, timeout=15, what="all applied")
    counts = pair.native.app.state.events.counts
    # the reader reports each run to the loop: on a loaded machine that trails the index
    await until(lambda: counts["native_applied"] == len(rest), timeout=15, what="applied natively")
    assert counts["messages"] == pair.python.app.state.events.counts["messages"]


async def test_an_idle_reader_ticks_seldom_and_admin_index_collects_its_counts(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = pair.native.app.state.feed.native
    assert native is not None
    monkeypatch.setattr(native_events, "COUNT_IDLE", 0.3)
    [first, *rest] = await pair.native.make_batches(6)
    await pair.deliver(first)
    ingest = pair.native.pool.ingest
    await until(lambda: ingest.last_seq("w0") == first, what="first applied")
    # nothing arrives: the count's wait doubles up to its ceiling
    await until(lambda: native._interval == 0.3, timeout=15, what="the tick backed off")
    assert native._tick is not None
    native._tick.cancel()  # from here only a reader of the counts collects them
    before = ingest.batches_applied
    for seq in rest:
        await pair.deliver(seq)
    await until(lambda: ingest.last_seq("w0") == rest[-1], timeout=15, what="applied natively")
    await asyncio.sleep(0.5)
    assert ingest.batches_applied == before  # applied off the loop, not yet counted
    async with httpx.AsyncClient(base_url=pair.native.url, timeout=10) as http:
        r = await http.get("/admin/index", headers={"authorization": "Bearer t"})
    assert r.json()["pools"]["default"]["batches_applied"] == before + len(rest)


async def test_what_the_reader_applies_with_errors_is_counted_as_python_counts_it(
    pair: Pair,
) -> None:
    """A batch applied on the reader's thread whose events had errors (a block of the
    wrong size) reaches Python's counters as it does on the ingest thread."""
    [first] = await pair.native.make_batches(1)
    await pair.deliver(first)
    await until(pair.both_are_engine, timeout=15, what="routed")
    await pair.engine.publish([BlockStored([12345], None, list(range(6)), 6, medium="GPU")])
    await pair.deliver(pair.engine.seq)
    ingests = [f.pool.ingest for f in pair.feeds]
    await until(
        lambda: all(i.errors["block_size_mismatch"] == 1 for i in ingests), what="counted"
    )
    await until(pair.both_are_engine, timeout=15, what="the batch applied")
    assert pair.native.app.state.events.counts["native_applied"] == 0  # noted, not plain


async def test_a_forged_epoch_on_a_routed_worker_goes_to_python(pair: Pair) -> None:
    """Another engine life clears a worker only once its agent confirms it (EventSync);
    the reader must not apply it, though its seq follows on."""
    [first, second] = await pair.native.make_batches(2)
    await pair.deliver(first)
    await pair.deliver(second)
    await until(pair.both_are_engine, timeout=15, what="routed")
    nxt = pair.engine.seq + 1
    payload = dict(pair.engine.ring)[second]
    await pair.native.nc.publish(
        "kv.events.w0", payload, headers={"Kv-Seq": str(nxt), "Kv-Epoch": "forged"}
    )
    counts = pair.native.app.state.events.counts
    await until(lambda: counts["epoch_unconfirmed"] >= 1, what="held for the agent")
    await until(pair.both_are_engine, timeout=15, what="the real life kept")


async def test_a_restarted_server_marks_workers_out_of_sync_then_resyncs() -> None:
    port = free_port()
    server = EmbeddedNats(port, jetstream=False).start()
    engine = await EngineDouble("w0", nats_url=server.url, capacity=40).start()
    engine.drop_next = SILENT
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    feed, served = await start_router(engine, server.url, nc, "native")
    try:
        [s0] = await feed.make_batches(1)
        await feed.deliver(s0)
        await until(feed.index_is_engine, timeout=15, what="clean start")
        server.stop()
        events = feed.app.state.events
        await until(lambda: events.counts["lost_native_disconnect"] >= 1, what="loss seen")
        assert not feed.pool.ingest.in_sync("w0")  # at once, not at the next batch
        server = EmbeddedNats(port, jetstream=False).start()
        # what the engine made while NATS was down comes from its replay
        await feed.make_batches(3)
        await until(feed.index_is_engine, timeout=30, what="resynced after the restart")
    finally:
        await nc.close()
        await served.stop()
        await engine.stop()
        server.stop()


async def test_a_full_queue_marks_the_worker_out_of_sync_then_resyncs(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native_events, "MAX_QUEUED", 1)
    engine = await EngineDouble("w0", nats_url=nats_url, capacity=40).start()
    engine.drop_next = SILENT
    nc = await nats.connect(nats_url)
    feed, served = await start_router(engine, nats_url, nc, "native")
    try:
        events = feed.app.state.events
        batches = await feed.make_batches(4)
        for seq in reversed(batches):  # out of order: none applies natively, all queue
            await feed.nc.publish(
                "kv.events.w0",
                dict(engine.ring)[seq],
                headers={"Kv-Seq": str(seq), "Kv-Epoch": engine.epoch},
            )
        await feed.nc.flush()
        time.sleep(0.5)  # the loop is busy: the reader's queue (1 message) overflows
        await until(lambda: events.counts["lost_native_dropped"] >= 1, what="drop counted")
        await until(feed.index_is_engine, timeout=15, what="resynced from the agent")
        assert feed.app.state.feed.native.stats()["dropped"] >= 1
        reader = admin_index.reader(feed.app.state.feed)  # what /admin/index shows under "nats"
        assert reader["kind"] == "native" and reader["dropped"] >= 1
    finally:
        await nc.close()
        await served.stop()
        await engine.stop()


@pytest.fixture
def auth_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats(jetstream=False, args=["--user", "router", "--pass", "s3cret"]) as server:
        yield server


async def test_user_and_password_reach_the_server(auth_server: EmbeddedNats) -> None:
    url = f"nats://router:s3cret@127.0.0.1:{auth_server.port}"
    engine = await EngineDouble("w0", nats_url=url, capacity=40).start()
    engine.drop_next = SILENT
    nc = await nats.connect(url)
    feed, served = await start_router(
        engine, auth_server.url, nc, "native", nats_user="router", nats_password="s3cret"
    )
    try:
        [first, *rest] = await feed.make_batches(3)
        await feed.deliver(first)
        await until(lambda: feed.pool.ingest.last_seq("w0") == first, what="first applied")
        for seq in rest:
            await feed.deliver(seq)
        await until(feed.index_is_engine, timeout=15, what="events read with credentials")
        counts = feed.app.state.events.counts
        await until(lambda: counts["native_applied"] == len(rest), what="applied natively")
    finally:
        await nc.close()
        await served.stop()
        await engine.stop()


def reader(port: int, *, password: str = "", max_payload: int = 1 << 20) -> _native.EventReader:
    return _native.EventReader(
        [("127.0.0.1", port)],
        "kv.events.>",
        "kv.events.",
        "router" if password else "",
        password,
        "",
        "test",
        connect_timeout=2.0,
        ping_interval=0.5,
        max_control=4096,
        max_payload=max_payload,
        max_queued=100,
        max_queued_bytes=1 << 22,
    )


async def records(
    r: _native.EventReader, done: Callable[[list[tuple[object, ...]]], bool], timeout: float = 10
) -> list[tuple[object, ...]]:
    """The reader's records (a dropped worker as ``(5, worker)``) until ``done`` (bounded)."""
    got: list[tuple[object, ...]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        polled, dropped, _all, _applied, _more = r.poll(100)
        got += polled + [(5, w) for w in dropped]
        if done(got):
            return got
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out; got {got}")


def has(kind: int) -> Callable[[list[tuple[object, ...]]], bool]:
    return lambda got: any(rec[0] == kind for rec in got)


async def test_a_wrong_password_is_reported_never_up(auth_server: EmbeddedNats) -> None:
    r = reader(auth_server.port, password="wrong")
    r.start()
    try:
        got = await records(r, has(4))
        assert not r.up and any("Authorization" in str(rec[1]) for rec in got if rec[0] == 4)
    finally:
        r.close()


async def test_framing_headers_garbage_and_oversized_messages(nats_url: str) -> None:
    port = int(nats_url.rsplit(":", 1)[1])
    r = reader(port, max_payload=1024)
    r.start()
    nc = await nats.connect(nats_url)
    try:
        await records(r, has(2))  # subscribed
        await nc.publish("kv.events.w1", b"plain", headers={"Kv-Seq": "7", "X": "a: b"})
        await nc.publish("kv.events.w2", b"x" * 4096, headers={"Kv-Seq": "8"})  # oversized
        await nc.publish("kv.events.w3", b"")  # no headers, empty payload
        await nc.publish("kv.events.w4", bytes(range(256)) * 3, headers={"Kv-Seq": "nope"})
        await nc.flush()
        got = await records(r, lambda got: sum(rec[0] in (0, 5) for rec in got) == 4)
        msgs = {rec[1]: rec for rec in got if rec[0] == 0}
        assert msgs["kv.events.w1"][2] == {"Kv-Seq": "7", "X": "a: b"}
        assert msgs["kv.events.w1"][3] == b"plain"
        assert msgs["kv.events.w3"][2] is None and msgs["kv.events.w3"][3] == b""
        assert msgs["kv.events.w4"][3] == bytes(range(256)) * 3
        assert (5, "w2") in got and r.stats()["oversized"] == 1
        assert r.up  # skipped, not a lost connection
    finally:
        await nc.close()
        r.close()


def test_native_is_refused_where_it_cannot_read() -> None:
    base = {"nats_url": "nats://127.0.0.1:4222", "events_reader": "native"}
    # the stream is read by nats-py up to date, then the reader takes over (router.events.feed)
    validate(RouterConfig(**base, events_transport="jetstream"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="events_reader = native: it speaks no tls://"):
        validate(RouterConfig(**{**base, "nats_url": "tls://127.0.0.1:4222"}))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="events_reader = native: it needs nats_url"):
        validate(RouterConfig(events_reader="native"))


def test_a_new_route_gives_the_pools_other_routes_the_new_quota() -> None:
    """The per-worker quota is the pool's bound over its workers with a slot: once a
    worker added later is routed, the routes already there do not keep the larger one."""
    from router.events.consumer import EventSync
    from router.workers.registry import WorkerRegistry

    cfg = RouterConfig(
        nats_url="nats://127.0.0.1:1",
        events_transport="core",
        max_index_blocks=1000,
        workers=[WorkerSpec(w, f"http://127.0.0.1:9/{w}", model="m") for w in ("w0", "w1")],
    )
    registry = WorkerRegistry(cfg)
    registry.add(cfg.workers[0])
    ingest = registry.pools["default"].ingest
    reader = native_events.NativeEvents(
        cfg, EventSync(registry), on_up=lambda: None, on_lost=lambda _why: None
    )
    try:
        ingest.index.locate("w0")
        reader.route("w0", ingest, None)
        alone = reader._routes["w0"].quota
        registry.add(cfg.workers[1])  # discovered later
        ingest.index.locate("w1")
        reader.route("w1", ingest, None)
        assert reader._routes["w0"].quota == reader._routes["w1"].quota == alone // 2
    finally:
        reader.close()


async def test_the_stream_hands_the_live_events_to_the_reader_and_loses_none(
    nats_url: str,
) -> None:
    """With JetStream (the default transport where the server has it) nats-py reads the
    stream up to date, then the native reader takes the live events over
    (router/events/feed.py). Batches published before the router starts and all through the
    hand-off arrive once each and in order: no gap, and with no agent to answer a replay
    the index still ends as the engine's; the reader applies the later ones itself."""
    engine = await EngineDouble("w0", capacity=400, ring=10_000).start()  # no replays
    nc = await nats.connect(nats_url)
    cfg = RouterConfig(
        nats_url=nats_url,
        block_size=4,
        admin_token="t",
        workers=[WorkerSpec("w0", engine.url, model="m")],
    )
    app = RouterApp(cfg)
    feed = Feed(engine, app, "", nc)
    stop = asyncio.Event()

    async def publish() -> None:  # in order, every few ms, until told to stop
        while not stop.is_set():
            for seq in await feed.make_batches(1):
                await feed.deliver(seq)
            await asyncio.sleep(0.003)

    await ensure_stream(nc, StreamSpec())  # as the agents do when they start
    for seq in await feed.make_batches(20):  # in the stream before the router starts
        await feed.deliver(seq)
    publisher = asyncio.create_task(publish())
    served = await Served(app).start()
    try:
        await until(lambda: app.state.feed.native_live, timeout=15, what="handed off")
        counts = app.state.events.counts
        await until(lambda: counts["native_applied"] >= 20, timeout=15, what="reader applies")
        stop.set()
        await publisher
        await until(feed.index_is_engine, timeout=15, what="index is the engine's")
        assert engine.seq > 40 and counts["native_handoffs"] == 1
        assert counts["stream_caught_up"] >= 1 and app.state.feed.reader.pending == 0
        assert counts[SeqStatus.GAP] == 0 and not [k for k in counts if k.startswith("lost")]
        assert admin_index.reader(app.state.feed)["kind"] == "native"
    finally:
        stop.set()
        await publisher
        await nc.close()
        await served.stop()
        await engine.stop()
