"""Router replicas over a real stack, for the replica and NATS-fault tests (not a test module).

Mock engines publish KV events over ZMQ to node agents (which create the event stream);
each router replica serves HTTP in-process on a loopback port.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx
from router_double import Served, until

from agent.node import AgentConfig, NodeAgent
from router.app import RouterApp
from router.config import RouterConfig, WorkerSpec
from router.events import last_seq
from sim.mock_engine import MockEngine, MockEngineConfig
from sim.mock_scheduler import Timing

BS = 16
MODEL = "mock-model"
SYSTEM = "You are the assistant of a replicated cache-aware router; answer briefly. " * 3


class Replica:
    """One router process: the app and its HTTP server on a loopback port."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.app = RouterApp(cfg)
        self.served: Served | None = None

    @property
    def state(self) -> Any:
        return self.app.state

    @property
    def url(self) -> str:
        assert self.served is not None
        return self.served.url

    def pool(self) -> Any:
        return self.state.registry.pools["default"]

    def load(self, worker_id: str) -> Any:
        return self.state.registry.get(worker_id).load

    async def start(self) -> Replica:
        self.served = await Served(self.app).start()
        feed = self.state.feed
        await until(lambda: self.state.bus.connected and feed.using, what="replica on NATS")
        return self

    async def stop(self) -> None:
        if self.served is not None:
            await self.served.stop()
            self.served = None


class MockStack:
    """Mock engines (small GPU caches, so they evict) behind node agents."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.engines: list[MockEngine] = []
        self.agents: list[NodeAgent] = []

    async def start(self, n: int, buffer: int = 10_000, load_interval: float = 0) -> MockStack:
        for i in range(n):
            cfg = MockEngineConfig(
                worker_id=f"m{i}",
                model=MODEL,
                block_size=BS,
                gpu_blocks=32,
                zmq_endpoint="tcp://127.0.0.1:*",
                replay_endpoint="tcp://127.0.0.1:*",
                timing=Timing(speed=200.0),
            )
            engine = await MockEngine(cfg).start()
            self.engines.append(engine)
            agent = NodeAgent(
                AgentConfig(
                    worker_id=cfg.worker_id,
                    zmq_endpoint=engine.zmq_endpoint or "",
                    replay_endpoint=engine.replay_endpoint,
                    engine_url=engine.url,
                    nats_url=self.nats_url,
                    load_interval=load_interval,
                    replay_timeout=0.5,
                    buffer=buffer,
                )
            )
            self.agents.append(await agent.start())
        return self

    async def stop(self) -> None:
        for a in self.agents:
            await a.stop()
        for e in self.engines:
            await e.stop()

    def router_config(self, replica_id: str, **kw: Any) -> RouterConfig:
        return RouterConfig(
            nats_url=self.nats_url,
            block_size=BS,
            admin_token="t",
            health_interval=0.5,
            replica_id=replica_id,
            workers=[WorkerSpec(e.cfg.worker_id, e.url, model=MODEL) for e in self.engines],
            **kw,
        )

    def synced(self, replica: Replica) -> bool:
        """The replica applied every batch each agent has published."""
        ingest = replica.pool().ingest
        return all(
            last_seq(ingest, a.cfg.worker_id) == a.core.last_seq and ingest.in_sync(a.cfg.worker_id)
            for a in self.agents
            if a.core.last_seq is not None
        )

    def engine_blocks(self) -> dict[str, int]:
        return {e.cfg.worker_id: len(e.cache.gpu_hashes()) for e in self.engines}


def prompt(i: int) -> str:
    return f"{SYSTEM} topic {i % 4}: " + f"note {i} " * (20 + 3 * i)


def matches(replica: Replica, prompts: Iterable[str]) -> list[dict[str, int]]:
    """What the replica's index holds for each prompt (events only, no predictions)."""
    st = replica.state
    pool = replica.pool()
    tok = st.tokenizers.get(MODEL)
    return [
        pool.index.match(pool.hasher.hash_tokens(tok.encode(p, True)), speculative=False)
        for p in prompts
    ]


def index_blocks(replica: Replica) -> dict[str, int]:
    return {w: t["gpu"] for w, t in replica.pool().index.stats().workers.items()}


async def send(http: httpx.AsyncClient, replica: Replica, text: str) -> str:
    body = {"model": MODEL, "prompt": text, "max_tokens": 4}
    r = await http.post(replica.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.headers["x-cache-router-worker"]
