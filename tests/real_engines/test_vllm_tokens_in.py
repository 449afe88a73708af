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
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from stack import Served
from vllm_engine import BLOCK, MODEL, Engine, engine_python, running

from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp

SYSTEM = "You are a terse assistant of the cache router test. " * 4


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    work = tmp_path_factory.mktemp("vllm-tokens-in")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
    e = Engine("t0", engine_python(), model_dir, work, env, extra=("--enable-scale-out",))
    with running([e]):
        yield e


class Both:
    def __init__(self, engine: Engine, router: Served, app: RouterApp) -> None:
        self.engine, self.router, self.app = engine, router, app
        self.http = httpx.AsyncClient(timeout=120)
        self.n = 0

    def sent(self) -> float:
        for metric in self.app.state.metrics.registry.collect():
            if metric.name == "cache_router_tokens_in":
                for s in metric.samples:
                    if s.name.endswith("_total") and s.labels["outcome"] == "sent":
                        return s.value
        return 0.0

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


@pytest.fixture
async def both(engine: Engine, model_dir: Path) -> AsyncIterator[Both]:
    cfg = RouterConfig(
        block_size=BLOCK,
        tokenizer=str(model_dir),
        workers=[WorkerSpec(engine.name, engine.url, model=MODEL)],
    )
    app = RouterApp(cfg)
    router = await Served(app).start()
    b = Both(engine, router, app)
    try:
        warm = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for _ in range(300):  # the first chats start the probe and go as chats
            await b.post(router.url, warm, "warm")
            if b.sent():
                break
            await asyncio.sleep(0.2)
        assert b.sent(), "the router never found the engine's tokens-in endpoint"
        yield b
    finally:
        await b.http.aclose()
        await router.stop()


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
