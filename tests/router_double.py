"""A minimal engine double for the router's end-to-end tests (not a test module).

A real HTTP server on a loopback port speaking the OpenAI completions/chat API (SSE
included, ``usage.prompt_tokens_details.cached_tokens`` reported), with a paged prefix
cache keyed by the engine's *own* block hashes, publishing KV events on a real NATS
exactly as the node agent does (msgpack batch from ``index.codec.encode``, ``Kv-Seq``
and ``Kv-Epoch`` headers) and answering ``kv.replay.<id>`` per ``index/gapfill.py``.
It tokenizes with the router's tokenizer classes, as a real engine uses the model's.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import orjson
import uvicorn
import xxhash
from nats.aio.client import Client
from nats.aio.msg import Msg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from index.codec import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode
from index.gapfill import GapFillMessage, GapFillRequest
from index.wire import DEFAULT_PREFIX, EPOCH_HEADER, SEQ_HEADER, Subjects
from router.natsd import free_port
from router.tokenize import FallbackTokenizer, Tokenizer

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


class Served:
    """An ASGI app under uvicorn on a free loopback port, in the running event loop."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
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
        self.task = asyncio.create_task(self.server.serve())
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
        self.ring: list[tuple[int, bytes]] = []
        self.drop_next = 0  # batches to "lose" on the live subject (still kept for replay)
        self.requests: list[dict[str, Any]] = []
        self.prefetch: list[dict[str, Any]] = []
        self.fail_with: tuple[int, dict[str, Any]] | None = None
        self.gate: asyncio.Event | None = None  # when set: requests wait for it (load)
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
        payload = encode(EventBatch(time.time(), events, None))
        self.ring.append((self.seq, payload))
        del self.ring[: -self.ring_size]
        if self.nc is None:
            return
        if self.drop_next:
            self.drop_next -= 1
            return
        headers = {SEQ_HEADER: str(self.seq), EPOCH_HEADER: self.epoch}
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
        return PlainTextResponse("ok")

    async def _metrics(self, _req: Request) -> Response:
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
