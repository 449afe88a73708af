"""Admission end to end: a router in front of mock engines (sim.mock.engine), real HTTP.

A fixed engine limit (``engine_max_inflight``) makes "full" a matter of requests in
flight, not of load reports' timing; one test lets the router learn the limit from the
engine's own ``/metrics``. Nothing here asserts on time: order, codes and counts only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import orjson
import pytest
from stack import BS, MODEL, EngineStack, mock_engine_config, read_body, until

from router.admission.core import TenantSpec
from router.config import RouterConfig, WorkerSpec
from sim.mock.engine import MockEngine
from sim.mock.scheduler import Timing

ADMIN = "t"
Scope = MutableMapping[str, Any]


class Bodies:
    """ASGI wrapper of an engine: keeps every completion body it receives."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[dict[str, Any]] = []

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        body, replay = await read_body(receive)
        if body:
            self.seen.append(orjson.loads(body))
        await self.app(scope, replay, send)


async def start(seqs: int = 256, **settings: Any) -> tuple[EngineStack, Bodies]:
    """One slow mock engine (50 tokens/s a request) behind a router with ``settings``."""
    stack = EngineStack()
    cfg = mock_engine_config(
        "w0", max_num_seqs=seqs, timing=Timing(speed=1.0, decode_tps=50.0),
        scheduling_policy="priority",  # as vLLM, it takes a body's priority only then
    )  # fmt: skip
    engine = MockEngine(cfg)
    bodies = Bodies(engine.app)
    engine.app = bodies
    stack.engines["w0"] = await engine.start()
    fields: dict[str, Any] = {
        "block_size": BS, "admin_token": ADMIN, "health_interval": 0.2,
        "workers": [WorkerSpec("w0", stack.engines["w0"].url, model=MODEL)],
    }  # fmt: skip
    await stack.serve(RouterConfig(**(fields | settings)))
    return stack, bodies


@pytest.fixture
async def stacks() -> AsyncIterator[list[EngineStack]]:
    made: list[EngineStack] = []
    yield made
    for stack in made:
        await stack.stop()


async def complete(
    http: httpx.AsyncClient, tokens: int = 10, headers: dict[str, str] | None = None, **body: Any
) -> httpx.Response:
    """A streamed completion, read to its end."""
    payload = {"model": MODEL, "prompt": "admission test", "max_tokens": tokens,
               "ignore_eos": True, "stream": True, **body}  # fmt: skip
    return await http.post("/v1/completions", json=payload, headers=headers)


def gate(stack: EngineStack) -> Any:
    assert stack.state.gate is not None
    return stack.state.gate


def held(stack: EngineStack) -> int:
    return int(gate(stack).core.queued)


