"""The test stacks, in one module (not a test module): what the end-to-end tests run.

- ``until``: a bounded poll; ``Served``: an ASGI app under uvicorn on a loopback port.
- ``EngineDouble``: a small engine for the router's end-to-end tests: a real HTTP server
  on a loopback port speaking the OpenAI completions/chat API (SSE included,
  ``usage.prompt_tokens_details.cached_tokens`` reported), with a paged prefix cache
  keyed by the engine's *own* block hashes, publishing KV events on a real NATS exactly
  as the node agent does (msgpack batch from ``index.codec.encode``, ``Kv-Seq`` and
  ``Kv-Epoch`` headers) and answering ``kv.replay.<id>`` per ``index/gapfill.py``. It
  tokenizes with the router's tokenizer classes, as a real engine uses the model's.
- ``DoubleStack`` (fixture ``make_stack`` in conftest.py): engine doubles behind one
  router, in-process.
- ``MockStack`` and ``Replica``: mock engines (``sim.mock.engine``, KV events over ZMQ;
  ``mock_engine_config`` for any engine shape) behind real node agents, which create the
  event stream, and router replicas serving HTTP in-process, for every test of the whole
  event path (replicas, capacity, NATS faults, LoRA, media, hybrid models); ``hits`` reads
  one completion's predicted and engine-reported cached tokens.
- ``mock_engine_agent`` and ``EngineStack``: a mock engine with its node agents (one per
  DP rank, named as the router names the rank) and engines by id behind one router, for
  the PD, PD-DP and DP-rank tests.
"""

from __future__ import annotations

import asyncio
import socket
import time
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, cast

import httpx
import nats
import openai
import orjson
import uvicorn
import xxhash
from nats.aio.client import Client
from nats.aio.msg import Msg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from agent.node import AgentConfig, NodeAgent
from index.codec import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode
from index.gapfill import GapFillMessage, GapFillRequest
from index.wire import DEFAULT_PREFIX, DP_RANK_HEADER, EPOCH_HEADER, SEQ_HEADER, Subjects
from router.config import RouterConfig, WorkerSpec
from router.events.bus import subscriptions_in_place
from router.events.consumer import last_seq
from router.http.app import RouterApp
from router.tokens.tokenize import FallbackTokenizer, Tokenizer
from router.workers.dp import target_id
from sim.mock.engine import MockEngine, MockEngineConfig, Rank
from sim.mock.scheduler import Timing

ENGINE_SEED = 0x5EED  # engine hashes are not the router's: different function and seed


