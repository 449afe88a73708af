"""The region gateway: the router in gateway mode in front of two cluster routers.

Each cluster is a real router on a loopback port in front of its own engines; the
gateway is ``cache-router serve --gateway`` (a subprocess, the command the compose
``region`` profile runs) or, where the test must hold requests in flight, the same app
in-process. Clients see which cluster served them in ``x-cache-router-cluster`` and
which engine in ``x-cache-router-worker`` (set by the cluster's router).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from stack import EngineDouble, Served, until

from router.config import ConfigError, RouterConfig, WorkerSpec, load_config
from router.http.app import RouterApp
from sim.demo import wait_healthy
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.natsd import free_port
from sim.mock.scheduler import Timing

MODEL = "mock-model"
TOKEN = "gw-admin"
ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


class Cluster:
    """One cluster: a router in front of two mock engines, restartable on its ports."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.engine_ports = [free_port(), free_port()]
        self.engines: list[MockEngine] = []
        self.served: Served | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start_engines(self) -> None:
        for i, port in enumerate(self.engine_ports):
            cfg = MockEngineConfig(
                port=port, worker_id=f"{self.name}-e{i}", model=MODEL, timing=Timing(speed=500.0)
            )
            self.engines.append(await MockEngine(cfg).start())

    async def stop_engines(self) -> None:
        for e in self.engines:
            await e.stop()
        self.engines = []

    async def start_router(self) -> None:
        cfg = RouterConfig(
            port=self.port,
            health_interval=0.2,
            unhealthy_after=1,
            workers=[
                WorkerSpec(f"{self.name}-e{i}", f"http://127.0.0.1:{p}", model=MODEL)
                for i, p in enumerate(self.engine_ports)
            ],
        )
        self.served = await Served(RouterApp(cfg), port=self.port).start()

    async def stop_router(self) -> None:
        if self.served is not None:
            await self.served.stop()
            self.served = None


@pytest.fixture
async def clusters() -> AsyncIterator[list[Cluster]]:
    made = [Cluster("a"), Cluster("b")]
    for c in made:
        await c.start_engines()
        await c.start_router()
    yield made
    for c in made:
        await c.stop_router()
        await c.stop_engines()


