"""A chat tokenized once, on a real vLLM (``--enable-scale-out``): the router sends chats
to ``/inference/v1/generate`` as its token ids (router.forward.tokens_in), and the client
gets exactly the answer vLLM's own chat endpoint gives.

Each seeded request (temperature 0, or a seed) goes once straight to the engine's
``/v1/chat/completions`` and once through the router, with the engine's prefix cache
reset before each (``VLLM_SERVER_DEV_MODE``'s ``POST /reset_prefix_cache``) and the same
``x-request-id`` (vLLM names the answer after it): whole answers must be equal but for
``created`` (a clock), usage with ``cached_tokens`` and ``created_cache_tokens`` included;
streams must say the same (role, text, logprobs, finish, usage, one ``[DONE]``), however
the engine's steps cut them into events (a loaded machine cuts two streams of the same
tokens differently: seen once at 12 events against 11). Then a conversation growing turn
by turn, warm: the router's ``cached_tokens`` are vLLM's.

The same for Responses requests (router.forward.responses_out): each asked of vLLM's
``/v1/responses`` and through the router, as ids, with the same ``request_id``; whole
answers equal but for the clock and the output item's random id, streams equal in what
they say (event types in order with a run of deltas as one, text, logprobs, every other
event whole). Requests the router cannot render exactly go as they came, and on an engine
that keeps responses (``VLLM_ENABLE_RESPONSES_API_STORE=1``) those to keep do too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
import pytest
from stack import Served
from vllm_engine import BLOCK, MODEL, Engine, engine_python, running

from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp

B = TypeVar("B", bound="Both")
SYSTEM = "You are a terse assistant of the cache router test. " * 4


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    work = tmp_path_factory.mktemp("vllm-tokens-in")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
    e = Engine("t0", engine_python(), model_dir, work, env, extra=("--enable-scale-out",))
    with running([e]):
        yield e


def outcome(app: RouterApp, name: str) -> float:
    for metric in app.state.metrics.registry.collect():
        if metric.name == "cache_router_tokens_in":
            for s in metric.samples:
                if s.name.endswith("_total") and s.labels["outcome"] == name:
                    return s.value
    return 0.0


class Both:
    def __init__(self, engine: Engine, router: Served, app: RouterApp) -> None:
        self.engine, self.router, self.app = engine, router, app
        self.http = httpx.AsyncClient(timeout=120)
        self.n = 0

    def sent(self) -> float:
        return outcome(self.app, "sent")

    async def reset(self) -> None:
        for _ in range(100):
            r = await self.http.post(self.engine.url + "/reset_prefix_cache")
            if r.status_code == 200 and r.json().get("success", True):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"the engine's cache never reset: {r.text}")

    async def post(self, base: str, body: dict[str, Any], rid: str) -> httpx.Response:
        url = base + "/v1/chat/completions"
        r = await self.http.post(url, json=body, headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
        return r

    async def both(self, body: dict[str, Any]) -> tuple[Any, Any]:
        """The engine's chat answer and the router's tokens-in one, each on a cold cache."""
        self.n += 1
        rid = f"tin-{self.n}"
        await self.reset()
        direct = await self.post(self.engine.url, body, rid)
        await self.reset()
        before = self.sent()
        routed = await self.post(self.router.url, body, rid)
        assert self.sent() == before + 1, "the router sent it as a chat"
        return parsed(direct), parsed(routed)


def parsed(r: httpx.Response) -> Any:
    if not r.headers["content-type"].startswith("text/event-stream"):
        out = r.json()
        out.pop("created")
        return out
    events: list[Any] = []
    for event in r.text.split("\n\n"):
        if event:
            data = event.removeprefix("data: ")
            obj = data if data == "[DONE]" else orjson.loads(data)
            if isinstance(obj, dict):
                obj.pop("created")
            events.append(obj)
    return events


def folded(events: list[Any]) -> dict[str, Any]:
    """A stream as what it says, not how it was cut: vLLM sends the tokens a step made as
    one event, so on a loaded machine two streams of the same tokens are cut differently.
    The role, the text, the logprobs in order, the finish, the usage, one [DONE]."""
    out: dict[str, Any] = {"role": None, "content": "", "logprobs": [], "finish_reason": None,
                           "usage": None, "done": events.count("[DONE]")}  # fmt: skip
    for event in events:
        if event == "[DONE]":
            continue
        out["model"] = event["model"]
        if event.get("usage"):
            out["usage"] = event["usage"]
        for choice in event["choices"]:
            delta = choice.get("delta", {})
            out["role"] = delta.get("role", out["role"])
            out["content"] += delta.get("content") or ""
            out["logprobs"] += (choice.get("logprobs") or {}).get("content") or []
            out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    return out


@contextlib.asynccontextmanager
async def served(
    cls: type[B], engine: Engine, model_dir: Path, warm: dict[str, Any], rid: str, never: str
) -> AsyncIterator[B]:
    """A router in front of ``engine``, warmed until it sends ``warm`` as ids (the first
    requests start the probe and go as they came)."""
    cfg = RouterConfig(
        block_size=BLOCK,
        tokenizer=str(model_dir),
        workers=[WorkerSpec(engine.name, engine.url, model=MODEL)],
    )
    app = RouterApp(cfg)
    router = await Served(app).start()
    b = cls(engine, router, app)
    try:
        for _ in range(300):
            await b.post(router.url, warm, rid)
            if b.sent():
                break
            await asyncio.sleep(0.2)
        assert b.sent(), never
        yield b
    finally:
        await b.http.aclose()
        await router.stop()


@pytest.fixture
async def both(engine: Engine, model_dir: Path) -> AsyncIterator[Both]:
    warm = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    never = "the router never found the engine's tokens-in endpoint"
    async with served(Both, engine, model_dir, warm, "warm", never) as b:
        yield b


def chat(user: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"model": MODEL, "messages": messages, **extra}


@pytest.mark.timeout(900)
async def test_the_same_answers_as_vllms_chat_endpoint(both: Both) -> None:
    bodies = [
        chat("Say hello.", max_tokens=12, temperature=0),
        chat("Count to five.", max_tokens=16, temperature=0.8, seed=7),
        chat("Name a colour.", max_completion_tokens=8, temperature=0.7, top_p=0.9, seed=3),
        chat("And again.", max_tokens=6, temperature=0, logprobs=True, top_logprobs=2),
        chat("Once more.", max_tokens=4, temperature=0, logprobs=True),
        chat("Go on.", temperature=0, max_tokens=10, presence_penalty=0.5, min_tokens=3),
    ]
    for body in bodies:
        direct, routed = await both.both(body)
        assert routed == direct, body
    # stop strings: stop at a piece of what the model says
    direct, _ = await both.both(chat("Say hello.", max_tokens=12, temperature=0))
    text = direct["choices"][0]["message"]["content"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    for include in (False, True):
        body = chat("Say hello.", max_tokens=12, temperature=0, stop=[stop],
                    include_stop_str_in_output=include)  # fmt: skip
        direct, routed = await both.both(body)
        assert routed == direct and routed["choices"][0]["finish_reason"] == "stop"
        streamed_direct, streamed = await both.both({**body, "stream": True})
        assert folded(streamed) == folded(streamed_direct)


@pytest.mark.timeout(900)
async def test_the_same_streams_as_vllms_chat_endpoint(both: Both) -> None:
    usage = {"include_usage": True}
    bodies = [
        chat("Say hello.", max_tokens=12, temperature=0, stream=True),
        chat("Say hello.", max_tokens=12, temperature=0, stream=True, stream_options=usage),
        chat("Count.", max_tokens=9, temperature=0.9, seed=11, stream=True, stream_options=usage),
        chat("Go.", max_tokens=3, temperature=0, logprobs=True, top_logprobs=1, stream=True),
    ]
    for body in bodies:
        direct, routed = await both.both(body)
        assert folded(routed) == folded(direct), body
        assert routed[-1] == "[DONE]" and routed[0]["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.timeout(900)
async def test_a_growing_conversation_hits_as_vllm_says(both: Both) -> None:
    """Warm turns through the router, every one as ids: the engine's cache serves each
    turn's conversation so far."""
    await both.reset()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    cached = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"turn {turn}: tell me more " * 8})
        before = both.sent()
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        r = await both.post(both.router.url, body, f"conv-{turn}")
        assert both.sent() == before + 1
        answer = r.json()
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        reply = answer["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
    assert cached[0] == 0 and all(c >= BLOCK for c in cached[1:])


# -- the Responses API (router.forward.responses_out) --------------------------------------
class BothResponses(Both):
    async def post(self, base: str, body: dict[str, Any], rid: str) -> httpx.Response:
        r = await self.http.post(base + "/v1/responses", json=body)
        assert r.status_code == 200, r.text
        return r

    async def both(self, body: dict[str, Any]) -> tuple[Any, Any]:
        """The engine's Responses answer and the router's tokens-in one, each on a cold
        cache; the same ``request_id`` names both."""
        self.n += 1
        body = {**body, "request_id": f"resp_tin{self.n}"}
        await self.reset()
        direct = await self.post(self.engine.url, body, "")
        await self.reset()
        before = self.sent()
        routed = await self.post(self.router.url, body, "")
        assert self.sent() == before + 1, "the router sent it as it came"
        return responses_parsed(direct), responses_parsed(routed)


def comparable(response: dict[str, Any]) -> dict[str, Any]:
    """A response object without its clock and its output items' random ids."""
    out = {k: v for k, v in response.items() if k != "created_at"}
    out["output"] = [{k: v for k, v in item.items() if k != "id"} for item in out["output"]]
    return out


def responses_parsed(r: httpx.Response) -> Any:
    if not r.headers["content-type"].startswith("text/event-stream"):
        return comparable(r.json())
    return [orjson.loads(e.split("\ndata: ", 1)[1]) for e in r.text.split("\n\n") if e]


def responses_folded(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A Responses stream as what it says, not how the engine's steps cut it: the event
    types in order (a run of deltas as one), the text and logprobs of the deltas, every
    sequence number in order, and each non-delta event whole (but for ids and clocks)."""
    types: list[str] = []
    text = ""
    logprobs: list[Any] = []
    others = []
    for event in events:
        kind = event["type"]
        if kind == "response.output_text.delta":
            text += event["delta"]
            logprobs += event["logprobs"]
            if types[-1] == kind:
                continue
        else:
            rest = {k: v for k, v in event.items() if k not in ("sequence_number", "item_id")}
            if "response" in rest:
                rest["response"] = comparable(rest["response"])
            if "item" in rest:
                rest["item"] = {k: v for k, v in rest["item"].items() if k != "id"}
            others.append(rest)
        types.append(kind)
    numbers = [e["sequence_number"] for e in events]
    assert numbers == list(range(len(events))), numbers
    ids = {e["item_id"] for e in events if "item_id" in e}
    assert len(ids) <= 1, ids
    return {"types": types, "text": text, "logprobs": logprobs, "events": others}


@pytest.fixture
async def both_responses(engine: Engine, model_dir: Path) -> AsyncIterator[BothResponses]:
    warm = {"model": MODEL, "input": "hi", "max_output_tokens": 1}
    never = "the router never took the engine's Responses answer as its own"
    async with served(BothResponses, engine, model_dir, warm, "", never) as b:
        yield b


def responses(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "instructions": SYSTEM, "input": text, **extra}


ITEMS = [
    {"role": "user", "content": "Tell me about caches."},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "They keep things."}]},
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "input_text", "text": "And routers?"}]},
]  # fmt: skip
LOGPROBS = ["message.output_text.logprobs"]


@pytest.mark.timeout(900)
async def test_the_same_responses_as_vllms_responses_endpoint(
    both_responses: BothResponses,
) -> None:
    both = both_responses
    bodies = [
        responses("Say hello.", max_output_tokens=12, temperature=0),
        responses("Count to five.", max_output_tokens=16, temperature=0.8, seed=7),
        responses(
            "Name a colour.",
            max_output_tokens=8,
            temperature=0.7,
            top_p=0.9,
            seed=3,
            metadata={"k": "v"},
            user="u1",
            service_tier="default",
        ),
        responses(
            "And again.", max_output_tokens=6, temperature=0, include=LOGPROBS, top_logprobs=2
        ),
        responses("Once more.", max_output_tokens=4, temperature=0, include=LOGPROBS),
        responses(
            "Go on.",
            max_output_tokens=10,
            temperature=0,
            presence_penalty=0.5,
            store=False,
            parallel_tool_calls=False,
        ),
        {"model": MODEL, "input": ITEMS, "max_output_tokens": 7, "temperature": 0},
    ]
    for body in bodies:
        direct, routed = await both.both(body)
        assert routed == direct, body
        direct, routed = await both.both({**body, "stream": True})
        assert responses_folded(routed) == responses_folded(direct), body
    # stop strings: stop at a piece of what the model says
    direct, _ = await both.both(responses("Say hello.", max_output_tokens=12, temperature=0))
    text = direct["output"][0]["content"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    for include in (False, True):
        body = responses("Say hello.", max_output_tokens=12, temperature=0, stop=[stop],
                         include_stop_str_in_output=include)  # fmt: skip
        direct, routed = await both.both(body)
        assert routed == direct and routed["status"] == "completed"
        direct, routed = await both.both({**body, "stream": True})
        assert responses_folded(routed) == responses_folded(direct)


@pytest.mark.timeout(900)
async def test_responses_the_router_cannot_render_go_as_they_came(
    both_responses: BothResponses,
) -> None:
    """Tools, a reasoning item, two text parts: the engine's own Responses layer answers."""
    both = both_responses
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    cases = {
        "tools": responses("Say hello.", max_output_tokens=3, tools=[tool]),
        "field": {"model": MODEL, "max_output_tokens": 3, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                         {"type": "input_text", "text": "b"}]}]},
    }  # fmt: skip
    for reason, body in cases.items():
        before, sent = outcome(both.app, reason), both.sent()
        r = await both.http.post(both.router.url + "/v1/responses", json=body)
        assert r.status_code == 200, r.text
        assert outcome(both.app, reason) == before + 1 and both.sent() == sent