async def until(check: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


subscribed = subscriptions_in_place  # the agent's own check, for test clients


class Served:
    """An ASGI app under uvicorn on a free loopback port, in the running event loop."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        # Bound here and handed to uvicorn: a port picked free and bound later was taken by
        # another test's server in between once under load (EADDRINUSE in test_replicas).
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port or 0))
        self.port: int = self.sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="on",
                timeout_graceful_shutdown=5,
            )
        )
        self.task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Served:
        self.server.config.setup_event_loop = lambda: None  # type: ignore[method-assign]
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        deadline = time.monotonic() + 10
        while not self.server.started:
            if self.task.done():
                self.task.result()
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await asyncio.wait_for(self.task, 10)


class EngineDouble:
    """One fake engine: HTTP API + prefix cache + KV events on NATS + replay answers."""

    def __init__(
        self,
        worker_id: str,
        *,
        model: str = "m",
        block_size: int = 4,
        nats_url: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        tokenizer: Tokenizer | None = None,
        capacity: int = 10_000,
        ring: int = 1000,
    ) -> None:
        self.worker_id = worker_id
        self.model = model
        self.block_size = block_size
        self.nats_url = nats_url
        self.prefix = prefix
        self.subjects = Subjects(prefix)
        self.tokenizer = tokenizer or FallbackTokenizer()
        self.capacity = capacity
        self.ring_size = ring
        self.cache: OrderedDict[int, list[int]] = OrderedDict()  # engine hash -> tokens (LRU)
        self.parent: dict[int, int | None] = {}
        self.seq = -1
        self.epoch = f"{worker_id}-epoch-1"
        self.dp_rank: int | None = None  # the rank its batches are stamped with (None: none)
        self.ring: list[tuple[int, bytes]] = []
        self.drop_next = 0  # batches to "lose" on the live subject (still kept for replay)
        self.requests: list[dict[str, Any]] = []
        self.prefetch: list[dict[str, Any]] = []
        self.fail_with: tuple[int, dict[str, Any]] | None = None
        self.gate: asyncio.Event | None = None  # when set: requests wait for it (load)
        self.metrics_gate: asyncio.Event | None = None  # when set: /metrics waits for it
        self.scrapes = 0  # /metrics requests started
        self.health_checks = 0
        self.inflight = 0
        self.cancelled = 0
        self.token_delay = 0.0
        self.nc: Client | None = None
        self.served = Served(self._app())

    @property
    def url(self) -> str:
        return self.served.url

    async def start(self) -> EngineDouble:
        if self.nats_url:
            self.nc = await nats.connect(self.nats_url)
            await self.nc.subscribe(self.subjects.gap_fill(self.worker_id), cb=self._on_replay)
        await self.served.start()
        return self

    async def stop(self) -> None:
        if self.gate is not None:
            self.gate.set()
        await self.served.stop()
        if self.nc is not None:
            await self.nc.close()

    # -- prefix cache and events ---------------------------------------------------
    def _ids(self, tokens: Any) -> list[int]:
        return list(array("I", tokens)) if isinstance(tokens, bytes) else list(tokens)

    def _engine_hashes(self, ids: list[int]) -> list[int]:
        out, h = [], ENGINE_SEED
        bs = self.block_size
        for i in range(len(ids) // bs):
            h = xxhash.xxh64_intdigest(array("I", ids[i * bs : (i + 1) * bs]).tobytes(), h)
            out.append(h)
        return out

    async def admit(self, ids: list[int]) -> int:
        """Serve a prompt's prefill: cached tokens, then store its blocks (with events)."""
        hashes = self._engine_hashes(ids)
        bs = self.block_size
        hit = 0
        for h in hashes:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            hit += 1
        new = hashes[hit:]
        if new:
            parent = hashes[hit - 1] if hit else None
            for i, h in enumerate(new, start=hit):
                self.cache[h] = ids[i * bs : (i + 1) * bs]
                self.parent[h] = hashes[i - 1] if i else None
            stored = BlockStored(
                block_hashes=new,
                parent_block_hash=parent,
                token_ids=ids[hit * bs : len(hashes) * bs],
                block_size=bs,
                medium="GPU",
            )
            events: list[Any] = [stored]
            evicted = []
            while len(self.cache) > self.capacity:
                h, _ = self.cache.popitem(last=False)
                evicted.append(h)
            if evicted:
                events.append(BlockRemoved(block_hashes=evicted, medium="GPU"))
            await self.publish(events)
        return hit * bs

    async def evict(self, hashes: list[int]) -> None:
        for h in hashes:
            self.cache.pop(h, None)
        await self.publish([BlockRemoved(block_hashes=hashes, medium="GPU")])

    async def clear(self) -> None:
        self.cache.clear()
        await self.publish([AllBlocksCleared()])

    async def publish(self, events: list[Any]) -> None:
        self.seq += 1
        payload = encode(EventBatch(time.time(), events, self.dp_rank))
        self.ring.append((self.seq, payload))
        del self.ring[: -self.ring_size]
        if self.nc is None:
            return
        if self.drop_next:
            self.drop_next -= 1
            return
        headers = {SEQ_HEADER: str(self.seq), EPOCH_HEADER: self.epoch}
        if self.dp_rank is not None:  # as the agent names the rank its engine stamps
            headers[DP_RANK_HEADER] = str(self.dp_rank)
        await self.nc.publish(self.subjects.events(self.worker_id), payload, headers=headers)
        await self.nc.flush()

    async def report_load(self, running: int, waiting: int, kv_usage: float) -> None:
        assert self.nc is not None
        data = {"running": running, "waiting": waiting, "kv_usage": kv_usage, "ts": time.time()}
        await self.nc.publish(self.subjects.load(self.worker_id), orjson.dumps(data))
        await self.nc.flush()

    async def _on_replay(self, msg: Msg) -> None:
        assert self.nc is not None
        req = GapFillRequest.decode(msg.data)
        first = self.ring[0][0] if self.ring else self.seq + 1
        dump = req.from_seq < first
        if dump:
            events = [
                BlockStored([h], self.parent[h], self.cache[h], self.block_size, medium="GPU")
                for h in sorted(self.cache, key=self._depth)  # parents first
            ]
            payload = encode(EventBatch(time.time(), events, None))
            await self.nc.publish(msg.reply, GapFillMessage("dump", self.seq, payload).encode())
        else:
            for seq, payload in self.ring:
                if seq >= req.from_seq:
                    await self.nc.publish(msg.reply, GapFillMessage("batch", seq, payload).encode())
        end = GapFillMessage("end", self.seq, epoch=self.epoch, dump=dump)
        await self.nc.publish(msg.reply, end.encode())
        await self.nc.flush()

    def _depth(self, h: int) -> int:
        depth = 0
        while (h := self.parent.get(h)) is not None:
            depth += 1
        return depth

    # -- HTTP ------------------------------------------------------------------------
    def _app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._completion, methods=["POST"]),
                Route("/v1/completions", self._completion, methods=["POST"]),
                Route("/v1/models", self._models),
                Route("/health", self._health),
                Route("/metrics", self._metrics),
            ]
        )

    async def _models(self, _req: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _health(self, _req: Request) -> Response:
        self.health_checks += 1
        return PlainTextResponse("ok")

    async def _metrics(self, _req: Request) -> Response:
        self.scrapes += 1
        if self.metrics_gate is not None:
            await self.metrics_gate.wait()
        labels = f'{{model_name="{self.model}",engine="0"}}'
        text = (
            f"vllm:num_requests_running{labels} {self.inflight}\n"
            f"vllm:num_requests_waiting{labels} 0\n"
            f"vllm:kv_cache_usage_perc{labels} {len(self.cache) / self.capacity}\n"
        )
        return PlainTextResponse(text)

    async def _completion(self, request: Request) -> Response:
        raw = await request.body()
        body = orjson.loads(raw)
        chat = request.url.path.endswith("chat/completions")
        self.requests.append({"path": request.url.path, "body": body, "headers": request.headers})
        if self.fail_with is not None:
            status, err = self.fail_with
            return JSONResponse(err, status_code=status)
        if body.get("model") != self.model:
            err = {"error": {"message": "no such model", "type": "NotFoundError", "code": 404}}
            return JSONResponse(err, status_code=404)
        if chat:
            tokens, _ = self.tokenizer.chat(body)
        else:
            tokens, _ = self.tokenizer.completion(body["prompt"])
        ids = self._ids(tokens)
        self.inflight += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            cached = await self.admit(ids)
        finally:
            self.inflight -= 1
        words = [f"hi{i} " for i in range(int(body.get("max_tokens") or 3))]
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(words),
            "total_tokens": len(ids) + len(words),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{len(self.requests)}"
        base = {"id": rid, "created": int(time.time()), "model": self.model}
        base["system_fingerprint"] = self.worker_id
        if not body.get("stream"):
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(words)},
                    "finish_reason": "stop",
                }
                obj = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
            else:
                choice = {"index": 0, "text": "".join(words), "finish_reason": "stop"}
                obj = {**base, "object": "text_completion", "choices": [choice], "usage": usage}
            return Response(orjson.dumps(obj), media_type="application/json")
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        return StreamingResponse(
            self._sse(base, chat, words, usage if include_usage else None),
            media_type="text/event-stream",
        )

    async def _sse(self, base: dict[str, Any], chat: bool, words: list[str], usage: Any) -> Any:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[Any], **extra: Any) -> bytes:
            return b"data: " + orjson.dumps({**base, "object": kind, "choices": choices, **extra})

        try:
            if chat:
                yield event([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}])
                yield b"\n\n"
            for i, w in enumerate(words):
                last = "stop" if i == len(words) - 1 else None
                part = {"delta": {"content": w}} if chat else {"text": w}
                yield event([{"index": 0, **part, "finish_reason": last}]) + b"\n\n"
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
            if usage is not None:
                yield event([], usage=usage) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


