"""Requests that survive their engine (router/forward/migrate.py), end to end.

Three ``cache-router mock-engine`` processes, each with its node agent on a real NATS,
the router in-process. An engine is SIGKILLed or SIGSTOPped while streams run on it,
or before its first byte: every request completes on another engine, with its full
length (tokens counted), one ``[DONE]``, its usage summed; what cannot move gets
today's error. The unit tests at the end hold the splice and the continuation's body.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import orjson
import pytest
from stack import Served
from test_faults_engine import MODEL, EngineProcess, engines_behind_router

from router.config import RouterConfig, WorkerSpec
from router.forward.migrate import Broken, Splice, continuation, refusal, stall_bound
from router.http.app import RouterApp
from router.routing.decide import Parsed
from sim.mock.engine import Fault, MockEngine, MockEngineConfig
from sim.mock.scheduler import Timing

TOKENS = 240  # per stream, as issue 32 measured it
SYSTEM = "A shared system prompt every engine of this test may hold in its cache. " * 3


class SlowEngine(EngineProcess):
    """A mock engine at 4x speed (200 tokens/s per request): a kill lands mid-stream.
    ``interval``: tokens per SSE chunk after the first (vLLM's ``--stream-interval``)."""

    def __init__(self, worker_id: str, interval: int = 1) -> None:
        super().__init__(worker_id)
        self.interval = interval

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "mock-engine", "--port", str(self.port),
             "--worker-id", self.worker_id, "--model", MODEL, "--block-size", "16",
             "--gpu-blocks", "512", "--speed", "4", "--stream-interval", str(self.interval),
             "--zmq-endpoint", f"tcp://127.0.0.1:{self.zmq}",
             "--replay-endpoint", f"tcp://127.0.0.1:{self.replay}", "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)  # a test may have left it stopped
        super().stop()


class Fleet:
    def __init__(self, engines: list[SlowEngine], app: RouterApp, url: str) -> None:
        self.engines = engines
        self.app = app
        self.url = url

    def engine(self, worker_id: str) -> SlowEngine:
        return next(e for e in self.engines if e.worker_id == worker_id)

    def count(self, name: str, label: str) -> float:
        metric = getattr(self.app.state.metrics, name)
        return sum(
            s.value
            for m in metric.collect()
            for s in m.samples
            if s.name.endswith("_total") and label in s.labels.values()
        )


@pytest.fixture(params=[1], ids=["token_chunks"])
async def fleet(nats_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    engines = [SlowEngine(f"e{i}", request.param) for i in range(3)]
    settings = {"block_size": 16, "health_interval": 0.2, "health_timeout": 0.5,
                "stall_after": 1.0, "request_timeout": 20.0, "policy": "round_robin"}  # fmt: skip
    async with engines_behind_router(nats_url, engines, **settings) as (_, app, url):
        yield Fleet(engines, app, url)


def request(kind: str, i: int, stream: bool = True) -> tuple[str, dict[str, Any]]:
    """A request of ``TOKENS`` tokens (``ignore_eos``), its usage asked for."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": TOKENS, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        body["messages"] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"question {i}: tell me about caches"},
        ]
        return "/v1/chat/completions", body
    body["prompt"] = SYSTEM + f"question {i}: tell me about caches"
    return "/v1/completions", body


class Seen:
    """What one streaming client saw."""

    def __init__(self) -> None:
        self.worker = ""
        self.status = 0
        self.tokens = 0  # chunks with content
        self.text = ""
        self.done = 0  # [DONE] events
        self.errors: list[Any] = []
        self.usage: dict[str, Any] | None = None
        self.ids: set[str] = set()
        self.roles = 0


async def watch(
    http: httpx.AsyncClient, kind: str, i: int, started: asyncio.Event | None = None
) -> Seen:
    path, body = request(kind, i)
    seen = Seen()
    async with http.stream("POST", path, json=body) as resp:
        seen.status = resp.status_code
        seen.worker = resp.headers.get("x-cache-router-worker", "")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                seen.done += 1
                continue
            obj = orjson.loads(line[6:])
            if "error" in obj:
                seen.errors.append(obj["error"])
                continue
            seen.ids.add(obj["id"])
            if obj.get("usage"):
                seen.usage = obj["usage"]
            for choice in obj["choices"]:
                piece = choice["delta"].get("content") if kind == "chat" else choice["text"]
                seen.roles += kind == "chat" and "role" in choice["delta"]
                if piece:
                    seen.tokens += 1
                    seen.text += piece
            if started is not None and seen.tokens == 5:
                started.set()
    return seen


def complete(seen: Seen, prompt_tokens: int | None = None) -> None:
    """One uninterrupted stream of its full length: ``TOKENS`` tokens, one [DONE], one
    id, one role chunk, no error, the usage summed."""
    assert seen.status == 200 and not seen.errors, seen.errors
    assert len(seen.text) == 4 * TOKENS, len(seen.text)  # the mock: 4 characters a token
    assert seen.done == 1 and len(seen.ids) == 1
    assert seen.roles <= 1
    assert seen.usage is not None and seen.usage["completion_tokens"] == TOKENS
    if prompt_tokens is not None:
        assert seen.usage["prompt_tokens"] == prompt_tokens
    assert seen.usage["total_tokens"] == seen.usage["prompt_tokens"] + TOKENS


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
async def test_streams_on_a_broken_engine_complete_elsewhere(
    fleet: Fleet, kind: str, fault: signal.Signals
) -> None:
    """Issue 32's case: 12 streams of 240 tokens, round robin over 3 engines; one engine
    is killed (or stopped: its health checks fail and it is silent past ``stall_after``)
    once every stream has its first tokens. Every stream completes with its full length
    on another engine."""
    await kill_or_stop_under_streams(fleet, kind, fault)


async def kill_or_stop_under_streams(fleet: Fleet, kind: str, fault: signal.Signals) -> None:
    async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as http:
        starts = [asyncio.Event() for _ in range(12)]
        tasks = [asyncio.create_task(watch(http, kind, i, starts[i])) for i in range(12)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 30)
        victim = fleet.engines[0]
        victim.signal(fault)
        seen = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    on_victim = [s for s in seen if s.worker == victim.worker_id]
    assert on_victim, "round robin put no stream on the victim"
    for s in seen:
        complete(s)
    cause = "connection" if fault == signal.SIGKILL else "stall"
    assert fleet.count("migrations", cause) >= len(on_victim)
    assert fleet.count("not_migrated", "limit") == 0


@pytest.mark.parametrize("fleet", [4], ids=["four_token_chunks"], indirect=True)
@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_a_stream_of_several_tokens_a_chunk_continues_with_the_right_count(
    fleet: Fleet, kind: str
) -> None:
    """Engines sending four tokens a chunk (vLLM ``--stream-interval 4``): the tokens a
    broken leg sent are counted from its text (4 bytes a token for the mock's text and
    the router's fallback tokenizer), not one a chunk, which asked the continuation for
    3x too many and made each migrated answer too long."""
    await kill_or_stop_under_streams(fleet, kind, signal.SIGKILL)


async def test_a_stopped_engine_gets_no_request_answered_late(fleet: Fleet) -> None:
    """An engine SIGSTOPped before its first byte: 9 requests (whole and streamed), a
    third of them sent to it before its health checks fail; each is answered 200 by
    another engine (they got 504s after ~5 s)."""
    victim = fleet.engines[0]
    victim.signal(signal.SIGSTOP)
    async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as http:

        async def whole(i: int) -> tuple[int, str, int]:
            path, body = request("completion", i, stream=False)
            r = await http.post(path, json=body)
            tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
            return r.status_code, r.headers.get("x-cache-router-worker", ""), tokens

        results = await asyncio.wait_for(asyncio.gather(*(whole(i) for i in range(6))), 60)
        streams = await asyncio.wait_for(
            asyncio.gather(*(watch(http, "chat", i) for i in range(3))), 60
        )
    for status, worker, tokens in results:
        assert status == 200 and worker != victim.worker_id and tokens == TOKENS
    for s in streams:
        complete(s)
        assert s.worker != victim.worker_id
    assert fleet.count("errors", "stall") >= 1  # sent to it, then to another


async def test_a_whole_answer_is_sent_again_when_its_engine_dies(fleet: Fleet) -> None:
    victim = fleet.engines[0]
    async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as http:
        path, body = request("completion", 5, stream=False)
        body["max_tokens"] = 4 * TOKENS  # long enough to be running when the kill comes
        pending = [asyncio.create_task(http.post(path, json=body)) for _ in range(3)]
        await asyncio.sleep(1.0)
        victim.signal(signal.SIGKILL)
        answers = await asyncio.wait_for(asyncio.gather(*pending), 60)
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.headers["x-cache-router-worker"] != victim.worker_id
        assert r.json()["usage"]["completion_tokens"] == 4 * TOKENS
    assert fleet.count("migrations", "connection") >= 1


async def test_what_cannot_move_gets_the_error_event_and_is_counted(fleet: Fleet) -> None:
    """``logprobs``: not migratable. The stream ends with today's error event."""
    victim = fleet.engines[0]
    async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as http:
        path, body = request("completion", 7)
        body["logprobs"] = 1
        errors: list[Any] = []
        for _ in range(3):  # round robin: one of three lands on the victim
            async with http.stream("POST", path, json=body) as resp:
                worker = resp.headers["x-cache-router-worker"]
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line:
                        errors.append(orjson.loads(line[6:])["error"])
                    elif (
                        line.startswith("data: {")
                        and worker == victim.worker_id
                        and victim.proc is not None
                        and victim.proc.poll() is None
                    ):
                        victim.signal(signal.SIGKILL)
            if worker == victim.worker_id:
                break
    assert [e["code"] for e in errors] == ["upstream_broken"]
    assert fleet.count("not_migrated", "logprobs") == 1


# -- streams stuck on an engine that looks healthy ------------------------------------


@contextlib.asynccontextmanager
async def live_pair(**settings: Any) -> AsyncIterator[tuple[list[MockEngine], RouterApp, str]]:
    """Two in-process mock engines (their faults set by the test) behind a router with
    no NATS, round robin."""
    cfg = MockEngineConfig(model=MODEL, timing=Timing(speed=4))
    async with (
        MockEngine(replace(cfg, worker_id="a")) as a,
        MockEngine(replace(cfg, worker_id="b")) as b,
    ):
        workers = [WorkerSpec(e.cfg.worker_id, e.url, model=MODEL) for e in (a, b)]
        app = RouterApp(RouterConfig(workers=workers, policy="round_robin", **settings))
        served = await Served(app).start()
        try:
            yield [a, b], app, served.url
        finally:
            await served.stop()


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("cut_after", [0, 20], ids=["before_first_token", "mid_stream"])
async def test_a_stream_stuck_on_a_healthy_engine_moves_on(kind: str, cut_after: int) -> None:
    """An engine that stays healthy (its health checks pass) goes silent in one stream,
    before its first token or after 20: the stream moves to the other engine after the
    stall bound (1 s here; 30 s after the first token and 60 s per 8K prompt tokens
    before it by default), not at ``request_timeout`` (60 s here), and completes."""
    settings = {"token_stall_after": 1.0, "first_token_stall_after": 1.0,
                "request_timeout": 60.0, "health_interval": 0.2}  # fmt: skip
    async with live_pair(**settings) as (engines, app, url):
        fleet = Fleet([], app, url)
        engines[0].fault = Fault(cut_after=cut_after, stall=True)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            # within 30 s: request_timeout (60 s) would end it only later
            seen = await asyncio.wait_for(watch(http, kind, 3), 30)
        assert seen.worker == "a"  # round robin's first: the stuck one
        complete(seen)
        assert fleet.count("migrations", "stall") == 1
        assert app.state.registry.get("a").healthy  # it looked healthy all along


def test_the_bound_before_the_first_token_grows_with_the_prompt() -> None:
    cfg = RouterConfig(first_token_stall_after=60.0, token_stall_after=30.0, request_timeout=3600)
    assert stall_bound(cfg, 500, started=False) == 60.0
    assert stall_bound(cfg, 128 * 1024, started=False) == 16 * 60.0  # a 128K prefill
    assert stall_bound(cfg, 128 * 1024, started=True) == 30.0
    off = RouterConfig(first_token_stall_after=0.0, token_stall_after=0.0, request_timeout=9.0)
    assert stall_bound(off, 500, started=False) == stall_bound(off, 500, started=True) == 9.0
    assert stall_bound(cfg, 10**6, started=False) == cfg.request_timeout  # capped


# -- the splice and the continuation, without engines ----------------------------------


def chunk(kind: str, piece: str | None, *, role: bool = False, finish: str | None = None,
          cid: str = "a", usage: dict[str, Any] | None = None) -> bytes:  # fmt: skip
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if piece is not None:
            delta["content"] = piece
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": piece or "", "finish_reason": finish}
    obj: dict[str, Any] = {"id": cid, "created": 1, "model": "m", "choices": [choice]}
    if usage is not None:
        obj = {"id": cid, "created": 1, "model": "m", "choices": [], "usage": usage}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def letters(text: str) -> int:
    """A tokenizer of one token a character, for the splice's unit tests."""
    return len(text)


def test_the_splice_sends_whole_events_and_reads_as_one_stream() -> None:
    splice = Splice("chat", prompt_tokens=30, count=letters)
    first = chunk("chat", None, role=True) + chunk("chat", "he") + chunk("chat", "llo")
    cut = chunk("chat", " wor")
    out = splice.feed(first + cut[:9])  # the break cuts an event: it is held back
    assert out == first and splice.text == ["he", "llo"] and splice.tokens == 5
    splice.next_leg()  # the second engine: its role chunk goes, its id becomes the first's
    second = chunk("chat", None, role=True, cid="b") + chunk("chat", " world", cid="b")
    second += chunk("chat", "", finish="length", cid="b")
    usage = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
             "prompt_tokens_details": {"cached_tokens": 36}}  # fmt: skip
    second += chunk("chat", None, usage=usage, cid="b") + b"data: [DONE]\n\n"
    events = [e for e in splice.feed(second).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and splice.done and splice.finished
    objs = [orjson.loads(e[6:]) for e in events[:-1]]
    assert {o["id"] for o in objs} == {"a"} and len(objs) == 3  # no second role chunk
    assert objs[-1]["usage"] == {
        "prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37,
        "prompt_tokens_details": {"cached_tokens": 30},
    }  # fmt: skip


def test_an_error_event_is_a_break_and_tool_calls_cannot_move() -> None:
    splice = Splice("completion", prompt_tokens=3, count=letters)
    ok = chunk("completion", "x")
    out = splice.feed(ok + b'data: {"error": {"message": "dead"}}\n\n' + ok)
    # what came before the error goes on and is counted; the error and after it do not
    assert out == ok and splice.text == ["x"] and splice.tokens == 1
    assert isinstance(splice.broken, Broken) and splice.broken.cause == "error_event"
    calls = Splice("chat", prompt_tokens=3, count=letters)
    tool = {"id": "a", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}
    calls.feed(b"data: " + orjson.dumps(tool) + b"\n\n")
    assert calls.blocked() == "tool_call"


def parsed(kind: str, body: dict[str, Any]) -> Parsed:
    messages = body.get("messages") if kind == "chat" else None
    return Parsed(kind, body, "m", bool(body.get("stream")), None, "r", messages)  # type: ignore[arg-type]


def test_the_continuation_carries_the_text_so_far() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
            "min_tokens": 4, "stream": True}  # fmt: skip
    body = continuation(parsed("chat", chat), "the cache", 3, lambda t: [])
    assert body is not None
    assert body["messages"][-1] == {"role": "assistant", "content": "the cache"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert (body["max_tokens"], body["min_tokens"]) == (7, 1)
    assert continuation(parsed("chat", chat), "x" * 40, 10, lambda t: []) is None  # all sent
    ids = {"model": "m", "prompt": [1, 2, 3], "max_completion_tokens": 5}
    body = continuation(parsed("completion", ids), "ab", 1, lambda t: [ord(c) for c in t])
    assert body is not None and body["prompt"] == [1, 2, 3, 97, 98]
    assert body["max_completion_tokens"] == 4
    text = {"model": "m", "prompt": ["once upon"]}
    body = continuation(parsed("completion", text), " a time", 2, lambda t: [])
    assert body is not None and body["prompt"] == "once upon a time"


@pytest.mark.parametrize(
    ("kind", "fields", "why"),
    [
        ("chat", {"n": 2}, "n"),
        ("chat", {"logprobs": True, "top_logprobs": 2}, "logprobs"),
        ("completion", {"echo": True}, "echo"),
        ("completion", {"suffix": "end"}, "suffix"),
        ("completion", {"prompt": ["a", "b"]}, "prompts"),
        ("chat", {"response_format": {"type": "json_object"}}, "structured_output"),
        ("chat", {"guided_regex": "a+"}, "structured_output"),
        ("responses", {}, "api"),
        ("messages", {}, "api"),
        ("chat", {"tools": [{"type": "function"}]}, None),  # refused only mid-call
        ("chat", {"response_format": {"type": "text"}}, None),
    ],
)
def test_what_cannot_move_is_named(kind: str, fields: dict[str, Any], why: str | None) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "p"}
    assert refusal(parsed(kind, body | fields), gateway=False) == why
    assert refusal(parsed("chat", body), gateway=True) == "gateway"
