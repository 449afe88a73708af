"""End to end: real nats-server, engine doubles on real ports, the router in-process.

Every test talks HTTP to the router on a loopback port, with the official ``openai``
client where a client's view matters.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import nats
import openai
import orjson
import pytest
from stack import ADMIN_TOKEN, DoubleStack, EngineDouble, Served, until

from policies.experiments import Arm
from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp

TOKEN = ADMIN_TOKEN
SYSTEM = "You are a careful assistant. " * 8  # shared by every conversation


def served_by(stack: DoubleStack) -> dict[str, int]:
    return {e.worker_id: len(e.requests) for e in stack.engines}


# -- the OpenAI surface ---------------------------------------------------------------


async def test_openai_client_chat_and_completions_streaming_included(make_stack):
    stack = await make_stack(1)
    client = stack.client()
    messages = [{"role": "user", "content": "hello there"}]
    chat = await client.chat.completions.create(model="m", messages=messages, max_tokens=3)
    assert chat.choices[0].message.content == "hi0 hi1 hi2 "
    assert chat.usage is not None and chat.usage.prompt_tokens > 0

    chunks = [
        c
        async for c in await client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    ]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "hi0 hi1 hi2 hi3 "
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 8  # same prompt again

    comp = await client.completions.create(model="m", prompt="once upon a time", max_tokens=2)
    assert comp.choices[0].text == "hi0 hi1 "
    stream = await client.completions.create(
        model="m", prompt="once upon a time", max_tokens=3, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream]) == "hi0 hi1 hi2 "

    models = await client.models.list()
    assert [m.id for m in models.data] == ["m"]
    # the body reached the engine byte for byte
    sent = [e.requests for e in stack.engines]
    bodies = [r["body"] for reqs in sent for r in reqs]
    assert {"model": "m", "messages": messages, "max_tokens": 3} in bodies


async def test_errors_use_the_openai_shape_and_status(make_stack):
    stack = await make_stack(1, max_body_bytes=2000)
    async with stack.http() as http:
        cases = [
            (b"{not json", 400, "invalid_json"),
            (orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), 400, "missing_field"),
            (orjson.dumps({"model": "m"}), 400, "missing_field"),
            (orjson.dumps({"model": "m", "messages": [{"content": "x"}]}), 400, "invalid_request"),
            (
                orjson.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
                404,
                "model_not_found",
            ),
            (
                orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 3000}]}),
                413,
                "request_too_large",
            ),
        ]
        for body, status, code in cases:
            r = await http.post("/v1/chat/completions", content=body)
            assert r.status_code == status, (body[:40], r.text)
            err = r.json()["error"]
            assert err["code"] == code and err["message"] and "type" in err

        # the engine's own error passes through with its status and body
        stack.engines[0].fail_with = (422, {"error": {"message": "bad n", "code": "engine"}})
        r = await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 422 and r.json()["error"]["message"] == "bad n"
        stack.engines[0].fail_with = None

        # no healthy worker: 503
        await stack.engines[0].served.stop()
        await until(lambda: not stack.state.registry.get("w0").healthy, what="w0 down")
        r = await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"

    # and the openai client maps them to its exception classes
    client = stack.client()
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="x")


async def test_connect_error_retries_on_another_worker(make_stack):
    stack = await make_stack(2, health_interval=30.0)  # health checks will not notice
    await stack.engines[0].served.stop()
    async with stack.http() as http:
        for _ in range(4):
            r = await http.post("/v1/completions", json={"model": "m", "prompt": "hello"})
            assert r.status_code == 200 and r.headers["x-cache-router-worker"] == "w1"
    assert len(stack.engines[1].requests) == 4


async def test_client_disconnect_cancels_the_upstream_stream(make_stack):
    stack = await make_stack(1)
    engine = stack.engines[0]
    engine.token_delay = 0.05
    async with stack.http() as http:
        body = {"model": "m", "prompt": "long story", "max_tokens": 200, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for _line in r.aiter_lines():
                break  # the client leaves after the first event
    await until(lambda: engine.cancelled == 1, what="engine stream cancelled")
    load = stack.state.registry.get("w0").load
    await until(lambda: load.inflight_requests == 0, what="router load released")
    assert load.decode_streams == 0 and load.inflight_prefill_tokens == 0


# -- cache-aware routing over NATS ---------------------------------------------------


async def test_conversation_sticks_to_its_prefix_and_cached_tokens_grow(make_stack, nats_url):
    stack = await make_stack(3, nats_url)
    client = stack.client()
    messages = [{"role": "system", "content": SYSTEM}]
    ingest = stack.state.registry.pools["default"].ingest
    cached, workers = [], []
    for turn in range(4):
        messages.append({"role": "user", "content": f"question number {turn} please"})
        resp = await client.chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=3, extra_headers={"x-session-id": "s1"}
        )
        chat = resp.parse()
        workers.append(resp.headers["x-cache-router-worker"])
        cached.append(chat.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": chat.choices[0].message.content})
        holder = stack.engine(workers[-1])
        await until(lambda h=holder: ingest.last_seq(h.worker_id) == h.seq, what="events in")
    assert len(set(workers)) == 1, workers
    assert cached[0] == 0
    assert all(b > a for a, b in itertools.pairwise(cached)), cached
    # the router's own accounting saw the same hits
    async with stack.http() as http:
        text = (await http.get("/metrics")).text
    assert 'cache_router_hit_tokens_total{arm="cache_aware",worker="' + workers[0] in text


async def test_saturated_holder_loses_the_request_and_a_prefetch_hint_is_sent(make_stack, nats_url):
    stack = await make_stack(2, nats_url)
    client = stack.client()
    prompt = SYSTEM * 6
    first = await client.completions.with_raw_response.create(model="m", prompt=prompt)
    holder = first.headers["x-cache-router-worker"]
    other = "w1" if holder == "w0" else "w0"
    ingest = stack.state.registry.pools["default"].ingest
    engine = stack.engine(holder)
    await until(lambda: ingest.last_seq(holder) == engine.seq, what="events in")

    hints = []

    async def on_hint(msg: Any) -> None:
        hints.append((msg.subject, msg.data))

    nc = await nats.connect(nats_url)
    await nc.subscribe("kv.prefetch.>", cb=on_hint)
    # saturate the holder (a deep queue); the other has a short one a prefetch can hide in
    await engine.report_load(running=64, waiting=400, kv_usage=0.99)
    await stack.engine(other).report_load(running=4, waiting=40, kv_usage=0.5)
    registry = stack.state.registry
    await until(lambda: registry.get(holder).load.engine.waiting == 400, what="holder load")
    await until(lambda: registry.get(other).load.engine.waiting == 40, what="other load")
    # the hint goes out before the request: its blocks are to land while the request
    # waits in the engine's queue (a whole answer's headers come once it is computed)
    gate = stack.engine(other).gate = asyncio.Event()
    sent = asyncio.create_task(
        client.completions.with_raw_response.create(model="m", prompt=prompt + " more")
    )
    await until(lambda: stack.engine(other).inflight == 1, what="request held by the engine")
    await until(lambda: hints, timeout=5, what="prefetch hint while the request waits")
    gate.set()
    second = await sent
    assert second.headers["x-cache-router-worker"] == other
    subject, data = hints[0]
    hint = orjson.loads(data)
    assert subject == f"kv.prefetch.{other}"
    assert hint["source_worker"] == holder and hint["target_worker"] == other
    # the hint names the source engine's own blocks, not the router's hashes
    assert hint["block_hashes"] and set(hint["block_hashes"]) <= set(engine.cache)
    assert hint["num_tokens"] == len(hint["block_hashes"]) * 4
    await nc.close()


async def test_a_load_report_during_a_scrape_outlives_the_scrape(make_stack, nats_url):
    # the scrape started before the push report and answers after it: its numbers are older
    stack = await make_stack(1, nats_url, load_stale_after=1.0)
    engine = stack.engines[0]
    load = stack.state.registry.get("w0").load
    engine.metrics_gate = asyncio.Event()
    started = engine.scrapes
    await until(lambda: engine.scrapes > started, what="a scrape in flight")
    await engine.report_load(running=4, waiting=40, kv_usage=0.5)
    await until(lambda: load.engine.waiting == 40, what="push report in")
    checks = engine.health_checks
    engine.metrics_gate.set()  # the scrape answers waiting=0
    # health checks run one after another: the next one starts after the scrape is applied
    await until(lambda: engine.health_checks > checks, what="the next health check")
    assert load.engine.waiting == 40


async def test_removed_block_is_no_longer_matched(make_stack, nats_url):
    stack = await make_stack(1, nats_url)
    engine = stack.engines[0]
    async with stack.http() as http:
        body = {"model": "m", "prompt": "abcd" * 64}  # 64 tokens, 16 blocks
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        pool = stack.state.registry.pools["default"]
        await until(lambda: pool.ingest.last_seq("w0") == engine.seq, what="events in")

        async def explained() -> int:
            r = await http.post(
                "/admin/explain", json=body, headers={"authorization": f"Bearer {TOKEN}"}
            )
            return r.json()["workers"][0]["match"]["total"]

        assert await explained() == 16
        # the engine evicts its last 6 blocks: the router's match shrinks to the first 10
        await engine.evict(list(engine.cache)[10:])
        await until(lambda: pool.ingest.last_seq("w0") == engine.seq, what="removal in")
        assert await explained() == 10
        await engine.clear()
        await until(lambda: pool.ingest.last_seq("w0") == engine.seq, what="clear in")
        assert await explained() == 0


async def test_lost_event_is_replayed(make_stack, nats_url):
    stack = await make_stack(1, nats_url)
    engine = stack.engines[0]
    pool = stack.state.registry.pools["default"]
    async with stack.http() as http:
        await http.post("/v1/completions", json={"model": "m", "prompt": "b" * 40})
        await until(lambda: pool.ingest.last_seq("w0") == engine.seq, what="first batch")
        # the hand-off to the native reader resyncs: one that ran after the drop below
        # fetched the lost batch before the gap could show (3 runs in 10 failed so)
        await until(stack.events_at_rest, what="the event feed at rest")
        engine.drop_next = 1  # the next batch never reaches the live subject
        await http.post("/v1/completions", json={"model": "m", "prompt": "c" * 40})
        # the message says whether a resync ran meanwhile
        assert pool.ingest.last_seq("w0") == engine.seq - 1, (
            pool.ingest.last_seq("w0"),
            engine.seq,
            dict(stack.state.events.counts),
        )
        await http.post("/v1/completions", json={"model": "m", "prompt": "d" * 40})
        # the third batch shows the gap; the router asks for the lost one and applies both
        await until(lambda: pool.ingest.last_seq("w0") == engine.seq, what="replayed")
    assert pool.ingest.in_sync("w0")
    assert stack.state.events.counts["replayed_batches"] >= 1
    assert pool.ingest.gaps >= 1
    held = {w: t.total for w, t in pool.index.match_tiers(pool.hasher.hash_tokens(
        stack.state.tokenizers.get("m").encode("c" * 40, True))).items()}  # fmt: skip
    assert held == {"w0": 2}  # 40 bytes: 10 tokens, 2 full blocks


async def test_late_router_loads_a_dump(make_stack, nats_url):
    stack = await make_stack(1, nats_url, engine_kw={"ring": 2})
    engine = stack.engines[0]
    async with stack.http() as http:
        for ch in "efgh":
            await http.post("/v1/completions", json={"model": "m", "prompt": ch * 40})
    # a second router that starts now has missed seq 0..3; the engine's ring holds 2
    # (core NATS: no event stream to read them from)
    cfg = RouterConfig(
        nats_url=nats_url,
        block_size=4,
        workers=[WorkerSpec("w0", engine.url, model="m")],
        events_transport="core",
    )
    late = RouterApp(cfg)
    served = await Served(late).start()
    try:
        pool = late.state.registry.pools["default"]
        await until(lambda: pool.ingest.last_seq("w0") == engine.seq, what="dump loaded")
        assert late.state.events.counts["dumps_loaded"] == 1
        assert pool.index.stats().workers["w0"]["gpu"] == len(engine.cache)
    finally:
        await served.stop()


async def test_without_nats_routes_on_load(make_stack, caplog):
    with caplog.at_level("WARNING"):
        stack = await make_stack(2)
    assert any("load alone" in r.message for r in caplog.records)
    assert stack.state.bus is None
    gates = [asyncio.Event(), asyncio.Event()]
    stack.engines[0].gate, stack.engines[1].gate = gates
    client = stack.client()
    busy = [
        asyncio.create_task(client.completions.create(model="m", prompt="same prompt " * 20))
        for _ in range(4)
    ]
    await until(lambda: sum(served_by(stack).values()) == 4, what="all sent")
    for gate in gates:
        gate.set()
    await asyncio.gather(*busy)
    # nothing finished meanwhile, so in-flight load alone spread the burst evenly
    assert served_by(stack) == {"w0": 2, "w1": 2}
    assert stack.state.registry.pools["default"].index.stats().blocks == 0


# -- admin -----------------------------------------------------------------------------


async def test_admin_needs_the_token(make_stack):
    stack = await make_stack(1)
    async with stack.http() as http:
        for method, path in [
            ("GET", "/admin/workers"),
            ("POST", "/admin/workers"),
            ("POST", "/admin/workers/w0/drain"),
            ("DELETE", "/admin/workers/w0"),
            ("GET", "/admin/index"),
            ("POST", "/admin/explain"),
            ("GET", "/admin/experiments"),
        ]:
            for auth in (None, "Bearer wrong", TOKEN):
                headers = {"authorization": auth} if auth else {}
                r = await http.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, auth, r.text)
                assert r.json()["error"]["code"] == "unauthorized"
        assert len(stack.state.registry) == 1


async def test_admin_workers_add_drain_remove(make_stack, nats_url):
    stack = await make_stack(1, nats_url)
    extra = await EngineDouble("w9", nats_url=nats_url).start()
    stack.engines.append(extra)
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with stack.http() as http:
        r = await http.post("/admin/workers", headers=auth, json={"id": "w9", "url": extra.url})
        assert r.status_code == 201 and r.json()["models"] == ["m"]  # learnt from /v1/models
        r = await http.post("/admin/workers/w0/drain", headers=auth)
        assert r.json()["draining"] is True
        for i in range(3):
            r = await http.post("/v1/completions", json={"model": "m", "prompt": f"q{i}" * 9})
            assert r.headers["x-cache-router-worker"] == "w9"
        pool = stack.state.registry.pools["default"]
        await until(lambda: pool.ingest.last_seq("w9") == extra.seq, what="w9 events")
        assert pool.index.stats().workers["w9"]["gpu"] > 0
        r = await http.delete("/admin/workers/w9", headers=auth)
        assert r.status_code == 200
        assert "w9" not in pool.index.stats().workers  # its blocks left with it
        r = await http.get("/admin/workers", headers=auth)
        assert [w["id"] for w in r.json()["workers"]] == ["w0"]
        r = await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503  # the only one left is draining
        r = await http.get("/admin/index", headers=auth)
        stats = r.json()["pools"]["default"]
        assert stats["events_applied"] >= 3 and "gaps" in stats and "dropped_events" in stats
        assert stats["engine_names_kept"] is True  # cache_aware sends hints over NATS


async def test_explain_scores_every_worker_without_sending(make_stack):
    stack = await make_stack(3)
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with stack.http() as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "explain me"}]}
        r = await http.post("/admin/explain", headers=auth, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert {w["worker_id"] for w in out["workers"]} == {"w0", "w1", "w2"}
        for w in out["workers"]:
            assert "ttft_ms" in w["scores"] and w["usable"]
        assert out["decision"]["worker_id"] in {"w0", "w1", "w2"}
        assert out["policy"] == "cache_aware" and out["num_tokens"] > 0
        r = await http.get("/admin/experiments", headers=auth)
        assert [a["name"] for a in r.json()["arms"]] == ["cache_aware"]
    assert served_by(stack) == {"w0": 0, "w1": 0, "w2": 0}


async def test_ab_arms_are_sticky_per_session_and_labelled(make_stack):
    arms = [Arm("rr", "round_robin"), Arm("ll", "least_load")]
    stack = await make_stack(2, arms=arms, experiment="exp1")
    experiment = stack.state.experiment
    sessions = [f"user-{i}" for i in range(12)]
    expected = {s: experiment.assign(s).name for s in sessions}
    assert set(expected.values()) == {"rr", "ll"}  # both arms get sessions
    async with stack.http() as http:
        for s in sessions:
            for _ in range(2):
                body = {"model": "m", "prompt": "hi", "user": s}
                assert (await http.post("/v1/completions", json=body)).status_code == 200
        text = (await http.get("/metrics")).text
        r = await http.get("/admin/experiments", headers={"authorization": f"Bearer {TOKEN}"})
    live = {a["name"]: a["metrics"]["requests"] for a in r.json()["arms"]}
    per_arm = {arm: 2 * sum(1 for v in expected.values() if v == arm) for arm in ("rr", "ll")}
    assert live == per_arm
    assert 'cache_router_requests_total{arm="rr",worker="w0"}' in text
    assert "cache_router_ttft_seconds_bucket{arm=" in text


async def test_breaker_opens_on_failing_worker_and_scrapes_fill_engine_load(make_stack):
    # round robin: w0 gets every other request until its breaker opens
    stack = await make_stack(2, policy="round_robin", breaker_failures=2, breaker_cooldown=60.0)
    bad = stack.engines[0]
    bad.fail_with = (500, {"error": {"message": "boom"}})
    async with stack.http() as http:
        statuses = []
        for i in range(12):
            r = await http.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"})
            statuses.append((r.status_code, r.headers["x-cache-router-worker"]))
    # the engine's 500s are sent again to w1 (router.forward.migrate) until two in a row
    # open w0's breaker: every answer is w1's
    assert all(s == (200, "w1") for s in statuses), statuses
    assert stack.state.registry.get("w0").breaker_until > 0
    text = (await stack.http().get("/metrics")).text
    assert 'cache_router_migrations_total{cause="status"} 2.0' in text
    # without NATS, engine load comes from scraping /metrics (vLLM names)
    load = stack.state.registry.get("w1").load
    await until(lambda: load.engine.kv_usage is not None, what="scraped load")
    assert load.engine.running == 0 and load.engine.waiting == 0