# -- engine doubles behind one router ------------------------------------------------------

ADMIN_TOKEN = "s3cret"  # DoubleStack's admin_token


async def read_body(receive: Any) -> tuple[bytes, Callable[[], Awaitable[dict[str, Any]]]]:
    """An ASGI request's whole body, and a ``receive`` that gives it again to the app an
    engine wrapper passes the request on to."""
    chunks: list[bytes] = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(chunks)
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return cast("dict[str, Any]", await receive())

    return body, replay


class Routed:
    """A router serving on a loopback port, in-process (``serve``): what ``DoubleStack``
    and ``EngineStack`` put in front of their engines."""

    app: RouterApp | None = None
    served: Served | None = None
    clients: list[openai.AsyncOpenAI]

    @property
    def url(self) -> str:
        assert self.served is not None
        return self.served.url

    def client(self) -> openai.AsyncOpenAI:
        """An OpenAI client of the router, closed with the stack (``close_clients``)."""
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        self.clients.append(client)
        return client

    async def close_clients(self) -> None:
        for client in self.clients:
            await client.close()
        self.clients = []

    def events_at_rest(self) -> bool:
        """The event feed read up to date, handed to the native reader where there is one,
        and no resync in flight (the hand-off starts one): a batch lost from here is lost
        until something shows the gap."""
        feed, events = self.state.feed, self.state.events
        handed = feed.native is None or feed.native_live
        return feed.up_to_date and handed and not events._resync

    @property
    def state(self) -> Any:
        assert self.app is not None
        return self.app.state

    async def serve(self, cfg: RouterConfig) -> Served:
        """The router on ``cfg``, serving; on NATS (connected) when ``cfg`` names it."""
        self.app = RouterApp(cfg)
        self.served = await Served(self.app).start()
        if cfg.nats_url is not None:
            await until(lambda: self.state.bus.connected, what="router on NATS")
        return self.served


