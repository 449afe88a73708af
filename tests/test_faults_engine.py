"""An engine killed (SIGKILL) in the middle of a stream, then started again.

The engines are ``cache-router mock-engine`` processes on fixed ports, each with its
node agent (in-process) publishing its KV events on a real NATS; the router runs
in-process. What is asserted: what the client saw (an OpenAI error event, then the end
of the stream; never a hang), what the router did (the worker down, its blocks out of
the index, traffic elsewhere) and what happened on return (healthy again, the index in
step with the new engine, requests reaching it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx
import orjson
import pytest
from stack import Served, until

from agent.node import AgentConfig, NodeAgent
from router.config import RouterConfig, WorkerSpec
from router.events.consumer import last_seq
from router.http.app import RouterApp
from sim.demo import wait_healthy
from sim.mock.natsd import free_ports

MODEL = "mock-model"
BS = 16
AUTH = {"authorization": "Bearer t"}
PROMPT = "The engines of this test hold this system prompt in their cache. " * 4
LONGER = PROMPT + "go on " * 10  # 4 more full blocks (byte tokens) than PROMPT


class EngineProcess:
    """A mock engine process that can be killed and started again on the same ports."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.port, self.zmq, self.replay = free_ports(3)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "mock-engine", "--port", str(self.port),
             "--worker-id", self.worker_id, "--model", MODEL, "--block-size", str(BS),
             "--gpu-blocks", "256", "--speed", "20",
             "--zmq-endpoint", f"tcp://127.0.0.1:{self.zmq}",
             "--replay-endpoint", f"tcp://127.0.0.1:{self.replay}", "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    async def ready(self) -> None:
        assert self.proc is not None
        await wait_healthy(self.url, self.proc)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Stack:
    def __init__(self, engines: list[EngineProcess], agents: list[NodeAgent], app: RouterApp):
        self.engines = engines
        self.agents = agents
        self.app = app
        self.pool = app.state.registry.pools["default"]

    def synced(self) -> bool:
        """The router applied every batch each agent published."""
        return all(
            last_seq(self.pool.ingest, a.cfg.worker_id) == a.core.last_seq
            for a in self.agents
            if a.core.last_seq is not None and a.core.last_seq >= 0
        )

    def blocks(self, worker_id: str) -> int:
        return sum(self.pool.index.stats().workers.get(worker_id, {}).values())


@contextlib.asynccontextmanager
async def engines_behind_router(
    nats_url: str, engines: list[EngineProcess], **settings: Any
) -> AsyncIterator[tuple[list[NodeAgent], RouterApp, str]]:
    """Each engine started with its node agent, then a router on NATS in front of them
    (``settings``: the router's beyond the workers, NATS and the admin token); the agents,
    the router and its url. Everything stopped after, the engines last."""
    agents: list[NodeAgent] = []
    served = None
    try:
        for e in engines:
            e.start()
        for e in engines:
            await e.ready()
            cfg = AgentConfig(
                worker_id=e.worker_id,
                zmq_endpoint=f"tcp://127.0.0.1:{e.zmq}",
                replay_endpoint=f"tcp://127.0.0.1:{e.replay}",
                engine_url=e.url,
                nats_url=nats_url,
                load_interval=0.1,
                replay_timeout=0.5,
            )
            agents.append(await NodeAgent(cfg).start())
        router_cfg = RouterConfig(
            nats_url=nats_url,
            admin_token="t",
            workers=[WorkerSpec(e.worker_id, e.url, model=MODEL) for e in engines],
            **settings,
        )
        app = RouterApp(router_cfg)
        served = await Served(app).start()
        await until(lambda: app.state.bus.connected, what="router on NATS")
        yield agents, app, served.url
    finally:
        if served is not None:
            await served.stop()
        for a in agents:
            await a.stop()
        for e in engines:
            e.stop()


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[tuple[Stack, str]]:
    engines = [EngineProcess(f"e{i}") for i in range(2)]
    settings = {"block_size": BS, "health_interval": 0.2, "request_timeout": 10.0}
    async with engines_behind_router(nats_url, engines, **settings) as (agents, app, url):
        yield Stack(engines, agents, app), url


async def explain(http: httpx.AsyncClient, prompt: str) -> dict[str, dict]:
    r = await http.post("/admin/explain", json={"model": MODEL, "prompt": prompt}, headers=AUTH)
    return {w["worker_id"]: w for w in r.json()["workers"]}


