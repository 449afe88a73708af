"""Embeddings, score, rerank, tokenize and detokenize through the router: per model, to
the least-loaded engine, bodies unchanged, errors in the OpenAI shape."""

from __future__ import annotations

from collections import Counter

import httpx
import openai
import pytest
from stack import Served

from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.scheduler import Timing

MODEL = "mock-model"


@pytest.fixture
async def pool():
    engines = []
    for i in range(3):
        cfg = MockEngineConfig(worker_id=f"e{i}", model=MODEL, timing=Timing(speed=100.0))
        engines.append(await MockEngine(cfg).start())
    other = await MockEngine(MockEngineConfig(worker_id="o0", model="other-model")).start()
    specs = [WorkerSpec(e.cfg.worker_id, e.url, model=MODEL) for e in engines]
    specs.append(WorkerSpec("o0", other.url, model="other-model"))
    app = RouterApp(RouterConfig(workers=specs))
    served = await Served(app).start()
    try:
        yield app, served, [*engines, other]
    finally:
        await served.stop()
        for e in [*engines, other]:
            await e.stop()


async def test_embeddings_with_the_openai_client_spread_and_follow_load(pool):
    app, served, engines = pool
    async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0) as c:
        direct = openai.AsyncOpenAI(base_url=engines[0].url + "/v1", api_key="x")
        want = (await direct.embeddings.create(model=MODEL, input=["cache", "router"])).data
        await direct.close()
        seen: Counter[str] = Counter()
        for _ in range(30):
            pair = ["cache", "router"]
            raw = await c.embeddings.with_raw_response.create(model=MODEL, input=pair)
            got = raw.parse().data
            assert [d.embedding for d in got] == [d.embedding for d in want]  # passed through
            seen[raw.headers["x-cache-router-worker"]] += 1
        assert set(seen) == {"e0", "e1", "e2"}  # ties broken at random, never "o0"
        # load-aware: requests in flight on e0 and e1 send the next ones to e2
        busy = [app.state.registry.get(w).load.begin(0) for w in ("e0", "e0", "e1")]
        try:
            for _ in range(10):
                raw = await c.embeddings.with_raw_response.create(model=MODEL, input="x")
                assert raw.headers["x-cache-router-worker"] == "e2"
        finally:
            for flight in busy:
                flight.finish()
    async with httpx.AsyncClient() as http:
        text = (await http.get(served.url + "/metrics")).text
    assert 'cache_router_passthrough_requests_total{endpoint="/v1/embeddings",worker="e2"}' in text


async def test_score_rerank_tokenize_detokenize_pass_through_per_model(pool):
    _, served, engines = pool
    bodies = {
        "/v1/score": {"model": MODEL, "text_1": "a cache", "text_2": ["a cache", "a router"]},
        "/score": {"model": MODEL, "text_1": "a", "text_2": "b"},
        "/v1/rerank": {"model": MODEL, "query": "cache", "documents": ["cache", "router"]},
        "/rerank": {"model": MODEL, "query": "cache", "documents": ["x"]},
        "/v2/rerank": {"model": MODEL, "query": "cache", "documents": ["x", "y"], "top_n": 1},
        "/tokenize": {"model": MODEL, "prompt": "hello router"},
        "/detokenize": {"model": MODEL, "tokens": [1819043176, 1870078063]},
    }
    async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
        for path, body in bodies.items():
            r = await http.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            assert r.headers["x-cache-router-worker"].startswith("e")
            d = (await http.post(engines[0].url + path, json=body)).json()
            got = r.json()
            for key in ("id", "created"):  # per-request values
                got.pop(key, None)
                d.pop(key, None)
            assert got == d, path
        tok = await http.post("/tokenize", json={"model": "other-model", "prompt": "hi"})
        assert tok.headers["x-cache-router-worker"] == "o0"
        # errors: unknown model (the router's 404), the engine's own 400, no model with two
        r = await http.post("/v1/embeddings", json={"model": "nope", "input": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await http.post("/detokenize", json={"model": MODEL, "tokens": "abc"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = await http.post("/tokenize", json={"prompt": "which model?"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = await http.post("/v1/embeddings", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


async def test_a_dead_engine_is_skipped_and_none_left_is_a_503():
    live = await MockEngine(MockEngineConfig(worker_id="live")).start()
    dead = await MockEngine(MockEngineConfig(worker_id="dead")).start()
    dead_url = dead.url
    await dead.stop()
    specs = [WorkerSpec("dead", dead_url, model=MODEL), WorkerSpec("live", live.url, model=MODEL)]
    app = RouterApp(RouterConfig(workers=specs))
    served = await Served(app).start()
    try:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            for _ in range(6):  # whoever is picked first, the request is answered
                r = await http.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
                assert r.status_code == 200 and r.headers["x-cache-router-worker"] == "live"
            await live.stop()
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
            assert r.status_code in (502, 503) and r.json()["error"]["code"] in (
                "upstream_unreachable", "no_healthy_worker")  # fmt: skip
    finally:
        await served.stop()


def test_every_raw_route_is_in_the_openapi_document():
    from router.http.openapi import completion_paths

    cfg = RouterConfig()
    paths = completion_paths(cfg)
    assert set(RouterApp(cfg).hot) <= set(paths)
    assert paths["/v1/responses/{response_id}"]["get"]
    assert paths["/v1/responses/{response_id}/cancel"]["post"]