class DoubleStack(Routed):
    """``n`` engine doubles (``w0``...) behind one in-process router on a loopback port."""

    def __init__(self) -> None:
        self.engines: list[EngineDouble] = []
        self.clients: list[openai.AsyncOpenAI] = []

    @classmethod
    async def start(
        cls,
        n: int = 2,
        nats_url: str | None = None,
        engine_kw: dict[str, Any] | None = None,
        **cfg_kw: Any,
    ) -> DoubleStack:
        stack = cls()
        for i in range(n):
            engine = EngineDouble(f"w{i}", nats_url=nats_url, **(engine_kw or {}))
            stack.engines.append(await engine.start())
        settings: dict[str, Any] = {
            "block_size": 4, "admin_token": ADMIN_TOKEN, "health_interval": 0.2, **cfg_kw,
        }  # fmt: skip
        cfg = RouterConfig(
            nats_url=nats_url,
            workers=[WorkerSpec(e.worker_id, e.url, model="m") for e in stack.engines],
            **settings,
        )
        await stack.serve(cfg)
        return stack

    def http(self, token: str | None = None) -> httpx.AsyncClient:
        """A client of the router; with ``token`` as its bearer (the admin API's)."""
        headers = {"authorization": f"Bearer {token}"} if token else None
        return httpx.AsyncClient(base_url=self.url, timeout=10, headers=headers)

    def engine(self, worker_id: str) -> EngineDouble:
        return next(e for e in self.engines if e.worker_id == worker_id)

    async def stop(self) -> None:
        await self.close_clients()
        if self.served is not None:
            await self.served.stop()
        for e in self.engines:
            await e.stop()


# -- mock engines behind node agents, router replicas -----------------------------------------

BS = 16
MODEL = "mock-model"
SYSTEM = "You are the assistant of a replicated cache-aware router; answer briefly. " * 3


