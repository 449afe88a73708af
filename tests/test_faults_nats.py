"""NATS stops and comes back mid-traffic.

Two router replicas in front of mock engines and their node agents. While the server is
down every request still succeeds: routers route on load alone once ``blind_after`` has
passed (the index is not trusted without its event feed). A new server on the same
port, with the JetStream store kept (a restarted server) or wiped (a replacement):
routers reconnect, ask the agents for what they missed and end with the index the
engines really have, the same as a replica started afresh. With nats-py reading the
events (``events_reader = "python"``) they read the stream again first (from where they
were, or from the start of the new stream); the native reader, which took the live
events over once the stream was read (router/events/feed.py), reads none of it again.
"""

from __future__ import annotations

import shutil
import time
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import nats
import pytest
from stack import MockStack, Replica, index_blocks, matches, prompt, send, until

from sim.mock.natsd import EmbeddedNats


@pytest.mark.parametrize("reader", ["native", "python"])
@pytest.mark.parametrize("store", ["kept", "wiped"])
async def test_nats_restart_mid_traffic(tmp_path: Path, store: str, reader: str) -> None:
    server = EmbeddedNats(store=tmp_path).start()
    stack = await MockStack(server.url).start(2)
    prompts = [prompt(i) for i in range(18)]

    def cfg(replica_id: str) -> object:
        return stack.router_config(replica_id, blind_after=0.5, events_reader=reader)

    try:
        async with AsyncExitStack() as cleanup, httpx.AsyncClient(timeout=30) as http:
            a = await Replica(cfg("a")).start()
            cleanup.push_async_callback(a.stop)
            b = await Replica(cfg("b")).start()
            cleanup.push_async_callback(b.stop)
            replicas = (a, b)
            for i, p in enumerate(prompts[:6]):
                await send(http, replicas[i % 2], p)
            for r in replicas:
                await until(lambda r=r: stack.synced(r), what="in sync before the fault")

            server.stop()
            if store == "wiped":
                shutil.rmtree(tmp_path)
                tmp_path.mkdir()
            await until(lambda: not any(r.state.bus.connected for r in replicas), what="down")
            for i, p in enumerate(prompts[6:12]):  # served while NATS is away
                await send(http, replicas[i % 2], p)
            await until(lambda: a.state.feed.blind(time.monotonic()), what="blind")
            r = await http.post(
                a.url + "/admin/explain",
                json={"model": "mock-model", "prompt": prompts[0]},
                headers={"authorization": "Bearer t"},
            )
            assert r.status_code == 200
            assert [w["view"]["in_sync"] for w in r.json()["workers"]] == [False, False]
            assert all(w["view"]["match"]["total"] == 0 for w in r.json()["workers"])
            await send(http, a, prompts[0])  # and routing goes on, on load alone

            server.start()  # same port: clients reconnect by themselves
            for i, p in enumerate(prompts[12:]):
                await send(http, replicas[i % 2], p)
            for r in replicas:
                await until(lambda r=r: stack.synced(r), timeout=20, what="in sync after")
                assert r.state.bus.reconnects >= 1
                assert not r.state.feed.blind(time.monotonic())
            fresh = await Replica(cfg("fresh")).start()
            cleanup.push_async_callback(fresh.stop)
            await until(lambda: stack.synced(fresh), timeout=20, what="fresh in sync")

            truth = stack.engine_blocks()
            assert sum(truth.values()) > 0
            for r in (a, b, fresh):
                assert index_blocks(r) == truth, r.state.replicas.id
            assert matches(a, prompts) == matches(b, prompts) == matches(fresh, prompts)
            counts = a.state.events.counts
            if reader == "python":
                assert counts["stream_new"] == (1 if store == "wiped" else 0)
            else:  # handed off once, at the start; the stream was never read again
                assert (counts["native_handoffs"], counts["stream_new"]) == (1, 0)
                assert a.state.feed.native_live
            # each agent showed the routers its newest batch again once back
            assert all(x.stats()["republished"] >= 1 for x in stack.agents)
    finally:
        await stack.stop()
        server.stop()


@pytest.mark.parametrize("reader", ["native", "python"])
async def test_stream_deleted_under_live_routers(nats_url: str, reader: str) -> None:
    """An operator deletes the stream while NATS stays up: the batches published
    meanwhile exist nowhere but in the agent. A router on nats-py notices the silence
    (no heartbeats), creates a new stream, reads it from its start and replays the rest;
    one on the native reader reads the live subjects and misses nothing."""
    stack = await MockStack(nats_url).start(1)
    prompts = [prompt(i) for i in range(8)]
    try:
        async with AsyncExitStack() as cleanup, httpx.AsyncClient(timeout=30) as http:
            a = await Replica(stack.router_config("a", events_reader=reader)).start()
            cleanup.push_async_callback(a.stop)
            for p in prompts[:4]:
                await send(http, a, p)
            await until(lambda: stack.synced(a), what="in sync")
            nc = await nats.connect(nats_url)
            await nc.jsm().delete_stream("KV_EVENTS")
            await nc.close()
            for p in prompts[4:]:
                await send(http, a, p)
            await until(lambda: stack.synced(a), timeout=15, what="in sync again")
            counts = a.state.events.counts
            if reader == "python":
                assert counts["stream_new"] == 1 and counts["stream_lost"] >= 1
                assert counts["replayed_batches"] >= 1  # what no stream held: the agent's
            else:
                assert a.state.feed.native_live and counts["native_applied"] >= 1
                assert counts["stream_lost"] == 0  # it stopped reading the stream
            assert index_blocks(a) == stack.engine_blocks()
    finally:
        await stack.stop()