async def test_held_requests_go_in_priority_order_and_a_full_queue_sheds_at_once(
    stacks: list[EngineStack],
) -> None:
    stack, bodies = await start(engine_max_inflight=1, engine_queue=0, reserve_share=0.0,
                                queue_size=2)  # fmt: skip
    stacks.append(stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        first = asyncio.create_task(complete(http, 25, prompt="first"))
        await until(lambda: len(bodies.seen) == 1, what="the first request on the engine")
        low = asyncio.create_task(complete(http, prompt="low", priority=5))
        await until(lambda: held(stack) == 1, what="one held")
        mid = asyncio.create_task(complete(http, prompt="mid", priority=-1))
        await until(lambda: held(stack) == 2, what="two held")
        full = await complete(http, prompt="late", priority=9)  # ranks below both
        assert full.status_code == 429
        assert full.json()["error"]["code"] == "queue_full"
        assert full.json()["error"]["type"] == "rate_limit_error"
        assert int(full.headers["retry-after"]) >= 1
        urgent = asyncio.create_task(complete(http, prompt="urgent", priority=-5))
        evicted = await low  # the worst held request made room for the urgent one
        assert evicted.status_code == 429 and evicted.json()["error"]["code"] == "queue_full"
        assert "retry-after" in evicted.headers
        for task in (first, mid, urgent):
            assert (await task).status_code == 200
    # one at a time on the engine, the most urgent first; the priority went on unchanged
    assert [b["prompt"] for b in bodies.seen] == ["first", "urgent", "mid"]
    assert [b.get("priority") for b in bodies.seen] == [None, -5, -1]
    stats = gate(stack).core.stats.series
    assert stats[("none", "9")].shed == {"queue_full": 1}
    assert stats[("none", "-5")].admitted == 1 and stats[("none", "-5")].queued == 1


async def test_a_request_still_held_at_its_deadline_gets_503(stacks: list[EngineStack]) -> None:
    stack, _ = await start(engine_max_inflight=1, engine_queue=0, queue_timeout=0.3)
    stacks.append(stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        first = asyncio.create_task(complete(http, 50))  # a second on the engine
        await until(lambda: gate(stack)._inflight("w0") == 1, what="the engine full")
        late = await complete(http)
        assert late.status_code == 503
        error = late.json()["error"]
        assert (error["code"], error["type"]) == ("queue_timeout", "server_error")
        assert int(late.headers["retry-after"]) >= 1
        assert (await first).status_code == 200
    assert held(stack) == 0


async def test_a_client_that_leaves_while_held_leaves_the_queue(
    stacks: list[EngineStack],
) -> None:
    stack, bodies = await start(engine_max_inflight=1, engine_queue=0)
    stacks.append(stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        first = asyncio.create_task(complete(http, 40, prompt="first"))
        await until(lambda: len(bodies.seen) == 1, what="the engine full")
        gone = asyncio.create_task(complete(http, prompt="gone"))
        await until(lambda: held(stack) == 1, what="one held")
        gone.cancel()  # the client closes its connection
        await until(lambda: held(stack) == 0, what="the queue empty again")
        assert (await first).status_code == 200
    assert gate(stack).core.stats.series[("none", "0")].left == 1
    assert [b["prompt"] for b in bodies.seen] == ["first"]  # never sent on


async def test_tenants_priorities_metrics_and_explain(stacks: list[EngineStack]) -> None:
    tenants = {"acme": TenantSpec(api_keys=("key-acme",), priority=-2)}
    stack, bodies = await start(tenants=tenants)
    stacks.append(stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        keyed = {"authorization": "Bearer key-acme"}
        assert (await complete(http, headers=keyed)).status_code == 200
        assert (await complete(http, headers={"x-tenant-id": "bob"})).status_code == 200
        # a header cannot claim a tenant that has keys
        assert (await complete(http, headers={"x-tenant-id": "acme"})).status_code == 200
        bad = await complete(http, priority="high")
        assert bad.status_code == 400
        assert (bad.json()["error"]["code"], bad.json()["error"]["param"]) == (
            "invalid_value", "priority",
        )  # fmt: skip
        metrics = (await http.get("/metrics")).text
        explain = await http.post(
            "/admin/explain",
            json={"model": MODEL, "prompt": "where would this go", "priority": 3},
            headers={"authorization": f"Bearer {ADMIN}", "x-tenant-id": "carol"},
        )
    series = gate(stack).core.stats.series
    assert series[("acme", "-2")].admitted == 1  # its key's tenant, its default priority
    assert series[("bob", "0")].admitted == 1 and series[("none", "0")].admitted == 1
    assert 'cache_router_admission_admitted_total{priority="-2",tenant="acme"} 1.0' in metrics
    assert "cache_router_admission_wait_seconds_bucket" in metrics
    assert all("priority" not in b for b in bodies.seen)  # nothing added to the body
    admission = explain.json()["admission"]
    assert (admission["tenant"], admission["priority"]) == ("carol", 3)
    assert admission["would"].startswith("bound at once")
    assert admission["workers"]["w0"]["limit"] is None  # never seen full


async def test_nothing_waits_while_the_engine_has_room(stacks: list[EngineStack]) -> None:
    stack, _ = await start()  # the defaults: admission on, limits learnt
    stacks.append(stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        answers = await asyncio.gather(*(complete(http, 5) for _ in range(24)))
    assert all(a.status_code == 200 for a in answers)
    series = gate(stack).core.stats.series
    assert sum(s.queued for s in series.values()) == 0
    assert sum(s.admitted for s in series.values()) == 24


async def test_the_engines_own_queue_teaches_the_router_its_limit(
    stacks: list[EngineStack],
) -> None:
    """Two slots on the engine, eight requests at once: the engine queues, its /metrics
    says so, the router learns the limit and holds the rest itself."""
    stack, _ = await start(seqs=2, health_interval=0.05, load_stale_after=0.04)
    stacks.append(stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        first = [asyncio.create_task(complete(http, 40)) for _ in range(8)]
        await until(lambda: gate(stack).core.capacity.limit("w0") == 2, what="limit learnt")
        later = [asyncio.create_task(complete(http, 5)) for _ in range(6)]
        await until(lambda: held(stack) > 0, what="requests held at the router")
        answers = await asyncio.gather(*first, *later)
    assert all(a.status_code == 200 for a in answers)


async def test_the_doctor_says_where_requests_wait(stacks: list[EngineStack]) -> None:
    from router.observe.doctor import admission

    stack, bodies = await start(engine_max_inflight=1, engine_queue=0)
    stacks.append(stack)
    auth = {"authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        workers = (await http.get("/admin/workers", headers=auth)).json()["workers"]
        with httpx.Client(timeout=10) as sync:
            idle = await asyncio.to_thread(admission, sync, stack.url, auth, workers)
            first = asyncio.create_task(complete(http, 25))
            await until(lambda: len(bodies.seen) == 1, what="the engine full")
            full = await asyncio.to_thread(admission, sync, stack.url, auth, workers)
        assert (await first).status_code == 200
    assert [(c.worker, c.status) for c in idle] == [("w0", "ok"), ("-", "ok")]
    assert [(c.worker, c.status) for c in full] == [("w0", "warn"), ("-", "warn")]
    assert "limit 1, 1 in flight, room 0" in full[0].detail


async def test_fair_shares_are_settled_with_the_tokens_generated(
    stacks: list[EngineStack],
) -> None:
    """A request is charged its prompt and ``max_tokens`` when admitted; the answer's
    usage (a whole body's, a stream's last chunk when asked) settles it with what the
    engine generated; a stream without usage, with its token chunks counted (one a
    token, as vLLM and SGLang stream them: router.forward.migrate's count)."""
    stack, _ = await start()
    stacks.append(stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        whole = await http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "admission test", "max_tokens": 300},
            headers={"x-tenant-id": "whole"},
        )
        streamed = await complete(
            http, 300, {"x-tenant-id": "usage"}, ignore_eos=False,
            stream_options={"include_usage": True},
        )  # fmt: skip
        bare = await complete(http, 300, {"x-tenant-id": "bare"}, ignore_eos=False)
    usage = whole.json()["usage"]
    assert usage["completion_tokens"] < 300  # the answer ended before max_tokens
    last = [line for line in streamed.text.splitlines() if '"usage"' in line][-1]
    streamed_usage = orjson.loads(last.removeprefix("data: "))["usage"]
    assert bare.status_code == 200
    series = gate(stack).core.stats.series
    assert series[("whole", "0")].tokens == usage["prompt_tokens"] + usage["completion_tokens"]
    assert series[("usage", "0")].tokens == (
        streamed_usage["prompt_tokens"] + streamed_usage["completion_tokens"]
    )
    assert series[("bare", "0")].tokens == streamed_usage["prompt_tokens"] + sum(
        '"text"' in line for line in bare.text.splitlines()
    )


@pytest.mark.parametrize("engine_priority", [True, False])
async def test_an_urgent_request_goes_ahead_in_a_priority_scheduling_engine(
    stacks: list[EngineStack], engine_priority: bool
) -> None:
    """One slot and one request waiting in the engine: an urgent request is sent on past
    the full engine (engine_priority_scheduling) and runs before the one that waited
    there (the engine orders its queue by priority); without the setting it waits at the
    router until the slot frees."""
    stack, bodies = await start(
        1, engine_max_inflight=1, engine_queue=1, engine_priority_scheduling=engine_priority
    )
    stacks.append(stack)
    done: list[str] = []

    async def run(http: httpx.AsyncClient, prompt: str, tokens: int = 15, **body: Any) -> None:
        resp = await complete(http, tokens, prompt=prompt, **body)
        assert resp.status_code == 200
        done.append(prompt)

    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        # holds the slot until it is cancelled (500 tokens: 10 s), whatever the machine's pace
        first = asyncio.create_task(run(http, "first", 500))
        await until(lambda: len(bodies.seen) == 1, what="the first request on the engine")
        tasks = []
        tasks.append(asyncio.create_task(run(http, "waiting")))
        await until(lambda: len(bodies.seen) == 2, what="one request waiting in the engine")
        tasks.append(asyncio.create_task(run(http, "urgent", priority=-5)))
        if engine_priority:
            await until(lambda: len(bodies.seen) == 3, what="the urgent one on the engine")
            assert held(stack) == 0
        else:
            await until(lambda: held(stack) == 1, what="the urgent one held")
            assert len(bodies.seen) == 2
        assert not first.done()
        first.cancel()  # its client leaves: the slot frees
        await asyncio.gather(*tasks)
    if engine_priority:
        assert done == ["urgent", "waiting"]
    # else: the urgent one reaches the engine as the slot frees, racing the engine's
    # next step to the waiting one: no order to assert