class Replica:
    """One router process: the app and its HTTP server on a loopback port."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.app = RouterApp(cfg)
        self.served: Served | None = None

    @property
    def state(self) -> Any:
        return self.app.state

    @property
    def url(self) -> str:
        assert self.served is not None
        return self.served.url

    def pool(self) -> Any:
        return self.state.registry.pools["default"]

    def load(self, worker_id: str) -> Any:
        return self.state.registry.get(worker_id).load

    async def start(self) -> Replica:
        self.served = await Served(self.app).start()
        feed = self.state.feed
        await until(lambda: self.state.bus.connected and feed.using, what="replica on NATS")
        return self

    async def stop(self) -> None:
        if self.served is not None:
            await self.served.stop()
            self.served = None


async def engine_agent(engine: MockEngine, nats_url: str, **kw: Any) -> NodeAgent:
    """A started node agent in front of a mock engine: its event and replay endpoints,
    its worker id, and a short replay timeout (``kw`` overrides any AgentConfig field)."""
    fields: dict[str, Any] = {
        "worker_id": engine.cfg.worker_id,
        "zmq_endpoint": engine.zmq_endpoint or "",
        "replay_endpoint": engine.replay_endpoint,
        "engine_url": engine.url,
        "nats_url": nats_url,
        "replay_timeout": 0.5,
    }
    return await NodeAgent(AgentConfig(**(fields | kw))).start()


def mock_engine_config(worker_id: str, **kw: Any) -> MockEngineConfig:
    """A mock engine as the stacks run it: the tests' model and block size, KV events and
    replay on loopback ports picked free, 200x speed (``kw``: other MockEngineConfig fields)."""
    fields: dict[str, Any] = {
        "worker_id": worker_id,
        "model": MODEL,
        "block_size": BS,
        "zmq_endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "timing": Timing(speed=200.0),
    }
    return MockEngineConfig(**(fields | kw))


async def mock_engine_agent(
    cfg: MockEngineConfig, nats_url: str, **kw: Any
) -> tuple[MockEngine, list[NodeAgent]]:
    """A started mock engine and its started node agents: one per DP rank, named as the
    router names the rank (``router.workers.dp.target_id``) and reading that rank's event and
    replay endpoints, or one for an engine without ranks (``kw``: AgentConfig fields for
    each agent). What started is stopped again if a later start fails."""
    engine = await MockEngine(cfg).start()
    agents: list[NodeAgent] = []
    try:
        if cfg.dp_size == 1:
            agents.append(await engine_agent(engine, nats_url, **kw))
        for rank in engine.ranks if cfg.dp_size > 1 else []:
            assert rank.publisher is not None
            agent = await engine_agent(
                engine,
                nats_url,
                worker_id=target_id(cfg.worker_id, rank.rank),
                zmq_endpoint=rank.publisher.endpoint,
                replay_endpoint=rank.publisher.replay_endpoint,
                **kw,
            )
            agents.append(agent)
    except BaseException:
        for a in agents:
            await a.stop()
        await engine.stop()
        raise
    return engine, agents


class EngineStack(Routed):
    """Mock engines (``add``: with their node agents when the stack has NATS) and a router
    serving them (``serve``): the set-up the end-to-end tests of one feature share;
    ``stop`` stops the router, then the agents, then the engines."""

    def __init__(self, nats_url: str | None = None) -> None:
        self.nats_url = nats_url
        self.engines: dict[str, MockEngine] = {}
        self.agents: list[NodeAgent] = []
        self.clients = []

    async def add(self, cfg: MockEngineConfig, **agent_kw: Any) -> MockEngine:
        if self.nats_url is None:
            engine = await MockEngine(cfg).start()
        else:
            engine, agents = await mock_engine_agent(cfg, self.nats_url, **agent_kw)
            self.agents.extend(agents)
        self.engines[cfg.worker_id] = engine
        return engine

    async def stop(self) -> None:
        await self.close_clients()
        if self.served is not None:
            await self.served.stop()
            self.served = None
        for a in self.agents:
            await a.stop()
        for e in self.engines.values():
            await e.stop()
        self.agents, self.engines = [], {}


class MockStack:
    """Mock engines (small GPU caches, so they evict) behind node agents."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.engines: list[MockEngine] = []
        self.agents: list[NodeAgent] = []
        self._feeds: list[tuple[Rank, NodeAgent]] = []  # each agent and the rank it reads

    async def start(
        self, n: int, buffer: int = 10_000, load_interval: float = 0, gpu_blocks: int = 32
    ) -> MockStack:
        for i in range(n):
            cfg = mock_engine_config(f"m{i}", gpu_blocks=gpu_blocks)
            await self.add(cfg, load_interval=load_interval, buffer=buffer)
        return self

    async def add(self, cfg: MockEngineConfig, **agent: Any) -> MockEngine:
        """One more engine, started, behind its own started agents (one per DP rank;
        ``agent``: AgentConfig fields)."""
        engine, agents = await mock_engine_agent(cfg, self.nats_url, **agent)
        self.engines.append(engine)
        self.agents.extend(agents)
        self._feeds.extend(zip(engine.ranks, agents, strict=True))
        return engine

    async def stop(self) -> None:
        for a in self.agents:
            await a.stop()
        for e in self.engines:
            await e.stop()

    def applied(self, replica: Replica) -> bool:
        """The replica's index has applied every batch the engines have published (each
        rank's under its agent's worker id)."""
        ingest = replica.pool().ingest
        return all(
            last_seq(ingest, a.cfg.worker_id) == r.publisher.seq - 1
            for r, a in self._feeds
            if r.publisher is not None and r.publisher.seq
        )

    def router_config(self, replica_id: str, **kw: Any) -> RouterConfig:
        """A router for these engines (``kw``: other RouterConfig fields, or overrides)."""
        fields: dict[str, Any] = {
            "nats_url": self.nats_url,
            "block_size": BS,
            "admin_token": "t",
            "health_interval": 0.5,
            "replica_id": replica_id,
            "workers": [WorkerSpec(e.cfg.worker_id, e.url, model=MODEL) for e in self.engines],
        }
        return RouterConfig(**(fields | kw))

    def synced(self, replica: Replica) -> bool:
        """The replica applied every batch each agent has published."""
        ingest = replica.pool().ingest
        return all(
            last_seq(ingest, a.cfg.worker_id) == a.core.last_seq and ingest.in_sync(a.cfg.worker_id)
            for a in self.agents
            if a.core.last_seq is not None
        )

    def delivered(self, replica: Replica) -> bool:
        """``synced`` and ``applied``: the index holds all the engines published, through
        their agents (an agent's seq alone can lag the engine's ZMQ send)."""
        return self.synced(replica) and self.applied(replica)

    def engine_blocks(self) -> dict[str, int]:
        return {e.cfg.worker_id: len(e.cache.gpu_hashes()) for e in self.engines}


