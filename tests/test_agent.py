"""The node agent end to end: mock engine -> ZMQ -> agent -> real nats-server -> a
router-side subscriber that applies batches with ``EventIngest`` and asks the agent for
replays or dumps over NATS, as ``index/gapfill.py`` says."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import httpx
import nats
import orjson
import pytest
import zmq
import zmq.asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from stack import subscribed
from stack import until as wait_until

from agent.node import AgentConfig, NodeAgent
from index import codec
from index.backend import make_ingest
from index.codec import BlockStored, EventBatch, decode, encode
from index.gapfill import GapFillMessage, GapFillRequest
from index.hashing import BlockHasher
from index.ingest import SeqStatus
from index.prefix_index import PrefixIndex
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.natsd import EmbeddedNats, free_port, free_ports
from sim.mock.publisher import KvEventPublisher, wire_hash
from sim.mock.scheduler import Timing
from sim.mock.text import MockText

BS = 4
FAST = Timing(speed=200.0)


# Agent tests wait for whole engine->NATS->router round trips: a longer bound than usual.
until = functools.partial(wait_until, timeout=15.0)


def engine_config(**kw: object) -> MockEngineConfig:
    base: dict[str, object] = {
        "block_size": BS,
        "gpu_blocks": 48,
        "zmq_endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "timing": FAST,
    }
    base.update(kw)
    return MockEngineConfig(**base)  # type: ignore[arg-type]


def agent_config(
    worker: str, engine: MockEngine | None, nats_url: str, **kw: object
) -> AgentConfig:
    base: dict[str, object] = {
        "worker_id": worker,
        "zmq_endpoint": engine.zmq_endpoint if engine else "",
        "replay_endpoint": engine.replay_endpoint if engine else None,
        "engine_url": engine.url if engine else None,
        "nats_url": nats_url,
        "load_interval": 0.05,
        "replay_timeout": 0.5,
    }
    base.update(kw)
    return AgentConfig(**base)  # type: ignore[arg-type]


class RouterSide:
    """A minimal router: live batches into ``EventIngest``; on a gap, replay over NATS."""

    def __init__(self, nc: NATS, worker: str, drop: set[int] | None = None) -> None:
        self.nc = nc
        self.worker = worker
        self.hasher = BlockHasher(BS)
        self.ingest = make_ingest(PrefixIndex(), self.hasher)
        self.drop = set(drop or ())  # seqs to lose on purpose
        self.epochs: list[str] = []
        self.replays: list[tuple[int, bool]] = []  # (from_seq, answered by a dump)

    async def start(self) -> RouterSide:
        await self.nc.subscribe(f"kv.events.{self.worker}", cb=self._on_event)
        await subscribed(self.nc)
        return self

    async def _on_event(self, msg: Msg) -> None:
        headers = msg.headers or {}
        seq, epoch = int(headers["Kv-Seq"]), headers["Kv-Epoch"]
        if not self.epochs or self.epochs[-1] != epoch:
            self.epochs.append(epoch)
        if seq in self.drop:
            self.drop.discard(seq)
            return
        result = self.ingest.apply(self.worker, seq, msg.data, epoch=epoch)
        if result.status in (SeqStatus.GAP, SeqStatus.MALFORMED):
            await self.gap_fill(result.expected_seq or 0)
            self.ingest.apply(self.worker, seq, msg.data, epoch=epoch)

    async def gap_fill(self, from_seq: int) -> GapFillMessage:
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        await self.nc.publish(
            f"kv.replay.{self.worker}", GapFillRequest(from_seq).encode(), reply=inbox
        )
        msgs = []
        while True:
            m = GapFillMessage.decode((await sub.next_msg(timeout=5)).data)
            if m.kind == "end":
                break
            msgs.append(m)
        await sub.unsubscribe()
        if m.dump:
            batches = [decode(d.payload) for d in msgs]
            self.ingest.load_dump(self.worker, m.seq, batches, epoch=m.epoch)
        else:
            for b in msgs:
                self.ingest.apply(self.worker, b.seq, b.payload, epoch=m.epoch)
        self.replays.append((from_seq, m.dump))
        return m

    def caught_up(self, engine: MockEngine) -> bool:
        assert engine.publisher is not None
        last = self.ingest.last_seq(self.worker)
        return self.ingest.in_sync(self.worker) and last == engine.publisher.seq - 1

    def assert_matches(self, engine: MockEngine, prompts: list[str]) -> None:
        """The router's view equals the engine's cache: blocks held, and per prompt the
        leading GPU / GPU+host hits."""
        cache = engine.cache
        held = {wire_hash(h, engine.cfg.encoding) for h in cache.gpu_hashes() | cache.host_hashes()}
        assert set(self.ingest.engine_blocks(self.worker)) == held
        for prompt in prompts:
            tokens = engine.text.completion(prompt)
            gpu, host_more = cache.lookup(cache.hash_blocks(tokens))
            got = self.ingest.index.match_tiers(self.hasher.hash_tokens(tokens)).get(self.worker)
            assert ((got.gpu, got.cpu) if got else (0, 0)) == (gpu, gpu + host_more), prompt


async def complete(engine: MockEngine, prompts: list[str]) -> list[int]:
    """Send prompts one by one; their cached_tokens."""
    out = []
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as http:
        for p in prompts:
            r = await http.post("/v1/completions", json={"prompt": p, "max_tokens": 2})
            r.raise_for_status()
            out.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return out


PROMPTS = [f"doc {i % 4}: " + "the quick brown fox jumps over it " * (2 + i % 3) for i in range(10)]


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_url)
    yield client
    await client.close()


async def test_index_follows_the_engine_through_stores_and_evictions(
    nats_url: str, nc: NATS
) -> None:
    loads: list[dict[str, object]] = []

    async def on_load(msg: Msg) -> None:
        loads.append(orjson.loads(msg.data))

    await nc.subscribe("kv.load.w-e2e", cb=on_load)
    async with MockEngine(engine_config(gpu_blocks=20, host_blocks=12)) as engine:
        side = await RouterSide(nc, "w-e2e").start()
        async with NodeAgent(agent_config("w-e2e", engine, nats_url)) as agent:
            cached = await complete(engine, PROMPTS)
            await until(lambda: side.caught_up(engine), what="router in sync")
            side.assert_matches(engine, PROMPTS)
            await until(lambda: len(loads) >= 2, what="load reports")
            stats = agent.stats()
    assert any(cached) and not all(cached)
    events = [e for m in engine.publisher.buffer for e in decode(m[1]).events]  # type: ignore[union-attr]
    assert any(e.medium == "CPU" for e in events if isinstance(e, BlockStored))  # host tier used
    assert len(side.epochs) == 1 and side.replays == []
    assert stats["published"] == engine.publisher.seq  # type: ignore[union-attr]
    assert stats["restarts"] == 0 and stats["publish_failed"] == 0
    report = loads[-1]
    # and why requests wait, as the mock says it like vLLM 0.32 (none deferred, never
    # preempting, its 20 pages)
    assert set(report) == {"running", "waiting", "kv_usage", "ts", "deferred", "preemptions",
                           "kv_tokens"}  # fmt: skip
    assert (report["deferred"], report["preemptions"]) == (0, 0)
    assert report["kv_tokens"] == 20 * BS
    assert 0.0 <= report["kv_usage"] <= 1.0 and report["waiting"] == 0  # type: ignore[operator]


async def test_a_dropped_batch_is_replayed_from_the_ring(nats_url: str, nc: NATS) -> None:
    async with MockEngine(engine_config()) as engine:
        side = await RouterSide(nc, "w-drop", drop={2}).start()
        async with NodeAgent(agent_config("w-drop", engine, nats_url)):
            await complete(engine, PROMPTS)
            await until(lambda: side.caught_up(engine), what="router in sync")
            side.assert_matches(engine, PROMPTS)
    assert side.replays == [(2, False)]


async def test_a_dump_is_served_once_the_seq_left_the_ring(nats_url: str, nc: NATS) -> None:
    async with MockEngine(engine_config()) as engine:
        side = await RouterSide(nc, "w-dump", drop={1, 2, 3}).start()
        async with NodeAgent(agent_config("w-dump", engine, nats_url, buffer=2)) as agent:
            await complete(engine, PROMPTS)
            await until(lambda: side.caught_up(engine), what="router in sync")
            side.assert_matches(engine, PROMPTS)
            assert agent.stats()["dumps"] == 1
    assert side.replays == [(1, True)]


async def test_sha256_hashes_survive_dumps_and_prefetch_hints(nats_url: str, nc: NATS) -> None:
    """vLLM's default block hashes are 32 bytes: the mirror, its dump (msgpack), the
    replay to the router and a prefetch hint (JSON, hex) all carry them unchanged."""
    sha = {"encoding": "vllm-sha256", "gpu_blocks": 128}
    async with (
        MockEngine(engine_config(**sha)) as source,
        MockEngine(engine_config(**sha, host_blocks=64)) as target,
    ):
        side = await RouterSide(nc, "w-sha", drop={1, 2, 3}).start()
        async with (
            NodeAgent(agent_config("w-sha", source, nats_url, buffer=2)) as agent,
            NodeAgent(agent_config("w-sha-dst", target, nats_url)) as dst_agent,
        ):
            await complete(source, PROMPTS)
            await until(lambda: side.caught_up(source), what="router in sync")
            side.assert_matches(source, PROMPTS)  # the dump carried 32-byte hashes
            assert agent.stats()["dumps"] == 1 and agent.stats()["replay_errors"] == 0
            # a hint names the source's blocks the way the router's hint_message does
            tokens = source.text.completion(PROMPTS[0])
            own = source.cache.hash_blocks(tokens)
            names = [wire_hash(h, "vllm-sha256") for h in own]
            assert all(isinstance(h, bytes) and len(h) == 32 for h in names)
            hint = {
                "request_id": "r-sha",
                "source_worker": "w-sha",
                "target_worker": "w-sha-dst",
                "block_hashes": [codec.hash_to_json(h) for h in names],
                "num_tokens": len(names) * BS,
                "tier": "cpu",
            }
            await nc.publish("kv.prefetch.w-sha-dst", orjson.dumps(hint))
            await until(lambda: target.cache.host_hashes() >= set(own), what="blocks landed")
            stats = dst_agent.stats()
    assert side.replays == [(1, True)]
    assert stats["prefetch_resolved"] == 1 and stats["prefetch_delivered"] == 1


async def test_engine_restart_starts_a_new_epoch_and_resyncs(nats_url: str, nc: NATS) -> None:
    first = MockEngine(engine_config())
    await first.start()
    cfg = engine_config(
        port=first.port,
        zmq_endpoint=first.zmq_endpoint,
        replay_endpoint=first.replay_endpoint,
    )
    side = await RouterSide(nc, "w-restart").start()
    async with NodeAgent(agent_config("w-restart", first, nats_url)) as agent:
        await complete(first, PROMPTS[:6])
        await until(lambda: side.caught_up(first), what="first engine in sync")
        await first.stop()
        async with MockEngine(cfg) as second:  # same ports: a restarted process
            await complete(second, PROMPTS[6:])
            await until(lambda: len(side.epochs) == 2 and side.caught_up(second), what="resync")
            side.assert_matches(second, PROMPTS)
            assert agent.stats()["restarts"] == 1
    only_first = set(first.cache.gpu_hashes()) - second.cache.gpu_hashes()
    assert only_first and not only_first & set(side.ingest.engine_blocks("w-restart"))


async def test_restart_with_rising_seqs_is_found_by_the_engine_replay(
    nats_url: str, nc: NATS
) -> None:
    """A new engine whose first batches the agent misses can reach seqs above the old
    engine's last one; after the reconnect the agent compares its last batch with what
    the engine's replay socket holds for that seq."""

    def stored(h: int) -> list[BlockStored]:
        return [BlockStored([h], None, [h] * BS, BS, medium="GPU")]

    first = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    first.start()
    first.publish(stored(1))  # before the agent: it takes it from the replay socket
    side = await RouterSide(nc, "w-rise").start()
    cfg = agent_config("w-rise", None, nats_url, zmq_endpoint=first.endpoint)
    cfg.replay_endpoint = first.replay_endpoint
    async with NodeAgent(cfg) as agent:
        await until(lambda: side.ingest.last_seq("w-rise") == 0, what="first engine in sync")
        await first.close()
        await until(lambda: agent._suspect_restart, what="disconnect seen")
        second = KvEventPublisher(first.endpoint, first.replay_endpoint)
        second.start()
        second.publish(stored(2))  # seqs 0 and 1 go out before the agent reconnects
        second.publish(stored(3))
        h = 4
        while side.ingest.last_seq("w-rise") != second.seq - 1 or len(side.epochs) < 2:
            second.publish(stored(h))
            h += 1
            await asyncio.sleep(0.05)
            assert h < 400, "the agent never resynced"
        stats = agent.stats()
        await second.close()
    assert stats["restarts"] == 1 and stats["restarts_found_by_replay"] == 1
    assert sorted(side.ingest.engine_blocks("w-rise")) == list(range(2, h))


