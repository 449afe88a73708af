"""The endpoint picker (router/epp/) against a gateway built from Envoy's own protos.

Engine doubles and the router run in-process as in test_router_e2e.py; the gateway's
side of the ``ext_proc`` stream is ``epp_gateway.Gateway`` (envoy-data-plane's messages
over a real gRPC channel), which forwards each request to the endpoint the picker names, as
Envoy would, and plays the response phase back. The proxy on the same router answers
the same requests, so its decisions and the picker's are compared on one index.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import orjson
import pytest
from envoy_data_plane.envoy.service.ext_proc import v3 as ep
from epp_gateway import (
    BUFFERED,
    FULL_DUPLEX,
    Gateway,
    Mode,
    headers_msg,
    picker,
    streamed,
    which,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stack import ADMIN_TOKEN, DoubleStack, until

from router.epp.server import EppServer

SYSTEM = "You are a careful assistant. " * 8


def chat(conversation: int, turn: int, stream: bool = False) -> bytes:
    messages = [{"role": "system", "content": f"Conversation {conversation}. " + SYSTEM}]
    for t in range(turn + 1):
        messages.append({"role": "user", "content": f"question {t} of conversation {conversation}"})
        if t < turn:
            messages.append({"role": "assistant", "content": "hi0 hi1 hi2 "})
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 3}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def endpoint_of(stack: DoubleStack, worker: str) -> str:
    return stack.engine(worker).url.removeprefix("http://")


async def indexed(stack: DoubleStack, worker: str) -> None:
    ingest = stack.state.registry.pools["default"].ingest
    engine = stack.engine(worker)
    await until(lambda: ingest.last_seq(worker) == engine.seq, what="events in")


async def test_same_decisions_as_the_proxy_both_ways_streaming_and_not(
    make_stack, nats_url, closing
):
    stack = await make_stack(3, nats_url)
    server, gw = await picker(stack)
    closing += [server, gw]
    http = stack.http()
    closing.append(http)
    # conversations opened through the proxy at once (their load spreads them), continued
    # through the picker
    for e in stack.engines:
        e.gate = asyncio.Event()
    tasks = []
    for c in range(3):
        tasks.append(asyncio.create_task(http.post("/v1/chat/completions", content=chat(c, 0))))
        await until(lambda c=c: sum(e.inflight for e in stack.engines) == c + 1, what="sent")
    for e in stack.engines:
        e.gate.set()
    proxied = {c: (await t).headers["x-cache-router-worker"] for c, t in enumerate(tasks)}
    assert sorted(proxied.values()) == ["w0", "w1", "w2"]  # a decision to match
    for w in proxied.values():
        await indexed(stack, w)
    for c in range(3):
        body = chat(c, 1, stream=c % 2 == 1)
        async with stack.http(ADMIN_TOKEN) as admin:
            explained = (await admin.post("/admin/explain", content=body)).json()
        ex = await gw.send("/v1/chat/completions", body)
        assert ex.immediate is None
        assert ex.endpoint == endpoint_of(stack, proxied[c])
        assert ex.worker == proxied[c] == explained["decision"]["worker_id"]
        assert int(ex.response_set["x-cache-router-hit-tokens"]) > 0
        assert ex.status == 200
        if c % 2:
            assert b"data: [DONE]" in ex.response
        else:
            assert orjson.loads(ex.response)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        await indexed(stack, proxied[c])
    # conversations opened through the picker, continued through the proxy
    for c in range(4, 8):
        ex = await gw.send("/v1/chat/completions", chat(c, 0, stream=c % 2 == 0))
        await indexed(stack, ex.worker)
        r = await http.post("/v1/chat/completions", content=chat(c, 1))
        assert r.headers["x-cache-router-worker"] == ex.worker
        assert int(r.headers["x-cache-router-hit-tokens"]) > 0
    # the picker's requests were counted as the proxy's are: routed, hits, TTFT
    text = (await http.get("/metrics")).text
    assert "cache_router_ttft_seconds_count" in text
    for w in stack.state.registry:
        assert w.load.inflight_requests == 0 and w.load.decode_streams == 0


async def test_the_answer_follows_the_protocol(make_stack, closing):
    stack = await make_stack(2, forward_authorization=False)
    server, gw = await picker(stack)
    closing += [server, gw]
    body = chat(0, 0)
    ex = await gw.send("/v1/chat/completions", body, headers={"authorization": "Bearer client-key"})
    # header and metadata carry the same single endpoint, and the route is cleared
    assert ex.metadata == {"envoy.lb": {"x-gateway-destination-endpoint": ex.endpoint}}
    assert ex.clear_route_cache
    assert ex.endpoint in {endpoint_of(stack, w) for w in ("w0", "w1")}
    # the body came back whole, in order, its length announced; the key stays here
    assert ex.body == body and ex.set["content-length"] == str(len(body))
    assert ex.removed == ["authorization"]
    assert "x-request-id" in ex.set
    # the engine got exactly the client's body
    engine = next(e for e in stack.engines if endpoint_of(stack, e.worker_id) == ex.endpoint)
    assert engine.requests[-1]["body"] == orjson.loads(body)
    # a body over one streamed chunk (62,000 bytes) comes back in several
    big = orjson.dumps({"model": "m", "prompt": "word " * 30_000, "max_tokens": 1})
    ex = await gw.send("/v1/completions", big, chunk=50_000)
    chunks = [a for a in ex.answers if which(a) == "request_body"]
    assert len(chunks) == 3 and ex.body == big
    assert all(len(streamed(a, "request_body").body) <= 62_000 for a in chunks)


async def test_buffered_mode_routes_in_the_body_response(make_stack, closing):
    stack = await make_stack(2)
    server, gw = await picker(stack)
    closing += [server, gw]
    ex = await gw.send("/v1/completions", orjson.dumps({"model": "m", "prompt": "hello"}),
                       mode=BUFFERED)  # fmt: skip
    assert ex.immediate is None and ex.status == 200
    assert ex.metadata["envoy.lb"]["x-gateway-destination-endpoint"] == ex.endpoint
    # a gateway that does not say its mode gets the configured one
    server2, gw2 = await picker(stack, body_mode="buffered")
    closing += [server2, gw2]
    ex = await gw2.send("/v1/completions", orjson.dumps({"model": "m", "prompt": "x"}),
                        mode=BUFFERED, config=False)  # fmt: skip
    assert ex.status == 200


async def test_refusals_are_immediate_responses_in_the_openai_shape(make_stack, closing):
    stack = await make_stack(1, max_body_bytes=4000)
    server, gw = await picker(stack)
    closing += [server, gw]
    cases = [
        (b"{not json", 400, "invalid_json"),
        (orjson.dumps({"model": "m"}), 400, "missing_field"),
        (orjson.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
         404, "model_not_found"),
        (orjson.dumps({"model": "m", "prompt": "x" * 5000}), 413, "request_too_large"),
        (orjson.dumps({"model": "m", "prompt": "x", "n": 10_000}), 400, "invalid_value"),
    ]  # fmt: skip
    for body, status, code in cases:
        for mode in (FULL_DUPLEX, BUFFERED):
            path = "/v1/chat/completions" if b"prompt" not in body else "/v1/completions"
            ex = await gw.send(path, body, mode=mode, chunk=1 << 16)
            assert ex.immediate is not None, (body[:30], mode)
            assert ex.immediate.status.code == status, (body[:30], ex.error())
            assert ex.error()["code"] == code
    # the engine never saw any of them
    assert stack.engines[0].requests == []
    # no usable engine: 503, the protocol's "no ready endpoints"
    await stack.engines[0].served.stop()
    await until(lambda: not stack.state.registry.get("w0").healthy, what="w0 down")
    ex = await gw.send("/v1/completions", orjson.dumps({"model": "m", "prompt": "x"}))
    assert ex.immediate.status.code == 503 and ex.error()["code"] == "no_healthy_worker"


async def test_the_gateways_subset_is_obeyed(make_stack, closing):
    stack = await make_stack(3)
    server, gw = await picker(stack)
    closing += [server, gw]
    only = endpoint_of(stack, "w2")
    body = orjson.dumps({"model": "m", "prompt": "hello"})
    # a list, one comma-separated string, an entry beside it on another port
    for subset in ([only], f"10.0.0.1:1,{only}", ["127.0.0.1:1", only]):
        ex = await gw.send("/v1/completions", body, subset=subset)
        assert ex.endpoint == only and ex.worker == "w2"
    for subset in ([], ["10.0.0.1:8000"]):
        ex = await gw.send("/v1/completions", body, subset=subset)
        assert ex.immediate is not None and ex.immediate.status.code == 503


async def test_a_request_without_body_and_the_unsupported_modes(make_stack, closing):
    stack = await make_stack(2)
    server, gw = await picker(stack)
    closing += [server, gw]
    ex = await gw.send("/v1/models", None)
    assert ex.endpoint in {endpoint_of(stack, w) for w in ("w0", "w1")}
    assert ex.status == 200 and b'"m"' in ex.response
    call = gw.process()
    first = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(),
        # the body would go before the pick
        protocol_config=ep.ProtocolConfiguration(request_body_mode=Mode.STREAMED),
    )
    await call.write(first)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_load_and_accounting_follow_the_response_phase(make_stack, closing):
    stack = await make_stack(1)
    server, gw = await picker(stack)
    closing += [server, gw]
    engine = stack.engines[0]
    load = stack.state.registry.get("w0").load
    engine.gate = asyncio.Event()  # requests wait: the flight stays open
    body = orjson.dumps({"model": "m", "prompt": "hello " * 20, "max_tokens": 2})
    task = asyncio.create_task(gw.send("/v1/completions", body))
    await until(lambda: load.inflight_requests == 1, what="flight begun at the pick")
    assert load.inflight_prefill_tokens > 0
    engine.gate.set()
    ex = await task
    assert ex.status == 200
    assert load.inflight_requests == 0 and load.inflight_prefill_tokens == 0
    # a gateway that drops the stream mid-request still frees the flight
    engine.gate = asyncio.Event()
    call = gw.process()
    first = ep.ProcessingRequest(
        request_headers=headers_msg({":method": "POST", ":path": "/v1/completions"}),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=FULL_DUPLEX),
    )
    await call.write(first)
    await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
    await call.read()
    assert load.inflight_requests == 1
    call.cancel()
    await until(lambda: load.inflight_requests == 0, what="flight freed on a dropped stream")
    engine.gate.set()
    # the TTFT histogram counted the picker's completed request
    async with stack.http() as http:
        text = (await http.get("/metrics")).text
    assert 'cache_router_ttft_seconds_count{arm="cache_aware",worker="w0"} 1.0' in text


async def test_health_service(make_stack, closing):
    stack = await make_stack(1)
    ready = {"now": False}
    server, gw = await picker(stack, ready=lambda: ready["now"])
    closing += [server, gw]
    stub = health_pb2_grpc.HealthStub(gw.channel)

    async def status(name: str) -> int:
        r = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        return int(r.status)

    async def serving_now() -> bool:
        return await status("readiness") == serving

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, 2
    assert await status("liveness") == serving
    assert await status("readiness") == not_serving
    assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == not_serving
    ready["now"] = True  # followed within a second
    await until(serving_now, what="ready")
    assert await status("readiness") == serving
    assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == serving


async def test_a_disaggregated_pool_is_left_to_the_proxy(closing):
    """Prefill/decode pools take two engines a request, which one endpoint cannot say:
    the picker refuses them (501) rather than send the prompt to one side only."""
    from router.config import RouterConfig, WorkerSpec
    from router.http.app import RouterApp

    cfg = RouterConfig(block_size=4, workers=[
        WorkerSpec("p0", "http://127.0.0.1:9", model="m", role="prefill"),
        WorkerSpec("d0", "http://127.0.0.1:10", model="m", role="decode"),
    ])  # fmt: skip
    app = RouterApp(cfg)
    server = EppServer(app.state.proxy_deps(), "127.0.0.1", 0)
    await server.start()
    gw = Gateway(server.port)
    closing += [server, gw]
    ex = await gw.send("/v1/completions", orjson.dumps({"model": "m", "prompt": "hi"}))
    assert ex.immediate.status.code == 501 and ex.error()["code"] == "invalid_request"


def test_the_declared_messages_match_envoys_protos():
    """Every field router/epp/messages.py declares has Envoy's name, number and kind
    (envoy-data-plane's generated classes), trailers and all, not only those the
    conversations above happen to send."""
    import dataclasses

    from envoy_data_plane.envoy.config.core import v3 as core
    from envoy_data_plane.envoy.type import v3 as types

    from router.epp import messages

    modules = (ep, core, types)
    for name, fields in messages.MESSAGES.items():
        envoy = next(getattr(m, name) for m in modules if hasattr(m, name))
        theirs = {
            f.name: f.metadata["betterproto"]
            for f in dataclasses.fields(envoy)
            if "betterproto" in f.metadata
        }
        for field, number, kind, oneof in fields:
            meta = theirs[field]
            assert (meta.number, meta.group) == (number, oneof), (name, field)
            assert meta.proto_type == _proto_type(kind), (name, field, meta.proto_type)
    assert {m.name: m.value for m in Mode} == messages.BODY_SEND_MODE


def _proto_type(kind: str) -> str:
    """A messages.py field type as betterproto2 names its kind."""
    kind = kind.strip("[]")
    if kind in ("string", "bytes", "bool"):
        return kind
    if kind == "int32" or kind.startswith("enum:"):  # HttpStatus.code: an enum in Envoy
        return "enum"
    return "map" if kind.startswith("map:") else "message"
