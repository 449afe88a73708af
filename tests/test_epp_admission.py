"""Admission behind the endpoint picker (router/epp/ + router/admission/gate.py).

The gateway is ``epp_gateway.Gateway`` (Envoy's own messages over a real gRPC channel,
forwarding to the endpoint the picker names); the engines are the doubles of
test_epp.py, whose ``gate`` event holds their answers so that "full" is a matter of
requests in flight. A fixed engine limit (``engine_max_inflight = 1``, no engine queue)
makes a worker full with one request on it. Nothing here asserts on time: what is held,
where it goes, the codes, the counts.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from envoy_data_plane.envoy.service.ext_proc import v3 as ep
from epp_gateway import (
    BUFFERED,
    FULL_DUPLEX,
    Gateway,
    headers_msg,
    picker,
    set_headers,
)
from stack import DoubleStack, until

from router.admission.core import State

SYSTEM = "You are a careful assistant. " * 8
FULL = {"engine_max_inflight": 1, "engine_queue": 0}


def chat(conversation: int, turn: int) -> bytes:
    messages = [{"role": "system", "content": f"Conversation {conversation}. " + SYSTEM}]
    for t in range(turn + 1):
        messages.append({"role": "user", "content": f"question {t} of conversation {conversation}"})
        if t < turn:
            messages.append({"role": "assistant", "content": "hi0 hi1 hi2 "})
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 3})


def completion(prompt: str) -> bytes:
    return orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 2})


def endpoint_of(stack: DoubleStack, worker: str) -> str:
    return stack.engine(worker).url.removeprefix("http://")


def gate(stack: DoubleStack) -> Any:
    assert stack.state.gate is not None
    return stack.state.gate


def held(stack: DoubleStack) -> int:
    return int(gate(stack).core.queued)


def tickets(stack: DoubleStack) -> list[Any]:
    return list(gate(stack).core._held.values())


async def opened(gw: Gateway, body: bytes, mode: int = FULL_DUPLEX) -> Any:
    """A stream whose request went to the picker in full (headers, body): the call, for
    the test to read its answer from or cancel."""
    call = gw.process()
    first = ep.ProcessingRequest(
        request_headers=headers_msg({":method": "POST", ":path": "/v1/completions"}),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=mode),
    )
    await call.write(first)
    await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
    return call


def no_leaks(stack: DoubleStack) -> None:
    g = gate(stack)
    assert g.core.queued == 0
    assert not g._reserved
    for w in stack.state.registry:
        assert w.load.inflight_requests == 0


async def test_a_held_request_is_released_only_to_an_endpoint_the_gateway_allowed(
    make_stack, closing
):
    """Both engines full; a request the gateway allows on w1 only is held. w0 frees
    first: it stays held (w0 is not in its subset); w1 frees: it goes there."""
    stack = await make_stack(2, **FULL)
    server, gw = await picker(stack)
    closing += [server, gw]
    w0, w1 = stack.engine("w0"), stack.engine("w1")
    w0.gate, w1.gate = asyncio.Event(), asyncio.Event()
    on0 = asyncio.create_task(
        gw.send("/v1/completions", completion("a"), subset=[endpoint_of(stack, "w0")])
    )
    on1 = asyncio.create_task(
        gw.send("/v1/completions", completion("b"), subset=[endpoint_of(stack, "w1")])
    )
    await until(lambda: w0.inflight == 1 and w1.inflight == 1, what="both engines full")
    late = asyncio.create_task(
        gw.send("/v1/completions", completion("c"), subset=[endpoint_of(stack, "w1")])
    )
    await until(lambda: held(stack) == 1, what="the third request held")
    w0.gate.set()
    assert (await on0).status == 200  # w0 is free now, and the held one may not go there
    assert held(stack) == 1 and not late.done()
    w1.gate.set()
    assert (await on1).status == 200
    ex = await late
    assert ex.immediate is None and ex.status == 200
    assert ex.endpoint == endpoint_of(stack, "w1") and ex.worker == "w1"
    assert [r["body"]["prompt"] for r in w1.requests] == ["b", "c"]
    assert [r["body"]["prompt"] for r in w0.requests] == ["a"]
    series = gate(stack).core.stats.series[("none", "0")]
    assert (series.queued, series.admitted) == (1, 3)
    assert gate(stack).via[("epp", "admitted")] == 3
    no_leaks(stack)
    # the picker's admissions show where the proxy's do, with the path they came by
    async with stack.http() as http:
        text = (await http.get("/metrics")).text
    assert 'cache_router_admission_admitted_total{priority="0",tenant="none"} 3.0' in text
    assert 'cache_router_admission_requests_total{outcome="admitted",via="epp"} 3.0' in text


async def test_a_prefix_held_outside_the_subset_is_not_waited_for(make_stack, nats_url, closing):
    """w0 holds the conversation's prefix and frees at a known pace, so admission would
    wait for it (its late binding keeps the prefix) rather than send the request to w1:
    but the gateway allows w1 only, so the request goes to w1 as soon as w1 has room."""
    stack = await make_stack(2, nats_url, queue_timeout=30, **FULL)
    server, gw = await picker(stack)
    closing += [server, gw]
    w0_only, w1_only = [endpoint_of(stack, "w0")], [endpoint_of(stack, "w1")]
    ingest = stack.state.registry.pools["default"].ingest
    w0, w1 = stack.engine("w0"), stack.engine("w1")
    for turn in range(3):  # the conversation on w0; three ends give w0 a pace
        ex = await gw.send("/v1/chat/completions", chat(7, turn), subset=w0_only)
        assert ex.worker == "w0"
        await until(lambda: ingest.last_seq("w0") == w0.seq, what="w0's blocks indexed")
    assert gate(stack).core.capacity.free_in("w0") < 1.0
    w0.gate, w1.gate = asyncio.Event(), asyncio.Event()
    on0 = asyncio.create_task(gw.send("/v1/completions", completion("a"), subset=w0_only))
    on1 = asyncio.create_task(gw.send("/v1/completions", completion("b"), subset=w1_only))
    await until(lambda: w0.inflight == 1 and w1.inflight == 1, what="both engines full")
    turn = asyncio.create_task(gw.send("/v1/chat/completions", chat(7, 3), subset=w1_only))
    await until(lambda: held(stack) == 1, what="the next turn held")
    (ticket,) = tickets(stack)
    assert ticket.candidates == ("w1",) and "w0" not in ticket.saved
    w1.gate.set()
    ex = await turn
    assert ex.immediate is None and ex.worker == "w1" and ex.status == 200
    assert (await on1).status == 200
    w0.gate.set()
    assert (await on0).status == 200
    no_leaks(stack)


async def test_shed_requests_are_immediate_responses_with_retry_after(make_stack, closing):
    """A full queue: 429 ``queue_full``; a buffered stream held to the gateway's message
    timeout: 503 ``queue_timeout`` before it. Both in the OpenAI error shape, with
    ``retry-after``, as the proxy answers them."""
    stack = await make_stack(1, queue_size=1, **FULL)
    server, gw = await picker(stack, message_timeout=0.4)
    closing += [server, gw]
    w0 = stack.engine("w0")
    w0.gate = asyncio.Event()
    first = asyncio.create_task(gw.send("/v1/completions", completion("first")))
    await until(lambda: w0.inflight == 1, what="the engine full")
    waiting = asyncio.create_task(gw.send("/v1/completions", completion("waiting")))
    await until(lambda: held(stack) == 1, what="one held")
    (ticket,) = tickets(stack)  # a full-duplex stream: no message timeout, queue_timeout's
    assert ticket.deadline - ticket.arrival == pytest.approx(10.0)
    full = await gw.send("/v1/completions", completion("full"))
    assert full.immediate is not None and full.immediate.status.code == 429
    head = set_headers(full.immediate.headers)
    assert head["content-type"] == "application/json" and int(head["retry-after"]) >= 1
    assert (full.error()["code"], full.error()["type"]) == ("queue_full", "rate_limit_error")
    w0.gate.set()
    assert (await first).status == 200 and (await waiting).status == 200
    # buffered: Envoy times each message (here 0.4 s): the hold ends before that, shed
    w0.gate = asyncio.Event()
    first = asyncio.create_task(gw.send("/v1/completions", completion("first"), mode=BUFFERED))
    await until(lambda: w0.inflight == 1, what="the engine full again")
    late = await gw.send("/v1/completions", completion("late"), mode=BUFFERED)
    assert late.immediate is not None and late.immediate.status.code == 503
    assert late.error()["code"] == "queue_timeout"
    assert "within 0.35 s" in late.error()["message"]  # 0.4 s less the 50 ms margin
    assert int(set_headers(late.immediate.headers)["retry-after"]) >= 1
    w0.gate.set()
    assert (await first).status == 200
    prompts = [r["body"]["prompt"] for r in w0.requests]
    assert prompts == ["first", "waiting", "first"]  # the shed ones never reached it
    series = gate(stack).core.stats.series[("none", "0")]
    assert series.shed == {"queue_full": 1, "queue_timeout": 1}
    assert gate(stack).via[("epp", "shed")] == 2
    no_leaks(stack)


async def test_a_stream_cancelled_while_held_leaves_the_queue(make_stack, closing):
    stack = await make_stack(1, **FULL)
    server, gw = await picker(stack)
    closing += [server, gw]
    w0 = stack.engine("w0")
    w0.gate = asyncio.Event()
    first = asyncio.create_task(gw.send("/v1/completions", completion("first")))
    await until(lambda: w0.inflight == 1, what="the engine full")
    call = await opened(gw, completion("gone"))
    await until(lambda: held(stack) == 1, what="held")
    (ticket,) = tickets(stack)
    call.cancel()  # the gateway's client went away: Envoy resets the ext_proc stream
    await until(lambda: held(stack) == 0, what="the queue empty again")
    assert ticket.state is State.LEFT
    w0.gate.set()
    assert (await first).status == 200
    assert [r["body"]["prompt"] for r in w0.requests] == ["first"]
    assert gate(stack).core.stats.series[("none", "0")].left == 1
    assert gate(stack).via[("epp", "left")] == 1
    no_leaks(stack)


async def test_the_slot_is_freed_when_a_routed_stream_is_cancelled(make_stack, closing):
    """A request routed and then dropped by the gateway (no response phase) frees its
    slot: the request held behind it is released."""
    stack = await make_stack(1, **FULL)
    server, gw = await picker(stack)
    closing += [server, gw]
    w0 = stack.engine("w0")
    w0.gate = asyncio.Event()
    call = await opened(gw, completion("dropped"))
    routed = await call.read()  # the headers response: routed to w0, whose slot it takes
    assert set_headers(routed.request_headers.response.header_mutation)[
        "x-gateway-destination-endpoint"
    ] == endpoint_of(stack, "w0")
    behind = asyncio.create_task(gw.send("/v1/completions", completion("behind"), forward=False))
    await until(lambda: held(stack) == 1, what="held behind it")
    call.cancel()
    ex = await behind
    assert ex.immediate is None and ex.endpoint == endpoint_of(stack, "w0")
    assert gate(stack).via[("epp", "admitted")] == 2


async def test_without_admission_and_with_no_endpoint_allowed(make_stack, closing):
    """Admission off: the picker routes as before. A request the gateway allows nowhere
    is refused (503) and never held: no candidate is left for it to wait for."""
    stack = await make_stack(1, admission=False)
    server, gw = await picker(stack)
    closing += [server, gw]
    assert stack.state.gate is None
    assert (await gw.send("/v1/completions", completion("x"))).status == 200
    stack2 = await make_stack(1, **FULL)
    server2, gw2 = await picker(stack2)
    closing += [server2, gw2]
    ex = await gw2.send("/v1/completions", completion("x"), subset=["10.0.0.9:1"])
    assert ex.immediate.status.code == 503 and ex.error()["code"] == "no_healthy_worker"
    assert gate(stack2).via == {("epp", "unplaced"): 1}
    assert sum(s.queued for s in gate(stack2).core.stats.series.values()) == 0


async def test_held_requests_leave_in_priority_order_with_their_tenants(make_stack, closing):
    """The picker's requests are ordered as the proxy's: the body's ``priority`` and the
    tenant header count, and the priority goes on to the engine unchanged."""
    stack = await make_stack(1, **FULL)
    server, gw = await picker(stack)
    closing += [server, gw]
    w0 = stack.engine("w0")
    w0.gate = asyncio.Event()
    first = asyncio.create_task(gw.send("/v1/completions", completion("first")))
    await until(lambda: w0.inflight == 1, what="the engine full")
    bodies = {
        "low": orjson.dumps({"model": "m", "prompt": "low", "max_tokens": 2, "priority": 5}),
        "urgent": orjson.dumps({"model": "m", "prompt": "urgent", "max_tokens": 2, "priority": -1}),
    }
    low = asyncio.create_task(
        gw.send("/v1/completions", bodies["low"], headers={"x-tenant-id": "bob"})
    )
    await until(lambda: held(stack) == 1, what="low held")
    urgent = asyncio.create_task(
        gw.send("/v1/completions", bodies["urgent"], headers={"x-tenant-id": "acme"})
    )
    await until(lambda: held(stack) == 2, what="both held")
    w0.gate.set()
    assert [(await t).status for t in (first, urgent, low)] == [200, 200, 200]
    assert [r["body"]["prompt"] for r in w0.requests] == ["first", "urgent", "low"]
    assert [r["body"].get("priority") for r in w0.requests] == [None, -1, 5]
    series = gate(stack).core.stats.series
    assert series[("acme", "-1")].admitted == 1 and series[("bob", "5")].queued == 1