async def test_a_restart_found_on_reconnect_clears_the_router_at_once(
    nats_url: str, nc: NATS
) -> None:
    """The new engine has published nothing yet (no traffic since it came back, which
    health checks may never have noticed): the agent still tells routers right away."""
    first = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    first.start()
    side = await RouterSide(nc, "w-quiet").start()
    cfg = agent_config("w-quiet", None, nats_url, zmq_endpoint=first.endpoint)
    cfg.replay_endpoint = first.replay_endpoint
    async with NodeAgent(cfg) as agent:
        await until(lambda: agent._sub is not None and agent.core.last_seq is None)
        first.publish([BlockStored([1, 2], None, list(range(2 * BS)), BS, medium="GPU")])
        await until(lambda: set(side.ingest.engine_blocks("w-quiet")) == {1, 2}, what="stored")
        await first.close()
        await until(lambda: agent._suspect_restart, what="disconnect seen")
        second = KvEventPublisher(first.endpoint, first.replay_endpoint)
        second.start()  # a new life that publishes nothing
        await until(lambda: not side.ingest.engine_blocks("w-quiet"), what="router cleared")
        assert len(side.epochs) == 2 and side.ingest.in_sync("w-quiet")
        second.publish([BlockStored([3], None, list(range(BS)), BS, medium="GPU")])
        await until(lambda: set(side.ingest.engine_blocks("w-quiet")) == {3}, what="new life")
        stats = agent.stats()
        await second.close()
    assert stats["epoch_starts_published"] == 1 and side.replays == []


