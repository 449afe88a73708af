"""Chat tokenized once (router.forward.tokens_in): a chat goes to an engine that takes token
ids as the router's ids, and the client gets the answer the engine's chat endpoint gives.

Two routers in front of one mock engine with vLLM's tokens-in endpoints (``scale_out``):
one sends chats as ids, the other (``chat_tokens_in`` off) as chats. The engine's cache is
cleared before each request, so both see the same engine; the same ``x-request-id`` makes
the same answer id. Every answer is compared whole, but for ``created`` (a clock).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from stack import Served

from router.config import RouterConfig, WorkerSpec
from router.forward.tokens_in import request_reason
from router.http.app import RouterApp
from sim.mock.engine import Fault, MockEngine, MockEngineConfig
from sim.mock.openai_api import stop_at
from sim.mock.scheduler import Timing

SYSTEM = "You answer about caches and routers in a few plain words. " * 3


class Pair:
    def __init__(self, engine: MockEngine, on: Served, off: Served, app: RouterApp) -> None:
        self.engine, self.on, self.off, self.app = engine, on, off, app
        self.n = 0

    async def post(self, url: str, body: dict[str, Any], rid: str) -> httpx.Response:
        for _ in range(500):  # a request the router gave up on may still hold pages
            try:
                self.engine.cache.clear()
                break
            except RuntimeError:
                await asyncio.sleep(0.01)
        else:
            raise AssertionError("the engine kept requests running")
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            return await http.post("/v1/chat/completions", json=body, headers={"x-request-id": rid})

    async def both(self, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
        """The same request through the chat path, then as ids."""
        self.n += 1
        rid = f"req-{self.n}"
        before = self.engine.tokens_in_requests
        as_chat = await self.post(self.off.url, body, rid)
        assert self.engine.tokens_in_requests == before
        as_ids = await self.post(self.on.url, body, rid)
        return as_chat, as_ids

    def outcomes(self) -> dict[str, float]:
        out = {}
        for metric in self.app.state.metrics.registry.collect():
            if metric.name == "cache_router_tokens_in":
                for s in metric.samples:
                    if s.name.endswith("_total"):
                        out[s.labels["outcome"]] = s.value
        return out


async def open_pair(engine_cfg: MockEngineConfig) -> Pair:
    """Two routers (chats as ids, and not) before one engine, its probe done."""
    engine = await MockEngine(engine_cfg).start()
    apps, served = [], []
    for on in (True, False):
        cfg = RouterConfig(
            block_size=4,
            chat_tokens_in=on,
            workers=[WorkerSpec("w0", engine.url, model="mock-model")],
        )
        app = RouterApp(cfg)
        apps.append(app)
        served.append(await Served(app).start())
    p = Pair(engine, served[0], served[1], apps[0])
    # the first chat starts the engine's probe and goes as a chat; wait for the probe
    body = {"model": "mock-model", "messages": [{"role": "user", "content": "warm up"}]}
    for _ in range(200):
        r = await p.post(p.on.url, body, "warm")
        assert r.status_code == 200, r.text
        if p.outcomes().get("sent"):
            break
        await asyncio.sleep(0.02)
    else:
        await close_pair(p)
        raise AssertionError("the router never sent a chat as ids")
    return p


async def close_pair(p: Pair) -> None:
    for s in (p.on, p.off):
        await s.stop()
    await p.engine.stop()


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    cfg = MockEngineConfig(block_size=4, gpu_blocks=512, scale_out=True, timing=Timing(speed=500.0))
    p = await open_pair(cfg)
    try:
        yield p
    finally:
        await close_pair(p)


def _whole(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    out.pop("created")
    return out


def _events(r: httpx.Response) -> list[Any]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    out = []
    for event in r.text.split("\n\n"):
        if not event:
            continue
        assert event.startswith("data: "), event
        data = event[6:]
        if data == "[DONE]":
            out.append(data)
            continue
        obj = orjson.loads(data)
        obj.pop("created")
        out.append(obj)
    return out


def _chat(**extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go on"}]
    return {"model": "mock-model", "messages": messages, **extra}


async def test_a_whole_answer_is_the_chat_endpoints(pair: Pair) -> None:
    for extra in ({}, {"max_tokens": 5}, {"max_completion_tokens": 3, "temperature": 0}):
        as_chat, as_ids = await pair.both(_chat(**extra))
        assert _whole(as_ids) == _whole(as_chat)
        assert as_ids.json()["usage"]["prompt_tokens_details"]["created_cache_tokens"] > 0
    assert pair.outcomes()["sent"] >= 3


@pytest.mark.parametrize("usage", [False, True])
async def test_a_stream_is_the_chat_endpoints_event_for_event(pair: Pair, usage: bool) -> None:
    extra: dict[str, Any] = {"stream": True, "max_tokens": 6}
    if usage:
        extra["stream_options"] = {"include_usage": True}
    before = pair.engine.tokens_in_requests
    as_chat, as_ids = await pair.both(_chat(**extra))
    assert pair.engine.tokens_in_requests == before + 1
    chat_events, id_events = _events(as_chat), _events(as_ids)
    assert id_events == chat_events
    assert chat_events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat_events[-1] == "[DONE]"
    assert ("usage" in chat_events[-2]) is usage  # the router asks usage, passes it if asked


async def test_stop_strings_end_the_text_alike(pair: Pair) -> None:
    whole = (await pair.post(pair.off.url, _chat(max_tokens=12), "probe")).json()
    text = whole["choices"][0]["message"]["content"]
    word = text.split()[2]
    for include in (False, True):
        for stream in (False, True):
            body = _chat(max_tokens=12, stop=[word], include_stop_str_in_output=include)
            if stream:
                body["stream"] = True
            as_chat, as_ids = await pair.both(body)
            if stream:
                assert _events(as_ids) == _events(as_chat)
                continue
            got = _whole(as_ids)
            assert got == _whole(as_chat)
            choice = got["choices"][0]
            assert choice["finish_reason"] == "stop" and choice["stop_reason"] == word
            assert choice["message"]["content"].endswith(word) is include


async def test_what_needs_the_chat_layer_goes_as_a_chat(pair: Pair) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    cases = {
        "tools": _chat(tools=tools),
        "structured_output": _chat(response_format={"type": "json_object"}),
        "echo": _chat(echo=True),
        "field": _chat(return_token_ids=True),
        "stream_options": _chat(stream=True, stream_options={"continuous_usage_stats": True}),
    }
    for reason, body in cases.items():
        before = pair.outcomes().get(reason, 0)
        sent = pair.engine.tokens_in_requests
        r = await pair.post(pair.on.url, body, "fallback")
        assert r.status_code == 200, r.text
        assert pair.engine.tokens_in_requests == sent, reason
        assert pair.outcomes()[reason] == before + 1
    # spelt-out absent features do not count
    assert request_reason(_chat(tools=[], echo=False, response_format={"type": "text"})) is None
    assert request_reason(_chat(n=2)) == "n"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    media = {"role": "user", "content": [{"type": "text", "text": "hi"}, image]}
    assert request_reason({"model": "m", "messages": [media]}) == "media"


async def test_an_engine_without_the_endpoint_gets_chats() -> None:
    engine = await MockEngine(MockEngineConfig(block_size=4, timing=Timing(speed=500.0))).start()
    cfg = RouterConfig(block_size=4, workers=[WorkerSpec("w0", engine.url, model="mock-model")])
    app = RouterApp(cfg)
    served = await Served(app).start()
    pair = Pair(engine, served, served, app)
    try:
        for _ in range(200):  # until its probe has found no tokens-in endpoint
            r = await pair.post(served.url, _chat(max_tokens=2), "plain")
            assert r.status_code == 200, r.text
            if pair.outcomes().get("engine"):
                break
            await asyncio.sleep(0.02)
        outcomes = pair.outcomes()
        assert outcomes["probing"] >= 1 and outcomes["engine"] >= 1 and outcomes["sent"] == 0
        assert engine.tokens_in_requests == 0
    finally:
        await served.stop()
        await engine.stop()


async def test_a_bad_answer_from_the_engine_is_an_error_never_a_chat_answer(pair: Pair) -> None:
    # an engine's error status passes as it came
    pair.engine.fault = Fault(status=400)
    r = await pair.post(pair.on.url, _chat(max_tokens=3), "bad-status")
    assert r.status_code == 400 and "injected fault" in r.json()["error"]["message"]
    # a whole answer the router cannot read: an error status (the only engine broke)
    sent = pair.engine.tokens_in_requests
    pair.engine.fault = Fault(malformed=True)
    r = await pair.post(pair.on.url, _chat(max_tokens=3), "malformed")
    assert pair.engine.tokens_in_requests == sent + 1
    assert r.status_code >= 500 and "error" in r.json()
    # a stream whose events it cannot read, or which breaks off: an error event ends it
    for fault in (Fault(malformed=True), Fault(cut_after=2)):
        pair.engine.fault = fault
        r = await pair.post(pair.on.url, _chat(max_tokens=6, stream=True), "broken")
        events = [e for e in r.text.split("\n\n") if e]
        assert r.status_code == 200 and events[-1].startswith('data: {"error"'), events
        contents = [orjson.loads(e[6:]) for e in events[:-1]]
        assert all("error" not in c and c["object"] == "chat.completion.chunk" for c in contents)
    assert pair.engine.fault is None
    # and the engine, healthy again, answers as ids
    as_chat, as_ids = await pair.both(_chat(max_tokens=4))
    assert _whole(as_ids) == _whole(as_chat)


def test_the_mock_cuts_text_at_stop_strings() -> None:
    assert stop_at(["ab", "cd", "ef"], ("de",), False) == (["ab", "c", ""], "de")
    assert stop_at(["ab", "cd", "ef"], ("de",), True) == (["ab", "cd", "e"], "de")
    assert stop_at(["ab", "cd"], ("zz",), False) == (["ab", "cd"], None)


async def test_a_lora_adapters_chats_go_as_ids_under_its_name() -> None:
    """The probe runs as the base model (the chat layer's name for it); an adapter's chat
    goes as ids with the adapter named, and answers as the engine's chat endpoint does."""
    engine = await MockEngine(
        MockEngineConfig(
            block_size=4, scale_out=True, lora_modules=("ad",), timing=Timing(speed=500.0)
        )
    ).start()
    app = RouterApp(RouterConfig(block_size=4, workers=[WorkerSpec("w0", engine.url)]))
    served = await Served(app).start()
    pair = Pair(engine, served, served, app)  # compared with the engine itself, below
    try:
        body = _chat(model="ad", max_tokens=5)
        for _ in range(200):
            r = await pair.post(served.url, body, "warm")
            if r.status_code == 200 and pair.outcomes().get("sent"):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the router never sent the adapter's chat as ids")
        for stream in (False, True):
            b = {**body, "stream": True} if stream else body
            direct = await pair.post(engine.url, b, "lora")
            routed = await pair.post(served.url, b, "lora")
            if stream:
                assert _events(routed) == _events(direct)
                assert _events(routed)[1]["model"] == "ad"
            else:
                assert _whole(routed) == _whole(direct) and routed.json()["model"] == "ad"
        assert pair.outcomes()["sent"] >= 3
    finally:
        await served.stop()
        await engine.stop()
