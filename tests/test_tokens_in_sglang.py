"""Chat tokenized once on SGLang (router.forward.tokens_in): a chat goes to an SGLang
engine's own chat endpoint with the router's ids as ``input_ids``, and the client gets the
answer it gets without them.

Two routers (chats with ids, and without) in front of one mock engine run as SGLang
(``encoding="sglang"``: ``/v1/models`` owned by ``sglang``, ``input_ids`` and
``return_prompt_token_ids`` in chat requests, ``sim.mock.sglang_chat``); the helpers are
``test_tokens_in``'s. Every answer is compared whole, but for ``created`` (a clock).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from stack import Served
from test_tokens_in import Pair, _chat, _events, _whole, close_pair, open_pair

from router.config import RouterConfig, WorkerSpec
from router.forward.tokens_in import request_reason, sglang_reason
from router.http.app import RouterApp
from sim.mock import sglang_chat
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.scheduler import Timing


def _config() -> MockEngineConfig:
    return MockEngineConfig(
        block_size=4, gpu_blocks=512, encoding="sglang", timing=Timing(speed=500.0)
    )


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = await open_pair(_config())
    try:
        yield p
    finally:
        await close_pair(p)


async def test_a_whole_answer_is_the_chat_endpoints(pair: Pair) -> None:
    whole = (await pair.post(pair.off.url, _chat(max_tokens=12), "probe")).json()
    word = whole["choices"][0]["message"]["content"].split()[2]
    for extra in (
        {},
        {"max_tokens": 5},
        {"max_completion_tokens": 3, "temperature": 0, "seed": 7},
        {"max_tokens": 12, "stop": [word]},
    ):
        before = pair.engine.tokens_in_requests
        as_chat, as_ids = await pair.both(_chat(**extra))
        assert pair.engine.tokens_in_requests == before + 1, extra  # only the one as ids
        assert _whole(as_ids) == _whole(as_chat), extra
        assert as_ids.json()["usage"]["prompt_tokens"] > 0
    assert pair.outcomes()["sent"] >= 4


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
    assert chat_events[-1] == "[DONE]"
    assert ("usage" in chat_events[-2]) is usage


async def test_what_sglangs_chat_layer_does_with_ids_goes_as_ids(pair: Pair) -> None:
    """Structured output, ``n``, other stream options: SGLang's chat layer applies them to
    ids as to a rendered chat (vLLM's generate endpoint does not: they go as chats there)."""
    cases = [
        _chat(max_tokens=4, response_format={"type": "json_object"}),
        _chat(max_tokens=4, stream=True, stream_options={"continuous_usage_stats": True}),
        _chat(max_tokens=4, echo=True),
    ]
    for body in cases:
        assert request_reason(body) is not None and request_reason(body, sglang=True) is None
        before = pair.engine.tokens_in_requests
        as_chat, as_ids = await pair.both(body)
        assert pair.engine.tokens_in_requests == before + 1, body
        if body.get("stream"):
            assert _events(as_ids) == _events(as_chat)
        else:
            assert _whole(as_ids) == _whole(as_chat)
    assert request_reason(_chat(n=2), sglang=True) is None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert request_reason(_chat(tools=tools, n=2), sglang=True) == "tools"
    assert request_reason(_chat(n=2, reasoning_effort="low"), sglang=True) == "reasoning"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    media = {"role": "user", "content": [{"type": "text", "text": "hi"}, image]}
    assert request_reason(_chat(messages=[media], n=2), sglang=True) == "media"


async def test_what_sglang_renders_its_own_way_goes_as_a_chat(pair: Pair) -> None:
    tool = {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c"}
    cases = [
        _chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "h"}]),
        _chat(add_generation_prompt=False),
        _chat(add_special_tokens=True),
        _chat(messages=[{"role": "user", "content": "hi"}, tool]),
    ]
    for body in cases:
        assert sglang_reason(body) == "field"
        before = pair.outcomes().get("field", 0)
        sent = pair.engine.tokens_in_requests
        r = await pair.post(pair.on.url, body, "fallback")
        assert r.status_code == 200, r.text
        assert pair.engine.tokens_in_requests == sent, body
        assert pair.outcomes()["field"] == before + 1
    assert sglang_reason(_chat()) is None


async def _no_ids_after_the_probe(change: Callable[[MockEngine], None]) -> None:
    engine = await MockEngine(_config()).start()
    change(engine)
    app = RouterApp(
        RouterConfig(block_size=4, workers=[WorkerSpec("w0", engine.url, model="mock-model")])
    )
    served = await Served(app).start()
    p = Pair(engine, served, served, app)
    try:
        for _ in range(200):  # until its probe has found the engine does not take the ids
            r = await p.post(served.url, _chat(max_tokens=2), "plain")
            assert r.status_code == 200, r.text
            if p.outcomes().get("engine"):
                break
            await asyncio.sleep(0.02)
        outcomes = p.outcomes()
        assert outcomes["engine"] >= 1 and outcomes.get("sent", 0) == 0, outcomes
        assert engine.tokens_in_requests == 0
    finally:
        await served.stop()
        await engine.stop()


async def test_an_engine_rendering_other_ids_gets_chats() -> None:
    """The probe's first check: the engine's own ids for the probe chat must be the router's."""

    def shift(engine: MockEngine) -> None:
        chat = engine.text.chat
        engine.text.chat = lambda body: [*chat(body), 7]  # type: ignore[method-assign]

    await _no_ids_after_the_probe(shift)


async def test_an_sglang_that_ignores_input_ids_gets_chats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second check: an SGLang from before its input_ids change renders the messages
    (and echoes their ids), so the router's ids would not be what runs: chats go as chats."""

    def ignored(body: Any) -> None:
        sglang_chat.check(body)

    monkeypatch.setattr(sglang_chat, "input_ids", ignored)
    await _no_ids_after_the_probe(lambda engine: None)


async def test_the_mock_refuses_what_sglang_refuses(pair: Pair) -> None:
    async with httpx.AsyncClient(base_url=pair.engine.url, timeout=20) as http:
        for extra, message in (
            ({"input_ids": []}, "input_ids cannot be empty."),
            ({"stream": True, "return_prompt_token_ids": True}, "not supported with streaming"),
        ):
            r = await http.post("/v1/chat/completions", json=_chat(**extra))
            assert r.status_code == 400 and message in r.json()["error"]["message"]
        r = await http.post(
            "/v1/chat/completions", json=_chat(input_ids=[5, 6, 7], return_prompt_token_ids=True)
        )
        assert r.json()["choices"][0]["prompt_token_ids"] == [5, 6, 7]
        assert r.json()["usage"]["prompt_tokens"] == 3
        models = (await http.get("/v1/models")).json()
        assert models["data"][0]["owned_by"] == "sglang"