@pytest.mark.timeout(900)
async def test_a_growing_responses_conversation_hits_as_vllm_says(
    both_responses: BothResponses,
) -> None:
    """Warm turns through the router, every one as ids (the input items growing): the
    engine's cache serves each turn's conversation so far."""
    both = both_responses
    await both.reset()
    items: list[dict[str, Any]] = []
    cached = []
    for turn in range(4):
        items.append({"role": "user", "content": f"turn {turn}: tell me more " * 8})
        before = both.sent()
        body = responses("", max_output_tokens=8, temperature=0) | {"input": items}
        answer = (await both.post(both.router.url, body, "")).json()
        assert both.sent() == before + 1
        cached.append(answer["usage"]["input_tokens_details"]["cached_tokens"])
        reply = answer["output"][0]["content"][0]["text"]
        items.append({"role": "assistant", "content": reply})
    assert cached[0] == 0 and all(c >= BLOCK for c in cached[1:])


@pytest.fixture(scope="module")
def store_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A vLLM that keeps responses (``VLLM_ENABLE_RESPONSES_API_STORE=1``)."""
    work = tmp_path_factory.mktemp("vllm-store")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    e = Engine("t1", engine_python(), model_dir, work, env, extra=("--enable-scale-out",))
    with running([e]):
        yield e


@pytest.mark.timeout(900)
async def test_an_engine_that_keeps_responses_gets_the_ones_to_keep(
    store_engine: Engine, model_dir: Path
) -> None:
    """The probe finds the store (without making a response); a request with ``store`` (true
    by default) goes to the engine's Responses layer, which keeps it for a
    ``previous_response_id``; one with ``store: false`` goes as ids."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "store": False}
    never = "the router never took the engine's answer as its own"
    async with served(BothResponses, store_engine, model_dir, body, "", never) as b:
        app, url = b.app, b.router.url
        stored = outcome(app, "stored")
        r = await b.post(url, {**body, "store": True}, "")
        assert outcome(app, "stored") == stored + 1
        kept = await b.http.get(f"{store_engine.url}/v1/responses/{r.json()['id']}")
        assert kept.status_code == 200, kept.text
        follow = {**body, "input": "more", "previous_response_id": r.json()["id"]}
        await b.post(url, follow, "")
        assert outcome(app, "stored") == stored + 2