async def test_agent_started_late_catches_up_from_the_engine_replay(
    nats_url: str, nc: NATS
) -> None:
    async with MockEngine(engine_config()) as engine:
        await complete(engine, PROMPTS[:5])  # nobody listening yet
        async with NodeAgent(agent_config("w-late", engine, nats_url)) as agent:
            assert engine.publisher is not None
            await until(lambda: agent.core.last_seq == engine.publisher.seq - 1, what="catch-up")
            side = await RouterSide(nc, "w-late").start()
            end = await side.gap_fill(0)
            assert not end.dump and end.seq == engine.publisher.seq - 1
            side.assert_matches(engine, PROMPTS[:5])


async def test_prefetch_hint_on_nats_changes_a_later_hit(nats_url: str, nc: NATS) -> None:
    prompt = "a long shared system prompt that two engines should both serve " * 2
    async with (
        MockEngine(engine_config(gpu_blocks=128)) as source,
        MockEngine(engine_config(gpu_blocks=128, host_blocks=64)) as target,
        NodeAgent(agent_config("w-src", source, nats_url)) as src_agent,
        NodeAgent(agent_config("w-dst", target, nats_url)) as dst_agent,
    ):
        await complete(source, [prompt])
        assert source.publisher is not None
        await until(lambda: src_agent.core.last_seq == source.publisher.seq - 1)
        tokens = source.text.completion(prompt)
        hashes = source.cache.hash_blocks(tokens)
        hint = {
            "request_id": "r1",
            "model": "mock-model",
            "source_worker": "w-src",
            "target_worker": "w-dst",
            "block_hashes": hashes,  # the source's own names; no token ids
            "num_tokens": len(hashes) * BS,
            "tier": "cpu",
            "deadline_ms": 500,
        }
        await nc.publish("kv.prefetch.w-dst", orjson.dumps(hint))
        await until(lambda: target.cache.host_hashes() >= set(hashes), what="blocks landed")
        [cached] = await complete(target, [prompt])
        stats = dst_agent.stats()
    assert cached == min(len(hashes), (len(tokens) - 1) // BS) * BS
    assert stats["prefetch_resolved"] == 1 and stats["prefetch_delivered"] == 1


async def test_hints_that_cannot_be_delivered_are_counted(nats_url: str, nc: NATS) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = agent_config("w-dead", None, nats_url, engine_url=dead, zmq_endpoint="tcp://127.0.0.1:1")
    async with NodeAgent(cfg) as agent:
        hint = {"request_id": "x", "block_hashes": [1, 2], "token_ids": [0] * 8}
        await nc.publish("kv.prefetch.w-dead", orjson.dumps(hint))
        await nc.publish("kv.prefetch.w-dead", b"not json")
        await nc.publish("kv.prefetch.w-dead", orjson.dumps({"block_hashes": "nope"}))
        reply = await nc.request("kv.replay.w-dead", b"{bad", timeout=5)
        blocks = await nc.request("kv.blocks.w-dead", orjson.dumps({"block_hashes": [1]}), 5)
        await until(lambda: agent.stats()["prefetch_undelivered"] == 1, what="undelivered")
        stats = agent.stats()
    assert stats["prefetch_received"] == 3 and stats["prefetch_malformed"] == 2
    assert stats["bad_replay_requests"] == 1 and GapFillMessage.decode(reply.data).kind == "end"
    assert orjson.loads(blocks.data) == {"token_ids": []}
    assert stats["load_scrape_failed"] >= 1


async def test_bad_frames_are_counted_and_holes_replayed_as_dumps(nats_url: str, nc: NATS) -> None:
    """A hand-driven engine socket sends garbage among real batches."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)  # a PUB that also reports subscribers joining
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    side = await RouterSide(nc, "w-bad").start()
    cfg = agent_config("w-bad", None, nats_url, zmq_endpoint=endpoint)
    try:
        async with NodeAgent(cfg) as agent:
            assert (await asyncio.wait_for(pub.recv(), 10))[0] == 1  # subscribed
            good = encode(EventBatch(1.0, [BlockStored([7], None, [1, 2, 3, 4], BS)], 0))
            await pub.send_multipart([b"", b"only two frames"])
            await pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1garbage"])
            await pub.send_multipart([b"", (1).to_bytes(8, "big"), good])
            await until(lambda: side.ingest.last_seq("w-bad") == 1, what="router in sync")
            stats = agent.stats()
    finally:
        ctx.destroy(linger=0)
    assert stats["bad_frames"] == 1 and stats["bad_payloads"] == 1 and stats["published"] == 1
    assert side.replays == [(0, True)]  # seq 0 is a hole: only a dump can cover it
    assert list(side.ingest.engine_blocks("w-bad")) == [7]


async def test_agent_waits_for_nats_and_survives_its_restart() -> None:
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    async with MockEngine(engine_config()) as engine:
        agent = NodeAgent(agent_config("w-nats", engine, url))
        starting = asyncio.create_task(agent.start())
        await until(lambda: agent.counters["nats_errors"] >= 1, what="a failed try")
        server = EmbeddedNats(port).start()
        try:
            await asyncio.wait_for(starting, 15)
            client = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
            side = await RouterSide(client, "w-nats").start()
            await complete(engine, PROMPTS[:2])
            await until(lambda: side.caught_up(engine), what="in sync before the restart")
            server.stop()
            server = EmbeddedNats(port).start()
            await until(
                lambda: client.is_connected and agent.nc is not None and agent.nc.is_connected
            )
            await complete(engine, PROMPTS[2:4])
            await until(lambda: side.caught_up(engine), what="in sync after the restart")
            side.assert_matches(engine, PROMPTS[:4])
            await client.close()
        finally:
            await agent.stop()
            server.stop()


def test_cli_processes_end_to_end(nats_server: EmbeddedNats) -> None:
    """``cache-router mock-engine`` and ``cache-router agent`` as real processes."""
    http_port, zmq_port, replay_port = free_ports(3)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cli = [sys.executable, "-m", "router.cli"]
    engine = subprocess.Popen(
        [*cli, "mock-engine", "--port", str(http_port), "--block-size", str(BS),
         "--zmq-endpoint", f"tcp://127.0.0.1:{zmq_port}",
         "--replay-endpoint", f"tcp://127.0.0.1:{replay_port}", "--speed", "100"],
        env=env,
    )  # fmt: skip
    agent = subprocess.Popen(
        [*cli, "agent", "--worker-id", "w-cli", "--engine-url", f"http://127.0.0.1:{http_port}",
         "--zmq-endpoint", f"tcp://127.0.0.1:{zmq_port}",
         "--replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
         "--nats-url", nats_server.url, "--load-interval", "0.1"],
        env=env,
    )  # fmt: skip

    async def drive() -> None:
        client = await nats.connect(nats_server.url)
        side = await RouterSide(client, "w-cli").start()
        load = await client.subscribe("kv.load.w-cli")
        await load.next_msg(timeout=30)  # the agent is up and scraping the engine
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http:
            body = {"prompt": "processes talk over real sockets " * 3, "max_tokens": 2}
            for _ in range(2):
                last = (await http.post("/v1/completions", json=body)).json()
        tokens = MockText().completion(body["prompt"])  # what the engine process saw
        want = (len(tokens) - 1) // BS
        hashes = BlockHasher(BS).hash_tokens(tokens)
        await until(lambda: side.ingest.index.match(hashes).get("w-cli", 0) >= want)
        assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == want * BS
        await client.close()

    try:
        asyncio.run(drive())
    finally:
        for proc in (agent, engine):
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(15) for proc in (agent, engine)]
    assert codes == [0, 0]


async def test_an_endpoint_nobody_binds_is_reported(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM with ``tcp://127.0.0.1:P`` connects its PUB socket instead of binding: the
    agent's SUB connects too, and without this warning nothing says no event will come."""
    unbound = f"tcp://127.0.0.1:{free_port()}"
    bound = KvEventPublisher("tcp://127.0.0.1:*")
    try:
        quiet = agent_config("w-unbound", None, nats_url, zmq_endpoint=unbound)
        fine = agent_config("w-bound", None, nats_url, zmq_endpoint=bound.endpoint)
        for cfg in (quiet, fine):
            cfg.connect_warn_after = 1.0
        async with NodeAgent(quiet) as lost, NodeAgent(fine) as ok:
            await until(lambda: lost.stats()["engine_unreachable_warnings"] >= 1)
            await until(lambda: ok.engine_connected, what="bound endpoint connected")
            await asyncio.sleep(0.5)
            assert ok.stats()["engine_unreachable_warnings"] == 0
    finally:
        await bound.close()
    assert any("wildcard" in r.getMessage() and unbound in r.getMessage() for r in caplog.records)


async def test_a_long_catch_up_goes_out_as_its_newest_batch_only(nats_url: str, nc: NATS) -> None:
    """A fresh agent beside an engine with a history republished it batch by batch, and a
    router applying them one at a time said "in sync" at every step with a past state
    (evicted blocks included). Only the newest goes out now: a router sees the gap and
    takes the rest from the agent's ring in one answer."""
    seqs: list[int] = []

    async def on_event(msg: Msg) -> None:
        seqs.append(int((msg.headers or {})["Kv-Seq"]))

    await nc.subscribe("kv.events.w-hist", cb=on_event)
    await subscribed(nc)
    async with MockEngine(engine_config(gpu_blocks=20)) as engine:
        await complete(engine, PROMPTS)  # stores and evictions, nobody listening yet
        assert engine.publisher is not None
        head = engine.publisher.seq - 1
        assert head >= 5
        async with NodeAgent(agent_config("w-hist", engine, nats_url)) as agent:
            await until(lambda: agent.core.last_seq == head and head in seqs, what="catch-up")
            side = await RouterSide(nc, "w-hist").start()
            end = await side.gap_fill(0)
            side.assert_matches(engine, PROMPTS)
    assert seqs == [head] and not end.dump and end.seq == head


async def test_an_agent_that_has_not_read_its_engine_says_so(nats_url: str, nc: NATS) -> None:
    """Before the engine's replay socket answered, the agent's (empty) state is no answer:
    a replay request gets ``reading`` and the agent's last seq; once read, the batches."""
    zmq_port, replay_port = free_ports(2)
    cfg = engine_config(
        zmq_endpoint=f"tcp://127.0.0.1:{zmq_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}"
    )
    acfg = agent_config("w-first", None, nats_url, zmq_endpoint=cfg.zmq_endpoint)
    acfg.replay_endpoint = cfg.replay_endpoint
    async with NodeAgent(acfg) as agent:  # its engine is not up yet
        side = RouterSide(nc, "w-first")
        end = await side.gap_fill(0)
        assert end.reading and end.seq == -1 and agent.stats()["replays_while_reading"] == 1
        async with MockEngine(cfg) as engine:
            await complete(engine, PROMPTS[:3])
            assert engine.publisher is not None
            await until(lambda: agent.core.last_seq == engine.publisher.seq - 1)  # type: ignore[union-attr]
            await until(lambda: not agent.reading)
            end = await side.gap_fill(0)
            assert not end.reading and end.seq == engine.publisher.seq - 1
            side.assert_matches(engine, PROMPTS[:3])
