"""Admission in gateway mode: the region gateway's own queue in front of its clusters.

Two clusters, each a real router in front of one engine double (test_gateway.py's
in-process set-up), and the gateway in front of them with a fixed per-cluster limit
(``engine_max_inflight = 1``, no cluster queue): the clusters' routers report no engine
gauges, so a gateway learns no limit by itself and holds nothing without one. The
engines' ``gate`` events hold the answers, so "full" is a matter of requests in flight.
Nothing here asserts on time: what is held, where it goes, codes and counts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from stack import EngineDouble, Served, until

from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp

MODEL = "mock-model"
TOKEN = "gw-admin"


class Region:
    def __init__(self) -> None:
        self.engines: list[EngineDouble] = []
        self.clusters: list[Served] = []
        self.gateway: Served | None = None
        self.app: RouterApp | None = None

    @property
    def gate(self) -> Any:
        assert self.app is not None and self.app.state.gate is not None
        return self.app.state.gate

    def held(self) -> int:
        return int(self.gate.core.queued)


@contextlib.asynccontextmanager
async def region(**settings: Any) -> AsyncIterator[Region]:
    r = Region()
    try:
        for i in range(2):
            e = await EngineDouble(f"e{i}", model=MODEL).start()
            r.engines.append(e)
            cfg = RouterConfig(workers=[WorkerSpec(e.worker_id, e.url, model=MODEL)])
            r.clusters.append(await Served(RouterApp(cfg)).start())
        fields: dict[str, Any] = {
            "gateway": True, "policy": "session_affinity", "admin_token": TOKEN,
            "engine_max_inflight": 1, "engine_queue": 0,
            "workers": [WorkerSpec(f"c{i}", s.url, model=MODEL) for i, s in enumerate(r.clusters)],
        }  # fmt: skip
        r.app = RouterApp(RouterConfig(**(fields | settings)))
        r.gateway = await Served(r.app).start()
        yield r
    finally:
        if r.gateway is not None:
            await r.gateway.stop()
        for s in reversed(r.clusters):
            await s.stop()
        for e in r.engines:
            await e.stop()


async def ask(http: httpx.AsyncClient, session: str, text: str = "hello") -> httpx.Response:
    body = {"model": MODEL, "prompt": f"{session}: {text}", "max_tokens": 2}
    return await http.post("/v1/completions", json=body, headers={"x-session-id": session})


def inflight(r: Region) -> int:
    return sum(e.inflight for e in r.engines)


async def test_a_full_region_holds_at_the_gateway_and_releases_to_the_first_cluster_free() -> None:
    async with region() as r:
        assert r.gateway is not None
        async with httpx.AsyncClient(base_url=r.gateway.url, timeout=20) as http:
            for e in r.engines:
                e.gate = asyncio.Event()
            first = [asyncio.create_task(ask(http, f"s{i}")) for i in range(2)]
            await until(lambda: inflight(r) == 2, what="one request in each cluster")
            # late binding: the second went to the cluster with room, whatever its session
            assert [e.inflight for e in r.engines] == [1, 1]
            third = asyncio.create_task(ask(http, "s9"))
            await until(lambda: r.held() == 1, what="the third held at the gateway")
            assert inflight(r) == 2  # neither cluster saw it
            r.engines[1].gate.set()
            answer = await third
            assert answer.status_code == 200
            assert answer.headers["x-cache-router-cluster"] == "c1"
            r.engines[0].gate.set()
            assert [(await t).status_code for t in first] == [200, 200]
            metrics = (await http.get("/metrics")).text
            explained = (
                await http.post(
                    "/admin/explain",
                    json={"model": MODEL, "prompt": "x"},
                    headers={"authorization": f"Bearer {TOKEN}"},
                )
            ).json()
    series = r.gate.core.stats.series[("none", "0")]
    assert (series.queued, series.admitted) == (1, 3)
    assert r.gate.via == {("gateway", "admitted"): 3}
    assert 'cache_router_admission_queued_total{priority="0",tenant="none"} 1.0' in metrics
    assert sorted(explained["admission"]["workers"]) == ["c0", "c1"]
    assert explained["admission"]["workers"]["c0"]["limit"] == 1
    assert r.gate.core.queued == 0 and not r.gate._reserved


async def test_the_gateway_sheds_and_forgets_a_client_that_leaves() -> None:
    async with region(queue_size=1) as r:
        assert r.gateway is not None
        async with httpx.AsyncClient(base_url=r.gateway.url, timeout=20) as http:
            for e in r.engines:
                e.gate = asyncio.Event()
            first = [asyncio.create_task(ask(http, f"s{i}")) for i in range(2)]
            await until(lambda: inflight(r) == 2, what="both clusters full")
            leaving = asyncio.create_task(ask(http, "leaving"))
            await until(lambda: r.held() == 1, what="one held")
            full = await ask(http, "full")
            assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
            assert full.json()["error"]["code"] == "queue_full"
            leaving.cancel()
            await until(lambda: r.held() == 0, what="it left the queue")
            for e in r.engines:
                e.gate.set()
            assert [(await t).status_code for t in first] == [200, 200]
    prompts = [req["body"]["prompt"] for e in r.engines for req in e.requests]
    assert not any(p.startswith(("full", "leaving")) for p in prompts)
    series = r.gate.core.stats.series[("none", "0")]
    assert series.shed == {"queue_full": 1} and series.left == 1
    assert r.gate.core.queued == 0 and not r.gate._reserved


async def test_without_a_limit_the_gateway_holds_nothing() -> None:
    """The clusters' routers report no engine gauges: nothing is learnt, nothing held
    (each cluster's router holds and sheds for its own engines)."""
    async with region(engine_max_inflight=None) as r:
        assert r.gateway is not None
        async with httpx.AsyncClient(base_url=r.gateway.url, timeout=20) as http:
            answers = await asyncio.gather(*(ask(http, f"s{i}") for i in range(12)))
    assert all(a.status_code == 200 for a in answers)
    assert r.gate.core.capacity.limit("c0") is None
    series = r.gate.core.stats.series[("none", "0")]
    assert (series.queued, series.admitted) == (0, 12)


async def test_a_held_session_waits_for_its_home_cluster() -> None:
    """A session's cache is on its home cluster: with the home full and the other cluster
    free, its next request waits for the home (freeing at a known pace) rather than
    recompute its conversation elsewhere, as a prompt waits for its prefix holder."""
    async with region(queue_timeout=30) as r:
        assert r.gateway is not None
        async with httpx.AsyncClient(base_url=r.gateway.url, timeout=40) as http:
            homes = [(await ask(http, "chat", f"turn {i}")).headers for i in range(3)]
            home = homes[0]["x-cache-router-cluster"]
            assert all(h["x-cache-router-cluster"] == home for h in homes)
            assert r.gate.core.capacity.free_in(home) < 1.0  # three ends: a pace
            engine = r.engines[int(home[1:])]
            engine.gate = asyncio.Event()
            busy = asyncio.create_task(ask(http, "chat", "turn 3"))
            await until(lambda: engine.inflight == 1, what="the home cluster full")
            nxt = asyncio.create_task(ask(http, "chat", "turn 4"))
            await until(lambda: r.held() == 1, what="the next turn held for its home")
            assert inflight(r) == 1  # the other cluster, idle, did not get it
            engine.gate.set()
            answers = [await busy, await nxt]
    assert [a.headers["x-cache-router-cluster"] for a in answers] == [home, home]
    assert r.gate.core.queued == 0 and not r.gate._reserved