def prompt(i: int) -> str:
    return f"{SYSTEM} topic {i % 4}: " + f"note {i} " * (20 + 3 * i)


def matches(replica: Replica, prompts: Iterable[str]) -> list[dict[str, int]]:
    """What the replica's index holds for each prompt (events only, no predictions)."""
    st = replica.state
    pool = replica.pool()
    tok = st.tokenizers.get(MODEL)
    return [
        pool.index.match(pool.hasher.hash_tokens(tok.encode(p, True)), speculative=False)
        for p in prompts
    ]


def index_blocks(replica: Replica) -> dict[str, int]:
    return {w: t["gpu"] for w, t in replica.pool().index.stats().workers.items()}


async def send(http: httpx.AsyncClient, replica: Replica, text: str) -> str:
    body = {"model": MODEL, "prompt": text, "max_tokens": 4}
    r = await http.post(replica.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.headers["x-cache-router-worker"]


async def hits(http: httpx.AsyncClient, prompt: str, model: str = MODEL) -> tuple[str, int, int]:
    """(the worker, its predicted hit tokens, the engine's cached tokens) of one completion
    sent to the router ``http`` is based at."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    resp = await http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (
        resp.headers["x-cache-router-worker"],
        int(resp.headers["x-cache-router-hit-tokens"]),
        cached,
    )
