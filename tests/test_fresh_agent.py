"""A router beside a fresh node agent never says "in sync" on a past state (issue 35).

Behind real vLLM, a router started with fresh agents beside engines that had served for
minutes reported ``events_up_to_date`` and ``in_sync`` while holding 73-114 blocks the
engines no longer had: the agents republished the engines' histories batch by batch,
and each batch applied alone looked like a worker in step. Real parts: nats-server with
JetStream, a mock engine publishing over ZMQ, a node agent, the router serving HTTP.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from stack import SYSTEM, Replica, mock_engine_config, until

from agent.node import AgentConfig, NodeAgent
from router.config import RouterConfig, WorkerSpec
from router.events.consumer import last_seq
from sim.mock.engine import MockEngine
from sim.mock.natsd import free_ports
from sim.mock.publisher import wire_hash

W = "fresh-0"


def router_config(nats_url: str, engine_url: str) -> RouterConfig:
    return RouterConfig(
        nats_url=nats_url,
        block_size=16,
        admin_token="t",
        health_interval=0.5,
        workers=[WorkerSpec(W, engine_url, model="mock-model")],
    )


def agent_config(nats_url: str, engine: MockEngine) -> AgentConfig:
    return AgentConfig(
        worker_id=W,
        zmq_endpoint=engine.cfg.zmq_endpoint or "",
        replay_endpoint=engine.cfg.replay_endpoint,
        engine_url=engine.url,
        nats_url=nats_url,
        replay_timeout=0.5,
        load_interval=0,
    )


def engine_held(engine: MockEngine) -> set[object]:
    cache = engine.cache
    return {wire_hash(h, engine.cfg.encoding) for h in cache.gpu_hashes() | cache.host_hashes()}


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    port, zmq_port, replay_port = free_ports(3)
    cfg = mock_engine_config(
        W,
        port=port,
        gpu_blocks=24,  # small: the history stores and evicts
        zmq_endpoint=f"tcp://127.0.0.1:{zmq_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
    )
    engine = MockEngine(cfg)
    yield engine
    await engine.stop()


async def history(engine: MockEngine, n: int) -> int:
    """``n`` completions straight to the engine (nobody listening); its last seq."""
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as http:
        for i in range(n):
            text = f"{SYSTEM} topic {i % 7}: " + f"note {i} " * 16  # 2-3 blocks of their own
            body = {"model": "mock-model", "prompt": text, "max_tokens": 2}
            (await http.post("/v1/completions", json=body)).raise_for_status()
    assert engine.publisher is not None
    return engine.publisher.seq - 1


async def test_a_router_never_says_in_sync_on_a_past_state(
    nats_url: str, engine: MockEngine
) -> None:
    """The issue's reproduction: the engine served traffic, then the router and a fresh
    agent start. Every moment the router says the worker is in sync and holds blocks,
    they are the engine's blocks."""
    await engine.start()
    head = await history(engine, 120)
    assert head >= 100
    held = engine_held(engine)
    replica = await Replica(router_config(nats_url, engine.url)).start()
    try:
        pool = replica.pool()
        wrong: list[tuple[int | None, int]] = []  # (the router's last seq, blocks) if wrong
        agent = await NodeAgent(agent_config(nats_url, engine)).start()
        try:
            deadline = time.monotonic() + 15
            while True:
                ok = replica.state.in_sync(W, pool)
                blocks = set(pool.ingest.engine_blocks(W))
                if ok and blocks and blocks != held:
                    wrong.append((last_seq(pool.ingest, W), len(blocks)))
                if ok and blocks == held and last_seq(pool.ingest, W) == head:
                    break
                assert time.monotonic() < deadline, "the router never caught up"
                await asyncio.sleep(0)
        finally:
            await agent.stop()
    finally:
        await replica.stop()
    assert wrong == []


async def test_an_agent_before_its_engine_keeps_the_worker_out_of_sync(
    nats_url: str, engine: MockEngine
) -> None:
    """An agent that has not read its engine (not up yet) has nothing to vouch for: the
    router asks again until it has, and says "in sync" only then."""
    agent = await NodeAgent(agent_config(nats_url, engine)).start()
    replica = await Replica(router_config(nats_url, engine.url)).start()
    try:
        events, pool = replica.state.events, replica.pool()
        await until(
            lambda: events.counts["resynced"] or events.counts["replay_requests"] >= 2,
            what="the router's first answers",
        )
        assert not replica.state.in_sync(W, pool)
        assert agent.stats()["replays_while_reading"] >= 1
        await engine.start()
        head = await history(engine, 6)
        await until(
            lambda: replica.state.in_sync(W, pool) and last_seq(pool.ingest, W) == head,
            timeout=15,
            what="the router in sync once the agent read the engine",
        )
        assert set(pool.ingest.engine_blocks(W)) == engine_held(engine)
    finally:
        await replica.stop()
        await agent.stop()
