"""Admission in front of a disaggregated pool (router/pd/ + router/admission/gate.py).

Mock prefill engines p0, p1 and a decode engine d0 in either wire protocol, the router in
front, real HTTP. Each engine's completions go through ``Held``, which can hold them
before the engine sees them (its KV transfer endpoints are never held), so "full" is a
matter of requests in flight; a fixed engine limit (``engine_max_inflight = 1``, no
engine queue) makes a prefill engine full with one prefill on it. Nothing here asserts
on time: what is held, where it goes, codes and counts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import orjson
import pytest
from stack import ADMIN_TOKEN, BS, MODEL, EngineStack, mock_engine_config, read_body, until

from router.config import RouterConfig, WorkerSpec
from sim.mock.engine import MockEngine
from sim.mock.scheduler import Timing

Scope = MutableMapping[str, Any]
FULL = {"engine_max_inflight": 1, "engine_queue": 0}


class Held:
    """ASGI wrapper of an engine: its ``/v1/`` requests (prompts kept in ``seen``) wait
    while ``hold`` is set, until it is cleared."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[str] = []
        self.waiting = 0
        self.open = asyncio.Event()
        self.open.set()

    def hold(self) -> None:
        self.open.clear()

    def release(self) -> None:
        self.open.set()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        body, replay = await read_body(receive)
        self.seen.append(str(orjson.loads(body).get("prompt")) if body else "")
        self.waiting += 1
        try:
            await self.open.wait()
        finally:
            self.waiting -= 1
        await self.app(scope, replay, send)


class PdStack(EngineStack):
    held: dict[str, Held]


@contextlib.asynccontextmanager
async def pd_stack(protocol: str, **settings: Any) -> AsyncIterator[PdStack]:
    s = PdStack()
    s.held = {}
    specs = []
    try:
        for wid in ("p0", "p1", "d0"):
            role = "prefill" if wid.startswith("p") else "decode"
            cfg = mock_engine_config(wid, role=role, gpu_blocks=256, timing=Timing(speed=50.0))
            engine = MockEngine(cfg)
            s.held[wid] = engine.app = Held(engine.app)
            s.engines[wid] = await engine.start()
            specs.append(
                WorkerSpec(wid, engine.url, model=MODEL, role=role, bootstrap_port=engine.port)
            )
        fields: dict[str, Any] = {
            "block_size": BS, "admin_token": ADMIN_TOKEN, "health_interval": 30.0,
            "pd_protocol": protocol, "workers": specs, **FULL,
        }  # fmt: skip
        await s.serve(RouterConfig(**(fields | settings)))
        yield s
    finally:
        await s.stop()


def gate(s: PdStack) -> Any:
    assert s.state.gate is not None
    return s.state.gate


def queued(s: PdStack) -> int:
    return int(gate(s).core.queued)


async def complete(http: httpx.AsyncClient, prompt: str, **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "prompt": f"{prompt}: " + "disaggregated admission " * 8,
               "max_tokens": 4, **body}  # fmt: skip
    return await http.post("/v1/completions", json=payload)


def prompts(s: PdStack, wid: str) -> list[str]:
    return [p.partition(":")[0] for p in s.held[wid].seen]


async def both_prefills_busy(s: PdStack, http: httpx.AsyncClient) -> list[asyncio.Task[Any]]:
    """Two requests whose prefills wait on p0 and p1: every prefill engine full."""
    s.held["p0"].hold()
    s.held["p1"].hold()
    tasks = [asyncio.create_task(complete(http, name)) for name in ("one", "two")]
    await until(
        lambda: s.held["p0"].waiting == 1 and s.held["p1"].waiting == 1, what="both prefilling"
    )
    return tasks


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_held_before_its_prefill_and_released_when_a_prefill_slot_frees(
    protocol: str,
) -> None:
    async with (
        pd_stack(protocol) as s,
        httpx.AsyncClient(base_url=s.url, timeout=30) as http,
    ):
        if protocol == "vllm":  # decodes wait too: the slot is the prefill's, not theirs
            s.held["d0"].hold()
        first = await both_prefills_busy(s, http)
        third = asyncio.create_task(complete(http, "three"))
        await until(lambda: queued(s) == 1, what="the third held at the router")
        assert "three" not in prompts(s, "p0") + prompts(s, "p1") + prompts(s, "d0")
        (ticket,) = gate(s).core._held.values()
        assert sorted(ticket.candidates) == ["p0", "p1"]  # the prefill side is the one held
        holder = "p1" if prompts(s, "p1") == ["two"] else "p0"
        s.held[holder].release()
        # its prefill ended (the decode may go on): the third takes the slot
        await until(lambda: "three" in prompts(s, holder), what="the third's prefill sent")
        assert queued(s) == 0
        if protocol == "vllm":  # d0 is held, so two's decode cannot have ended: it reaches
            # d0 (after its prefill leg, maybe after three's prefill was sent) and waits there
            await until(lambda: s.held["d0"].waiting >= 1, what="two's decode held on d0")
        # admission counts two in flight (one and three prefilling): two's slot was freed
        # when its prefill leg ended, its decode going on or not
        assert gate(s).core._flying[""] == 2
        other = "p0" if holder == "p1" else "p1"
        assert "three" not in prompts(s, other)
        for h in s.held.values():
            h.release()
        answers = [await t for t in [*first, third]]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert all(a.headers["x-cache-router-worker"] == "d0" for a in answers)
    g = gate(s)
    assert g.via[("pd", "admitted")] == 3
    series = g.core.stats.series[("none", "0")]
    assert (series.queued, series.admitted) == (1, 3)
    assert g.core.queued == 0 and not g._reserved
    for wid in ("p0", "p1", "d0"):
        await until(
            lambda wid=wid: s.state.registry.get(wid).load.inflight_requests == 0,
            what=f"{wid} idle",
        )