async def test_engine_killed_mid_stream(stack):
    s, url = stack
    registry = s.app.state.registry
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT})
        assert r.status_code == 200
        holder = r.headers["x-cache-router-worker"]
        other = next(e.worker_id for e in s.engines if e.worker_id != holder)
        victim = next(e for e in s.engines if e.worker_id == holder)
        await until(s.synced, what="events in")
        assert s.blocks(holder) > 0

        # the same prefix goes to the holder; it dies after the first token
        body = {"model": MODEL, "prompt": LONGER, "max_tokens": 2000, "stream": True}
        body["ignore_eos"] = True  # a long answer: the kill lands mid-stream
        # logprobs: a stream that cannot move to the other engine (router.forward.migrate;
        # tests/test_migration.py has those that do), so it ends as before
        body["logprobs"] = 1
        events: list[bytes] = []
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["x-cache-router-worker"] == holder
            async for line in resp.aiter_lines():  # the client's read timeout bounds this
                if line.startswith("data: "):
                    events.append(line[6:].encode())
                    if len(events) == 1:
                        victim.kill()
        # a clean end: tokens, then one OpenAI error event, then nothing (no [DONE])
        assert len(events) >= 2 and b"[DONE]" not in events
        error = orjson.loads(events[-1])["error"]
        assert error["code"] == "upstream_broken" and error["message"]
        assert all(b"error" not in e for e in events[:-1])

        # the worker is down at once (probed after the failure), its blocks are gone
        await until(lambda: not registry.get(holder).healthy, what="holder down")
        assert s.blocks(holder) == 0
        assert (await explain(http, PROMPT))[holder]["usable"] is False
        # clients go on being served by the other engine, and see no error
        for i in range(3):
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT + str(i)})
            assert r.status_code == 200 and r.headers["x-cache-router-worker"] == other
        text = (await http.get("/metrics")).text
        assert f'kind="upstream_broken",worker="{holder}"' in text

        # it comes back (an empty engine, same ports): healthy again, resynced, used
        replays = s.app.state.events.counts["replay_requests"]
        victim.start()
        await victim.ready()
        await until(lambda: registry.get(holder).healthy, timeout=10, what="holder back")
        await until(
            lambda: s.app.state.events.counts["replay_requests"] > replays, what="resync asked"
        )
        r = await http.post(f"/admin/workers/{other}/drain", headers=AUTH)  # only it is left
        assert r.status_code == 200
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT})
        assert r.status_code == 200 and r.headers["x-cache-router-worker"] == holder
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a new cache
        await until(s.synced, what="the new engine's events in")

        # the index holds the new engine's blocks, none of the dead one's (a resync that
        # raced the agent's restart detection is undone by the new life's first batch)
        async def longer_match() -> int:
            return (await explain(http, LONGER))[holder]["match"]["total"]

        short = len(PROMPT) // BS  # the new engine has PROMPT's blocks only
        await until(lambda: _at_most(longer_match(), short), what="no stale blocks")
        held = (await explain(http, PROMPT))[holder]
        assert held["usable"] and held["in_sync"] and held["match"]["total"] > 0
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT + "again"})
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == held["match"]["total"] * BS  # the index tells the engine's truth


async def _at_most(value: Awaitable[int], bound: int) -> bool:
    return await value <= bound


async def test_engine_dead_before_the_request_is_a_clean_status(stack):
    s, url = stack
    for e in s.engines:
        e.kill()
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "anyone?"})
        # both refused the connection (502 after the retry) or were already seen down (503)
        assert r.status_code in (502, 503)
        assert r.json()["error"]["code"] in ("upstream_unreachable", "no_healthy_worker")
        registry = s.app.state.registry
        await until(lambda: not any(w.healthy for w in registry), what="all down")
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "anyone?"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
        assert (await http.get("/health")).status_code == 503
    assert os.environ  # nothing else to clean: the fixture stops the rest


async def test_engine_killed_during_a_plain_request_is_a_502(stack):
    s, url = stack
    victim, spare = s.engines
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.post(f"/admin/workers/{spare.worker_id}/drain", headers=AUTH)
        assert r.status_code == 200
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
        pending = asyncio.create_task(http.post("/v1/completions", json=body))

        async def running() -> bool:
            text = (await http.get(victim.url + "/metrics")).text
            return "vllm:num_requests_running" in text and any(
                line.startswith("vllm:num_requests_running") and not line.endswith(" 0.0")
                for line in text.splitlines()
            )

        await until(running, what="the request running in the engine")
        victim.kill()
        r = await asyncio.wait_for(pending, 30)
        # sent again elsewhere if any engine could take it (tests/test_migration.py); the
        # spare is drained, so none can: the clean 502 of a request that cannot move
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
        assert "x-cache-router-worker" not in r.headers
    await until(lambda: not s.app.state.registry.get(victim.worker_id).healthy, what="down")
