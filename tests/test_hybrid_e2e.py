"""A hybrid model end to end: mock engine (full + sliding window + Mamba groups) -> agent
-> NATS -> router. The router learns the groups from the events and never promises a
hit the engine does not deliver, where matching full attention alone would."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from stack import Served, engine_agent, until

from agent.node import NodeAgent
from index.groups import GroupSpec
from router.app import RouterApp
from router.config import RouterConfig, WorkerSpec
from router.events import last_seq
from sim.mock_engine import MockEngine, MockEngineConfig
from sim.mock_scheduler import Timing

AUTH = {"authorization": "Bearer t"}
BS = 16
MODEL = "mock-model"
SYSTEM = (
    "A hybrid model keeps a sliding-window group and a Mamba group beside full attention. " * 12
)


class Stack:
    def __init__(self, engine: MockEngine, agent: NodeAgent, app: RouterApp, served: Served):
        self.engine, self.agent, self.app, self.served = engine, agent, app, served

    def synced(self) -> bool:
        pub = self.engine.publisher
        assert pub is not None
        ingest = self.app.state.registry.pools["default"].ingest
        return pub.seq == 0 or (self.agent.core.last_seq == pub.seq - 1 == last_seq(ingest, "h0"))


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    cfg = MockEngineConfig(
        worker_id="h0",
        model=MODEL,
        block_size=BS,
        gpu_blocks=512,
        kv_groups="full,sliding_window:40,mamba",  # a hit needs 3 window blocks before it
        group_blocks=20,  # the extra groups turn over much faster than full attention
        max_num_batched_tokens=48,  # prompts run in chunks: Mamba states at chunk ends
        zmq_endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        timing=Timing(speed=200.0),
    )
    engine = await MockEngine(cfg).start()
    agent = await engine_agent(engine, nats_url)
    app = RouterApp(
        RouterConfig(
            nats_url=nats_url,
            block_size=BS,
            admin_token="t",
            health_interval=0.2,
            workers=[WorkerSpec("h0", engine.url, model=MODEL)],
        )
    )
    served = await Served(app).start()
    await until(lambda: app.state.bus.connected, what="router on NATS")
    yield Stack(engine, agent, app, served)
    await served.stop()
    await agent.stop()
    await engine.stop()


async def test_no_promised_hit_the_engine_does_not_deliver(stack: Stack) -> None:
    ingest = stack.app.state.registry.pools["default"].ingest
    index = stack.app.state.registry.pools["default"].index
    over = 0  # requests where full attention alone would have promised more
    hits = 0
    async with httpx.AsyncClient(base_url=stack.served.url, timeout=30) as http:
        for i in range(28):
            # four topics share the system prompt; each topic's requests extend its last
            topic = i % 4
            prompt = SYSTEM + f"topic {topic}. " + f"detail {topic} " * (10 + 20 * (i // 4))
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            explain = (await http.post("/admin/explain", headers=AUTH, json=body)).json()
            [row] = explain["workers"]
            raw, seen = row["match"]["total"], row["view"]["match"]["total"]
            resp = await http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            predicted = int(resp.headers["x-cache-router-hit-tokens"])
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert predicted == cached, (i, predicted, cached, raw * BS, seen * BS)
            cap = (resp.json()["usage"]["prompt_tokens"] - 1) // BS
            over += min(raw, cap) > seen
            hits += cached > 0
            await until(stack.synced, what="the engine's events applied")
    assert ingest.group_specs() == [
        GroupSpec("full"),
        GroupSpec("sliding_window", 40),
        GroupSpec("mamba"),
    ]
    assert {"h0", "h0:g1", "h0:g2"} <= set(index.workers)
    assert hits >= 10  # the rules still let real hits through
    assert over >= 5  # and the groups cut promises full attention alone would have made