async def test_shed_with_retry_after_and_a_client_that_leaves() -> None:
    async with (
        pd_stack("vllm", queue_size=1, queue_timeout=30) as s,
        httpx.AsyncClient(base_url=s.url, timeout=30) as http,
    ):
        first = await both_prefills_busy(s, http)
        leaving = asyncio.create_task(complete(http, "leaving"))
        await until(lambda: queued(s) == 1, what="one held")
        full = await complete(http, "full")
        assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
        error = full.json()["error"]
        assert (error["code"], error["type"]) == ("queue_full", "rate_limit_error")
        leaving.cancel()  # the client closes its connection while held
        await until(lambda: queued(s) == 0, what="it left the queue")
        s.held["p0"].release()
        s.held["p1"].release()
        assert [(await t).status_code for t in first] == [200, 200]
        seen = prompts(s, "p0") + prompts(s, "p1") + prompts(s, "d0")
        assert "full" not in seen and "leaving" not in seen
        metrics = (await http.get("/metrics")).text
    g = gate(s)
    series = g.core.stats.series[("none", "0")]
    assert series.shed == {"queue_full": 1} and series.left == 1
    assert (g.via[("pd", "shed")], g.via[("pd", "left")]) == (1, 1)
    assert 'cache_router_admission_requests_total{outcome="shed",via="pd"} 1.0' in metrics
    assert 'cache_router_admission_shed_total{code="queue_full",priority="0",tenant="none"}' in (
        metrics
    )
    assert g.core.queued == 0 and not g._reserved


async def test_a_held_request_times_out_with_503_and_explain_says_where_it_would_wait() -> None:
    async with (
        pd_stack("vllm", queue_timeout=0.3) as s,
        httpx.AsyncClient(base_url=s.url, timeout=30) as http,
    ):
        first = await both_prefills_busy(s, http)
        late = await complete(http, "late")
        assert late.status_code == 503 and int(late.headers["retry-after"]) >= 1
        assert late.json()["error"]["code"] == "queue_timeout"
        body = {"model": MODEL, "prompt": "where would this wait", "max_tokens": 2}
        auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        explained = (await http.post("/admin/explain", json=body, headers=auth)).json()
        s.held["p0"].release()
        s.held["p1"].release()
        assert [(await t).status_code for t in first] == [200, 200]
    admission = explained["admission"]
    assert sorted(admission["workers"]) == ["p0", "p1"]  # the prefill side's slots
    assert all(w["room"] == 0 for w in admission["workers"].values())
    assert admission["would"].startswith("held")
    assert explained["pd"]["decode"]["worker_id"] == "d0"


async def test_a_request_that_takes_no_prefill_engine_is_not_held() -> None:
    """The Responses API carries neither protocol's fields: its decode engine prefills
    it, so a full prefill side does not hold it."""
    async with (
        pd_stack("vllm") as s,
        httpx.AsyncClient(base_url=s.url, timeout=30) as http,
    ):
        first = await both_prefills_busy(s, http)
        r = await http.post(
            "/v1/responses", json={"model": MODEL, "input": "hello there", "max_output_tokens": 3}
        )
        assert queued(s) == 0
        s.held["p0"].release()
        s.held["p1"].release()
        assert [(await t).status_code for t in first] == [200, 200]
    assert r.headers.get("x-cache-router-worker") == "d0", r.text
    assert gate(s).via[("pd", "admitted")] == 3


async def test_a_request_its_decode_engine_prefills_is_not_held_for_a_prefill_slot() -> None:
    """With ``pd_local_prefill_tokens``, a short prompt is prefilled by its decode engine:
    it takes no prefill slot, so a full prefill side does not hold it (a long one is)."""
    async with (
        pd_stack("vllm", pd_local_prefill_tokens=24) as s,
        httpx.AsyncClient(base_url=s.url, timeout=30) as http,
    ):
        first = await both_prefills_busy(s, http)  # long prompts: prefilled remotely
        short = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "short", "max_tokens": 2}
        )
        assert short.status_code == 200 and short.headers["x-cache-router-worker"] == "d0"
        long = asyncio.create_task(complete(http, "long"))
        await until(lambda: queued(s) == 1, what="a long prompt held for a prefill slot")
        s.held["p0"].release()
        s.held["p1"].release()
        assert [(await t).status_code for t in [*first, long]] == [200, 200, 200]
    assert "short" not in prompts(s, "p0") + prompts(s, "p1")
    series = gate(s).core.stats.series[("none", "0")]
    assert (series.queued, series.admitted) == (1, 4)