async def start_gateway_process(clusters: list[Cluster]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "router.cli", "serve", "--gateway", "--port", str(port),
           "--admin-token", TOKEN, "--log-level", "warning"]  # fmt: skip
    cmd += [f"--worker=cluster-{c.name}={c.url}" for c in clusters]
    env = {**os.environ, "CACHE_ROUTER_HEALTH_INTERVAL": "0.2"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    await wait_healthy(url, proc)
    return proc, url


async def ask(http: httpx.AsyncClient, session: str, text: str = "hello") -> tuple[str, str]:
    body = {"model": MODEL, "prompt": f"{session}: {text}", "max_tokens": 2}
    r = await http.post("/v1/completions", json=body, headers={"x-session-id": session})
    assert r.status_code == 200, r.text
    return r.headers["x-cache-router-cluster"], r.headers["x-cache-router-worker"]


async def homes(http: httpx.AsyncClient, sessions: list[str]) -> dict[str, str]:
    return {s: (await ask(http, s))[0] for s in sessions}


async def cluster_states(http: httpx.AsyncClient) -> dict[str, bool]:
    r = await http.get("/admin/workers", headers={"authorization": f"Bearer {TOKEN}"})
    return {w["id"]: w["healthy"] for w in r.json()["workers"]}


async def test_sessions_stick_and_a_failed_cluster_moves_only_its_sessions(clusters):
    a, b = clusters
    proc, url = await start_gateway_process(clusters)
    sessions = [f"user-{i}" for i in range(16)]
    try:
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            home = await homes(http, sessions)
            assert set(home.values()) == {"cluster-a", "cluster-b"}  # both clusters used
            assert await homes(http, sessions) == home  # and every session stays put
            r = await http.post(
                "/admin/explain",
                json={"model": MODEL, "prompt": "x " * 500},
                headers={"authorization": f"Bearer {TOKEN}"},
            )
            assert r.json()["blocks"] == 0 and r.json()["policy"] == "session_affinity"
            on_a = [s for s in sessions if home[s] == "cluster-a"]

            # 1. cluster a loses its engines: its router answers 503 (and says so on
            # /health); the gateway retries those sessions on b, the client sees 200
            await a.stop_engines()
            moved = await homes(http, sessions)
            assert all(moved[s] == "cluster-b" for s in sessions)
            await until(lambda: _down(http, "cluster-a"), timeout=10, what="a marked down")
            await a.start_engines()
            await until(lambda: _up(http, "cluster-a"), timeout=10, what="a back")
            assert await homes(http, sessions) == home  # consistent hashing: they go home

            # 2. cluster a's router itself dies (connection refused): only its sessions move
            await a.stop_router()
            moved = await homes(http, sessions)
            assert {s for s in sessions if moved[s] != home[s]} == set(on_a)
            await until(lambda: _down(http, "cluster-a"), timeout=10, what="a marked down")
            await a.start_router()
            await until(lambda: _up(http, "cluster-a"), timeout=10, what="a back")
            assert await homes(http, sessions) == home
        assert b.served is not None
    finally:
        proc.terminate()
        proc.wait(10)


async def _down(http: httpx.AsyncClient, cluster: str) -> bool:
    return not (await cluster_states(http))[cluster]


async def _up(http: httpx.AsyncClient, cluster: str) -> bool:
    return (await cluster_states(http))[cluster]


async def test_a_hot_session_spills_over_to_the_other_cluster():
    """Bounded load: with L requests in flight over 2 clusters, one takes at most
    ceil(1.25 (L + 1) / 2); the hot session's excess goes to the next cluster on the ring."""
    engines = [await EngineDouble(f"e{i}", model=MODEL).start() for i in range(2)]
    running: list[Any] = []
    try:
        for e in engines:
            cfg = RouterConfig(workers=[WorkerSpec(e.worker_id, e.url, model=MODEL)])
            running.append(await Served(RouterApp(cfg)).start())
        gw_cfg = RouterConfig(
            gateway=True,
            policy="session_affinity",
            workers=[WorkerSpec(f"c{i}", s.url, model=MODEL) for i, s in enumerate(running)],
        )
        gateway = await Served(RouterApp(gw_cfg)).start()
        running.append(gateway)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as http:
            home, _ = await ask(http, "hot")
            other = "c1" if home == "c0" else "c0"
            for e in engines:
                e.gate = asyncio.Event()  # hold every request inside the engines
            burst = [asyncio.create_task(ask(http, "hot", f"q{i}")) for i in range(6)]
            await until(lambda: sum(e.inflight for e in engines) == 6, what="burst in flight")
            by_cluster = {f"c{i}": e.inflight for i, e in enumerate(engines)}
            for e in engines:
                e.gate.set()
            served = [cluster for cluster, _ in await asyncio.gather(*burst)]
            for e in engines:
                e.gate = None
            # caps 2, 2, 2, 3, 4, 4 for the 1st..6th: home takes 1, 2, -, 3, 4, -
            assert by_cluster == {home: 4, other: 2}
            assert served.count(home) == 4 and served.count(other) == 2
            # the spike over, the session is home again
            assert [(await ask(http, "hot"))[0] for _ in range(3)] == [home] * 3
    finally:
        for s in reversed(running):
            await s.stop()
        for e in engines:
            await e.stop()


def test_gateway_config_rejects_what_it_cannot_do():
    with pytest.raises(ConfigError, match="gateway mode does not tokenize"):
        load_config(env={}, overrides={"gateway": True, "policy": "cache_aware"})
    with pytest.raises(ConfigError, match="no nats_url"):
        load_config(
            env={},
            overrides={"gateway": True, "policy": "session_affinity", "nats_url": "nats://x:1"},
        )
    cfg = load_config(env={"CACHE_ROUTER_GATEWAY": "true", "CACHE_ROUTER_POLICY": "least_load"})
    assert cfg.gateway and cfg.policy == "least_load"


def test_region_profile_is_a_gateway_over_two_clusters_of_two_replicas():
    """The compose ``region`` profile wires what the tests above run (its commands are
    parsed by the real CLI in test_compose.py)."""
    services = COMPOSE["services"]
    region = {n: s for n, s in services.items() if "region" in s.get("profiles", [])}
    gateways = [s for s in region.values() if "--gateway" in s["command"]]
    assert len(gateways) == 1
    clusters = [a.split("=", 2)[2] for a in gateways[0]["command"] if a.startswith("--worker=")]
    assert len(clusters) == 2
    agents = {
        _flag(s["command"], "--worker-id"): _flag(s["command"], "--subject-prefix")
        for s in region.values()
        if s["command"][0] == "agent"
    }
    for cluster in clusters:
        # a cluster URL is the DNS alias shared by its two router replicas
        alias = cluster.removeprefix("http://").split(":")[0]
        replicas = [
            s
            for s in region.values()
            if alias in s.get("networks", {}).get("default", {}).get("aliases", [])
        ]
        assert len(replicas) == 2 and all(r["command"][0] == "serve" for r in replicas)
        prefix = _flag(replicas[0]["command"], "--subject-prefix")
        engines = {a.split("=")[1] for a in replicas[0]["command"] if a.startswith("--worker=")}
        assert len(engines) == 2 and engines <= set(region)
        for r in replicas:  # same engines, same NATS subjects
            assert _flag(r["command"], "--subject-prefix") == prefix
        assert all(agents[e] == prefix for e in engines)  # every engine has its agent


def _flag(command: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in command if a.startswith(name + "=")), None)
