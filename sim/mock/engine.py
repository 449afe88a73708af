"""``cache-router mock-engine``: an OpenAI-compatible server that behaves like one vLLM.

It serves ``/v1/chat/completions``, ``/v1/completions`` (SSE streaming or not),
``/v1/models``, ``/health``, ``/metrics`` (vLLM's metric names, or SGLang's with
``--sglang``) and ``POST /prefetch``. Requests run through a batching scheduler
(``sim.mock.scheduler``) over the same ``PrefixCache`` the simulator uses, and every
step's cache changes go out as a KV-event batch on ZMQ (``sim.mock.publisher``).

``POST /prefetch`` takes a prefetch hint (``block_hashes`` named by the source engine,
which shares this engine's hash function) plus ``token_ids``, the tokens of those
blocks: the node agent fills them in from the source's agent, a router that has them
may send them. After a modelled transfer time the blocks land in the host tier (GPU
without one), so a later request hits them.

For tests: ``async with MockEngine(MockEngineConfig(...)) as engine:`` starts it on a
free port in the running event loop; ``engine.url``, ``engine.zmq_endpoint``;
``engine.fault = Fault(...)`` fails its next requests (an error status, or an answer
broken off mid-way).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import ssl
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn
import xxhash
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from index.codec import hash_from_json
from index.groups import parse_groups
from router.cli import serve_until_signalled
from router.http.errors import ApiError, ErrorCode, error_body
from router.tokens.media import as_ints, block_keys, expand, media_parts
from sim.cache import PrefixCache
from sim.mock import messages as anthropic
from sim.mock import sglang_chat, tokens_in
from sim.mock.openai_api import (
    DONE,
    Kind,
    Params,
    chat_usage,
    full_response,
    parse_params,
    role_chunk,
    sse,
    stop_at,
    token_chunk,
    usage,
    usage_chunk,
)
from sim.mock.pd import BOOTSTRAP_TIMEOUT, PdSide, Plan, Role
from sim.mock.pooling import Pooling
from sim.mock.publisher import Encoding, KvEventPublisher, wire_hash
from sim.mock.responses import (
    ResponseStore,
    Stored,
    input_messages,
    new_ids,
    not_found,
    now,
    response_object,
    stream_events,
)
from sim.mock.responses import usage as responses_usage
from sim.mock.scheduler import SCHEDULING_POLICIES, Scheduler, SchedulingPolicy, Sequence, Timing
from sim.mock.text import MockText
from sim.mock.tokens_in import Generate

log = logging.getLogger(__name__)


@dataclass(slots=True)
class MockEngineConfig:
    port: int = 0  # 0: a free port
    host: str = "127.0.0.1"
    model: str = "mock-model"
    worker_id: str = "mock-0"
    block_size: int = 16
    gpu_blocks: int = 2048
    host_blocks: int = 0
    seed: int = 0  # engine hash seed: engines that share it can exchange blocks
    zmq_endpoint: str | None = None  # e.g. tcp://127.0.0.1:5557; None: no KV events
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    encoding: Encoding = "vllm"
    tokenizer: str | None = None  # tokenizer.json path; None: the router's fallback
    max_model_len: int = 32_768
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # vLLM --scheduling-policy: the waiting queue's order (sim.mock.scheduler); under
    # fcfs a request naming a priority other than 0 is refused with 400, as vLLM does
    scheduling_policy: SchedulingPolicy = "fcfs"
    timing: Timing | None = None
    # data-parallel ranks, each its own cache, scheduler and KV-event publisher (its
    # endpoints' ports offset by the rank, as vLLM's ``offset_endpoint_port``)
    dp_size: int = 1
    role: Role = "mixed"  # a disaggregated pool's prefill or decode engine (sim.mock.pd)
    # seconds an SGLang prefill waits for its decode engine to join the bootstrap room
    bootstrap_timeout: float = BOOTSTRAP_TIMEOUT
    # a hybrid model: its KV-cache groups ("full,sliding_window:64,mamba", group 0 full
    # attention), each group past the first holding up to group_blocks blocks (sim/hybrid.py)
    kv_groups: str = ""
    group_blocks: int = 0  # 0: gpu_blocks
    # LoRA adapters loaded (vLLM --lora-modules): listed in /v1/models with the served
    # model as parent, each request for one cached in the adapter's own prefix space
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 4  # vLLM --max-loras, reported in vllm:lora_requests_info
    # output tokens per SSE chunk after the first (vLLM and SGLang --stream-interval)
    stream_interval: int = 1
    # vLLM --enable-scale-out: /v1/chat/completions/render and /inference/v1/generate
    # (token ids in, sim.mock.tokens_in)
    scale_out: bool = False
    # HTTPS as vLLM serves it (--ssl-certfile/--ssl-keyfile); with ssl_ca_certs, clients
    # must show a certificate that CA signed (vLLM's --ssl-ca-certs --ssl-cert-reqs 2)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None


@dataclass(slots=True)
class Fault:
    """A failure the engine's next ``times`` chat or completion requests meet, for tests
    of what a router does with a failing engine (``MockEngine.fault``). ``status``: the
    request is refused with that status and an OpenAI error body before anything runs.
    Else it runs, and its answer breaks off (the connection dropped, as a dying engine
    drops it) after ``cut_after`` output tokens of a stream, or after the first half of
    a whole answer's body. ``stall``: a stream goes silent after ``cut_after`` tokens
    instead (the engine stays healthy: a request stuck in a live engine). ``malformed``
    (``/inference/v1/generate`` only): it runs, and its answer is a 200 whose body is not
    the endpoint's shape (every event of a stream), as from an engine of another version."""

    status: int | None = None
    cut_after: int = 0
    times: int = 1
    stall: bool = False
    malformed: bool = False


_HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
}


class _Metrics:
    """Collects the engine's gauges and counters at scrape time."""

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        names = ["model_name", "engine"]  # vLLM: one series per DP engine (rank)
        gauges: dict[str, GaugeMetricFamily] = {}
        counters: dict[str, CounterMetricFamily] = {}
        for rank in e.ranks:
            s = rank.scheduler
            labels = [e.cfg.model, str(rank.rank)]
            if e.cfg.encoding == "sglang":
                hit_rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
                values: dict[str, float] = {
                    "sglang:num_running_reqs": len(s.running),
                    "sglang:num_queue_reqs": s.reported_waiting,
                    "sglang:token_usage": rank.cache.usage,
                    "sglang:cache_hit_rate": hit_rate,
                }
                counts: dict[str, int] = {}
            else:
                values = {
                    "vllm:num_requests_running": len(s.running),
                    "vllm:num_requests_waiting": s.reported_waiting,
                    "vllm:kv_cache_usage_perc": rank.cache.usage,
                }
                counts = {
                    "vllm:prefix_cache_queries": s.prefix_queries,
                    "vllm:prefix_cache_hits": s.prefix_hits,
                    "vllm:prompt_tokens": s.prompt_tokens,
                    "vllm:generation_tokens": s.generation_tokens,
                    # never: a request's answer has its pages from its admission on
                    "vllm:num_preemptions": 0,
                }
            for name, value in values.items():
                if name not in gauges:
                    gauges[name] = GaugeMetricFamily(name, _HELP.get(name, name), labels=names)
                gauges[name].add_metric(labels, value)
            for name, count in counts.items():
                if name not in counters:
                    counters[name] = CounterMetricFamily(name, _HELP.get(name, name), labels=names)
                counters[name].add_metric(labels, count)
        yield from gauges.values()
        yield from counters.values()
        if e.cfg.encoding != "sglang":  # vLLM 0.32's waiting by reason: none deferred here
            by_reason = GaugeMetricFamily(
                "vllm:num_requests_waiting_by_reason",
                "Number of requests waiting, by the reason they wait.",
                labels=[*names, "reason"],
            )
            for rank in e.ranks:
                labels = [e.cfg.model, str(rank.rank)]
                by_reason.add_metric([*labels, "capacity"], rank.scheduler.reported_waiting)
                by_reason.add_metric([*labels, "deferred"], 0)
            yield by_reason
        if e.cfg.lora_modules and e.cfg.encoding != "sglang":
            yield e.lora_info()
        if e.cfg.encoding != "sglang":  # vLLM's info gauge: its CacheConfig as labels
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=["block_size", "enable_prefix_caching", "num_gpu_blocks"],
            )
            info.add_metric([str(e.cfg.block_size), "True", str(e.cfg.gpu_blocks)], 1.0)
            yield info


MEDIA_PAD = 0x7FFF_FF01  # the mock's placeholder token for a media item


def placeholder_run(identifier: str) -> list[int]:
    """A media item's placeholder tokens: 16 to 48, fixed per item (a vision encoder's
    output size depends on the image; the router learns it from the events)."""
    return [MEDIA_PAD] * (16 + xxhash.xxh3_64_intdigest(identifier.encode()) % 33)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Rank ``rank``'s endpoint, as vLLM offsets its publishers: the port plus the rank
    (a wildcard or zero port stays: each rank binds a free one)."""
    if not endpoint or rank == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{head}:{int(port) + rank}"


class Rank:
    """One data-parallel rank: its own KV cache, scheduler and event publisher."""

    def __init__(self, engine: MockEngine, rank: int) -> None:
        cfg = engine.cfg
        self.rank = rank
        groups = parse_groups(cfg.kv_groups)
        if groups and groups[0].kind != "full":
            raise ValueError("the mock engine's KV-cache group 0 is full attention")
        self.cache = PrefixCache(
            cfg.block_size,
            cfg.gpu_blocks,
            cfg.host_blocks,
            cfg.seed,
            groups=groups[1:],
            group_blocks=cfg.group_blocks,
        )
        self.publisher: KvEventPublisher | None = None
        self.scheduler = Scheduler(
            self.cache,
            engine.timing,
            self._publish,
            max_num_seqs=cfg.max_num_seqs,
            max_batched_tokens=cfg.max_num_batched_tokens,
            policy=cfg.scheduling_policy,
        )

    def start(self, cfg: MockEngineConfig) -> None:
        if cfg.zmq_endpoint:
            endpoint = offset_endpoint(cfg.zmq_endpoint, self.rank)
            assert endpoint is not None
            self.publisher = KvEventPublisher(
                endpoint,
                offset_endpoint(cfg.replay_endpoint, self.rank),
                topic=cfg.topic,
                buffer_steps=cfg.buffer_steps,
                encoding=cfg.encoding,
                dp_rank=self.rank,
            )
            self.publisher.start()

    def _publish(self, events: list[Any]) -> None:
        if self.publisher is not None:
            self.publisher.publish(events)

    @property
    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)


class MockEngine:
    def __init__(self, cfg: MockEngineConfig) -> None:
        if not 1 <= cfg.dp_size <= 64:
            raise ValueError(f"dp_size must be in [1, 64], got {cfg.dp_size}")
        self.cfg = cfg
        self.timing = cfg.timing or Timing()
        self.ranks = [Rank(self, r) for r in range(cfg.dp_size)]
        # rank 0 under the names a one-rank engine has always had
        self.cache = self.ranks[0].cache
        self.scheduler = self.ranks[0].scheduler
        self.text = MockText(cfg.tokenizer)
        self.pooling = Pooling(self.text, cfg.model, cfg.max_model_len)
        self.responses = ResponseStore()
        self.prefetched_blocks = 0
        self.generate_requests = 0  # chat and completion requests received
        self.tokens_in_requests = 0  # of them, token ids in (generate, or SGLang input_ids)
        self.fault: Fault | None = None
        self.pd = PdSide(
            cfg.role,
            cfg.worker_id,
            cfg.host,
            lambda: self.port,
            self.cache,
            self.timing,
            cfg.bootstrap_timeout,
            cfg.dp_size,
        )
        # W3C trace context of recent requests (vLLM continues the trace it is handed)
        self.traceparents: deque[str | None] = deque(maxlen=1024)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Metrics(self))
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._scheduler_tasks: list[asyncio.Task[None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()  # prefetches in flight
        self.port = cfg.port

    @property
    def url(self) -> str:
        scheme = "https" if self.cfg.ssl_certfile else "http"
        return f"{scheme}://{self.cfg.host}:{self.port}"

    @property
    def publisher(self) -> KvEventPublisher | None:
        return self.ranks[0].publisher

    @property
    def zmq_endpoint(self) -> str | None:
        return self.publisher.endpoint if self.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint if self.publisher else None

    def lora_info(self) -> GaugeMetricFamily:
        """vLLM's ``vllm:lora_requests_info``: the adapters of running and waiting requests
        as labels (what llm-d's adapter affinity reads)."""
        running = {s.lora for r in self.ranks for s in r.scheduler.running if s.lora}
        waiting = {s.lora for r in self.ranks for s in r.scheduler.waiting if s.lora}
        names = ["running_lora_adapters", "waiting_lora_adapters", "max_lora"]
        g = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running stats on lora requests.", labels=names
        )
        g.add_metric(
            [",".join(sorted(running)), ",".join(sorted(waiting)), str(self.cfg.max_loras)], 1.0
        )
        return g

    def pick_rank(self, headers: Any, body: Any) -> Rank:
        """The rank a request runs on: the one the router named (vLLM's
        ``X-data-parallel-rank`` header, SGLang's ``routed_dp_rank`` / ``data_parallel_rank``
        field), else the least loaded, as vLLM's internal balancer does; an SGLang PD
        request without one goes to ``bootstrap_room % dp_size`` (SGLang's default PD
        balancing, ``follow_bootstrap_room``)."""
        named: Any = headers.get("x-data-parallel-rank")
        if named is None and isinstance(body, dict):
            named = body.get("routed_dp_rank", body.get("data_parallel_rank"))
            room = body.get("bootstrap_room")
            if named is None and isinstance(room, int) and self.cfg.role != "mixed":
                named = room % len(self.ranks)
        if named is None:
            return min(self.ranks, key=lambda r: (r.load, r.rank))
        try:
            rank = int(named)
        except (TypeError, ValueError):
            rank = -1
        if not 0 <= rank < len(self.ranks):
            raise ApiError(400, f"data parallel rank {named!r} is out of range", "invalid_value")
        return self.ranks[rank]

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> MockEngine:
        cfg = self.cfg
        for rank in self.ranks:
            rank.start(cfg)
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.host, cfg.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
            ssl_certfile=cfg.ssl_certfile,
            ssl_keyfile=cfg.ssl_keyfile,
            ssl_ca_certs=cfg.ssl_ca_certs,
            ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.ssl_ca_certs else ssl.CERT_NONE,
        )
        self._server = uvicorn.Server(config)
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        self._scheduler_tasks = [asyncio.create_task(r.scheduler.run()) for r in self.ranks]
        for _ in range(500):
            if self._server.started:
                break
            await asyncio.sleep(0.01)
        else:
            await self.stop()
            raise RuntimeError("mock engine HTTP server did not start")
        log.info(
            "mock engine %s on %s, KV events on %s", cfg.worker_id, self.url, self.zmq_endpoint
        )
        return self

    async def stop(self) -> None:
        for seq in [s for r in self.ranks for s in (*r.scheduler.running, *r.scheduler.waiting)]:
            seq.error = "engine shutting down"
            seq.done = True
            seq.out.put_nowait(None)
        if self._server is not None:
            self._server.should_exit = True
        if self._serve_task is not None:
            await self._serve_task  # lets open streams end (each got its None above)
        for task in [*self._tasks, *self._scheduler_tasks]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for rank in self.ranks:
            if rank.publisher is not None:
                await rank.publisher.close()
        await self.pd.close()

    async def __aenter__(self) -> MockEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- HTTP -----------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="cache-router mock engine", docs_url=None, redoc_url=None)

        @app.exception_handler(ApiError)
        async def _api_error(_: Request, exc: ApiError) -> Response:
            return Response(exc.body(), exc.status, media_type="application/json")

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            card = {
                "id": self.cfg.model,
                "object": "model",
                "created": 0,
                "owned_by": sglang_chat.OWNED_BY if self.cfg.encoding == "sglang" else "vllm",
                "root": self.cfg.model,
                "parent": None,
                "max_model_len": self.cfg.max_model_len,
            }
            # vLLM lists each loaded adapter with the base model as its parent
            adapters = [
                {**card, "id": name, "root": f"/adapters/{name}", "parent": self.cfg.model}
                for name in self.cfg.lora_modules
            ]
            return {"object": "list", "data": [card, *adapters]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._generate("chat", request)

        if self.cfg.scale_out:

            @app.post("/v1/chat/completions/render")
            async def render(request: Request) -> dict[str, Any]:
                body = await _json(request)
                model = self._served(body)
                parse_params("chat", body, model)
                ids = self.text.chat(body)
                return tokens_in.rendered(body, ids, model, self.cfg.max_model_len)

            @app.post("/inference/v1/generate")
            async def generate(request: Request) -> Response:
                return await self._tokens(request)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._generate("completion", request)

        for path, handler in (
            ("/v1/embeddings", self.pooling.embeddings),
            ("/v1/score", self.pooling.score),
            ("/score", self.pooling.score),
            ("/v1/rerank", self.pooling.rerank),
            ("/rerank", self.pooling.rerank),
            ("/v2/rerank", self.pooling.rerank),
            ("/tokenize", self.pooling.tokenize),
            ("/detokenize", self.pooling.detokenize),
        ):
            app.add_api_route(path, self._pooled(handler), methods=["POST"])

        @app.post("/v1/responses")
        async def responses(request: Request) -> Response:
            return await self._respond(request)

        @app.post("/v1/messages")
        async def messages(request: Request) -> Response:
            return await self._messages(request)

        @app.get("/v1/responses/{rid}")
        async def retrieve(rid: str) -> Response:
            stored = self.responses.get(rid)
            if stored is None:
                raise not_found(rid)
            return JSONResponse(stored.response)

        @app.post("/v1/responses/{rid}/cancel")
        async def cancel(rid: str) -> Response:
            if self.responses.get(rid) is None:
                raise not_found(rid)
            raise ApiError(400, "Cannot cancel a synchronous response.", "invalid_request")

        @app.post("/prefetch")
        async def prefetch(request: Request) -> Response:
            return JSONResponse(self._prefetch(await _json(request)), status_code=202)

        @app.post("/mock/kv_pull")
        async def kv_pull(request: Request) -> Response:
            return JSONResponse(self.pd.pull(await _json(request)))

        @app.get("/mock/bootstrap/{room}")
        async def bootstrap(room: int, dp_rank: int | None = None) -> Response:
            return JSONResponse(self.pd.room(room, dp_rank))

        @app.post("/mock/bootstrap/{room}")
        async def bootstrap_join(room: int, dp_rank: int | None = None) -> Response:
            return JSONResponse(self.pd.join(room, dp_rank))

        return app

    def _pooled(self, handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            self.traceparents.append(request.headers.get("traceparent"))
            body = await _json(request)
            try:
                return JSONResponse(handler(body))
            except (TypeError, ValueError, KeyError, IndexError) as exc:  # vLLM answers 400
                raise ApiError(400, f"invalid request: {exc}", "invalid_value") from exc

        return endpoint

    async def _respond(self, request: Request) -> Response:
        """``POST /v1/responses`` (see ``sim.mock.responses``)."""
        self.traceparents.append(request.headers.get("traceparent"))
        body = await _json(request)
        messages = input_messages(body, self.responses)
        chat = {
            "model": body.get("model"),
            "messages": messages,
            "max_tokens": body.get("max_output_tokens"),
            "stream": body.get("stream"),
        }
        p = parse_params("chat", chat, self.cfg.model)
        prompt = self.text.chat(chat)
        seq = self._sequence(p, prompt)
        seq.priority = self._priority(body)
        sched = self._submit(request, body, seq)
        rid, mid = new_ids()
        created = now()
        out: list[str] = []

        def finish() -> dict[str, Any]:
            use = responses_usage(len(prompt), seq.generated, seq.cached_tokens)
            resp = response_object(rid, mid, body, p.model, "".join(out), use, created)
            if body.get("store", True) is not False:
                self.responses.put(rid, Stored(messages, resp))
            return resp

        if p.stream:

            def final() -> tuple[str, Any]:
                return "".join(out), finish()["usage"]

            pieces = self._pieces(sched, seq, out)
            events = stream_events(rid, mid, body, p.model, created, pieces, final)
            return StreamingResponse(events, media_type="text/event-stream")
        async for _ in self._pieces(sched, seq, out):
            pass
        return JSONResponse(finish())

    async def _messages(self, request: Request) -> Response:
        """``POST /v1/messages`` (Anthropic's Messages API, see ``sim.mock.messages``)."""
        self.traceparents.append(request.headers.get("traceparent"))
        raw = await _json(request)
        chat = anthropic.chat_body(raw)
        p = parse_params("chat", chat, self.cfg.model)
        prompt = self.text.chat(chat)
        seq = self._sequence(p, prompt)
        sched = self._submit(request, raw, seq)
        mid = anthropic.new_id()
        out: list[str] = []

        def use() -> dict[str, int]:
            return anthropic.usage(len(prompt), seq.generated, seq.cached_tokens)

        stop = anthropic.stop_reason(seq.finish_reason)
        if p.stream:
            events = anthropic.stream_events(
                mid, p.model, len(prompt), self._pieces(sched, seq, out), lambda: (stop, use())
            )
            return StreamingResponse(events, media_type="text/event-stream")
        async for _ in self._pieces(sched, seq, out):
            pass
        return JSONResponse(anthropic.message(mid, p.model, "".join(out), stop, use()))

    def _arrived(self, request: Request) -> Fault | None:
        """Count a generation request and take the fault it meets; a status fault refuses
        it here, before anything runs."""
        self.traceparents.append(request.headers.get("traceparent"))
        self.generate_requests += 1
        fault = self._take_fault()
        if fault is not None and fault.status is not None:
            code: ErrorCode = "engine_error" if fault.status >= 500 else "invalid_request"
            raise ApiError(fault.status, f"injected fault: status {fault.status}", code)
        return fault

    async def _generate(self, kind: Kind, request: Request) -> Response:
        fault = self._arrived(request)
        body = await _json(request)
        rank = self.pick_rank(request.headers, body)
        plan = self.pd.plan(body, rank.rank) if isinstance(body, dict) else Plan("none")
        adapter = body.get("model") if isinstance(body, dict) else None
        lora = adapter if adapter in self.cfg.lora_modules else None
        p = parse_params(kind, body, lora or self.cfg.model)
        p.use_request_id(request.headers.get("x-request-id"))
        keys = None
        if kind == "chat" and media_parts(body):
            # like vLLM: each item a run of placeholder tokens, its identifier in the
            # keys of every block the run touches
            seen = expand(self.text.tokenizer, body, placeholder_run, as_ints)
            prompt, keys = seen.tokens, block_keys(seen.items, self.cfg.block_size)
        elif kind == "chat":
            # SGLang's input_ids beside the messages (sim.mock.sglang_chat)
            ids = sglang_chat.input_ids(body) if self.cfg.encoding == "sglang" else None
            prompt = self.text.chat(body) if ids is None else ids
            self.tokens_in_requests += ids is not None
        else:
            prompt = self.text.completion(body["prompt"])
        seq = self._sequence(p, prompt, lora, keys)  # checked before any transfer
        seq.priority = self._priority(body)
        sched = rank.scheduler
        await self.pd.receive(
            plan, body, prompt, rank.cache, sched.flush_events, request.is_disconnected
        )
        sched.submit(seq)
        if p.stream:
            stream = self._stream(sched, p, seq, lambda ok: self.pd.finished(plan, prompt, ok))
            if fault is not None:  # a chat stream opens with its role event, no token
                events = fault.cut_after + (1 if p.kind == "chat" else 0)
                stream = (_silent if fault.stall else _cut)(stream, events)
            return StreamingResponse(stream, media_type="text/event-stream")
        pieces = await _whole(sched, seq)
        params = self.pd.finished(plan, prompt, not seq.error)
        if seq.error:
            raise ApiError(500, seq.error, "engine_error")
        use = self._usage(p, seq, True)
        answer = full_response(p, "".join(pieces), seq.finish_reason, use, seq.stop_reason)
        if kind == "chat" and self.cfg.encoding == "sglang":
            sglang_chat.echo(answer, body, prompt)
        if params is not None:
            answer["kv_transfer_params"] = params
        if fault is not None:
            whole = orjson.dumps(answer)
            half = _cut(_once(whole[: len(whole) // 2]), 1)
            return StreamingResponse(half, media_type="application/json")
        return JSONResponse(answer)

    async def _tokens(self, request: Request) -> Response:
        """``POST /inference/v1/generate``: token ids in (``sim.mock.tokens_in``)."""
        self.tokens_in_requests += 1
        fault = self._arrived(request)
        body = await _json(request)
        model = self._served(body)
        g = tokens_in.parse_generate(body, model, request.headers.get("x-request-id"))
        seq = self._sequence(g.params, g.token_ids, model if model != self.cfg.model else None)
        seq.priority = self._priority(body)
        sched = self.pick_rank(request.headers, body).scheduler
        sched.submit(seq)
        if g.params.stream:
            stream = self._token_stream(sched, g, seq)
            if fault is not None and fault.malformed:
                stream = _malformed(stream)
            elif fault is not None:
                stream = _cut(stream, fault.cut_after)
            return StreamingResponse(stream, media_type="text/event-stream")
        pieces = await _whole(sched, seq)
        if seq.error:
            raise ApiError(500, seq.error, "engine_error")
        use = tokens_in.usage(len(g.token_ids), seq.generated, seq.cached_tokens, True)
        answer = tokens_in.whole(g, pieces, seq.finish_reason, seq.stop_reason, use)
        if fault is not None and fault.malformed:
            return JSONResponse({"request_id": g.params.request_id, "outputs": answer["choices"]})
        if fault is not None:
            whole = orjson.dumps(answer)
            return StreamingResponse(_cut(_once(whole[: len(whole) // 2]), 1))
        return JSONResponse(answer)

    async def _token_stream(
        self, sched: Scheduler, g: Generate, seq: Sequence
    ) -> AsyncGenerator[bytes, None]:
        try:
            sent = 0
            while (step := await seq.out.get()) is not None:
                for piece in step:
                    sent += 1
                    last = sent == seq.max_tokens
                    finish = seq.finish_reason if last else None
                    stop = seq.stop_reason if last else None
                    yield sse(tokens_in.chunk(g, piece, finish, stop, sent))
            if seq.error:
                yield b"data: " + error_body(500, seq.error, "engine_error") + b"\n\n"
                return
            if g.params.include_usage:
                use = tokens_in.usage(len(seq.prompt), seq.generated, seq.cached_tokens, False)
                yield sse(tokens_in.usage_chunk(g, use))
            yield DONE
        finally:
            sched.abort(seq)

    def _served(self, body: Any) -> str:
        """The model a request names if it is one of the LoRA adapters, else the base's."""
        adapter = body.get("model") if isinstance(body, dict) else None
        return adapter if adapter in self.cfg.lora_modules else self.cfg.model

    def _usage(self, p: Params, seq: Sequence, whole: bool) -> dict[str, Any]:
        """A finished sequence's usage, in the chat's or the completion's shape."""
        prompt, cached = len(seq.prompt), seq.cached_tokens
        if p.kind != "chat":
            return usage(prompt, seq.generated, cached)
        return chat_usage(prompt, seq.generated, cached, self.created_tokens(seq), whole)

    def created_tokens(self, seq: Sequence) -> int:
        """vLLM's ``created_cache_tokens``: the prompt's whole blocks less its cached tokens."""
        bs = self.cfg.block_size
        return max(0, len(seq.prompt) // bs * bs - seq.cached_tokens)

    def _take_fault(self) -> Fault | None:
        """The fault this request meets (one of its ``times``), if one is set."""
        fault = self.fault
        if fault is None:
            return None
        fault.times -= 1
        if fault.times <= 0:
            self.fault = None
        return fault

    def _submit(self, request: Request, body: Any, seq: Sequence) -> Scheduler:
        """Queue ``seq`` on the rank the request names (or the least loaded one)."""
        sched = self.pick_rank(request.headers, body).scheduler
        sched.submit(seq)
        return sched

    async def _pieces(self, sched: Scheduler, seq: Sequence, out: list[str]) -> AsyncIterator[str]:
        """The Responses and Messages APIs' text: each piece kept in ``out`` as it is yielded."""
        try:
            while (step := await seq.out.get()) is not None:
                for piece in step:
                    out.append(piece)
                    yield piece
        finally:
            sched.abort(seq)
        if seq.error:
            raise RuntimeError(seq.error)  # cuts the stream, as a dying engine does

    def _priority(self, body: Any) -> int:
        """The body's ``priority`` (vLLM's field: an integer, 0 when absent); 400 for one
        that is not an integer, or not 0 under ``fcfs`` (vLLM's "Got priority N but
        Priority scheduling is not enabled.")."""
        found = body.get("priority") if isinstance(body, dict) else None
        if found is None:
            return 0
        if isinstance(found, bool) or not isinstance(found, int):
            raise ApiError(400, "priority must be an integer", "invalid_value", "priority")
        if found != 0 and self.cfg.scheduling_policy != "priority":
            raise ApiError(
                400, f"Got priority {found} but Priority scheduling is not enabled.",
                "invalid_value", "priority",
            )  # fmt: skip
        return found

    def _sequence(
        self,
        p: Params,
        prompt: list[int],
        lora: str | None = None,
        keys: dict[int, list[Any]] | None = None,
    ) -> Sequence:
        natural = self.text.natural_length(prompt)
        limit = p.max_tokens
        if limit is not None and (p.ignore_eos or natural > limit):
            n_out, finish = limit, "length"
        else:
            n_out, finish = natural, "stop"
        pieces, stop_reason = stop_at(self.text.pieces(prompt, n_out), p.stop, p.include_stop)
        if stop_reason is not None:
            n_out, finish = len(pieces), "stop"
        total = len(prompt) + n_out
        if total > self.cfg.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.cfg.max_model_len} tokens; "
                f"the request needs {total} ({len(prompt)} prompt).",
                "context_length_exceeded",
                "messages" if p.kind == "chat" else "prompt",
            )
        if self.cache.blocks_needed(total) > self.cache.gpu_blocks:
            raise ApiError(400, f"{total} tokens do not fit in the KV cache", "kv_cache_too_small")
        return Sequence(
            prompt=prompt,
            hashes=self.cache.hash_blocks(prompt, lora, keys),
            max_tokens=n_out,
            pieces=pieces,
            finish_reason=finish,
            stop_reason=stop_reason,
            lora=lora,
            keys=keys,
        )

    async def _stream(
        self,
        sched: Scheduler,
        p: Params,
        seq: Sequence,
        finished: Callable[[bool], object] | None = None,
    ) -> AsyncGenerator[bytes, None]:
        try:
            if p.kind == "chat":
                yield role_chunk(p)
            sent = 0
            held: list[str] = []  # pieces for the next chunk (``stream_interval``)
            every = self.cfg.stream_interval
            while (step := await seq.out.get()) is not None:
                for piece in step:
                    sent += 1
                    held.append(piece)
                    last = sent == seq.max_tokens
                    if sent == 1 or last or len(held) >= every:  # vLLM's: the first at once
                        finish = seq.finish_reason if last else None
                        yield token_chunk(p, "".join(held), finish, seq.stop_reason)
                        held.clear()
            if held:
                yield token_chunk(p, "".join(held), None)
            if finished is not None:
                finished(not seq.error)
            if seq.error:
                yield b"data: " + error_body(500, seq.error, "engine_error") + b"\n\n"
                return
            if p.include_usage:
                yield usage_chunk(p, self._usage(p, seq, False))
            yield DONE
        finally:
            sched.abort(seq)  # the client left early, or a no-op

    def _prefetch(self, hint: Any) -> dict[str, Any]:
        """Accept a hint; its blocks land after the modelled transfer time."""
        if not isinstance(hint, dict):
            raise ApiError(400, "prefetch hint must be a JSON object", "invalid_body")
        hashes, tokens = hint.get("block_hashes"), hint.get("token_ids")
        try:
            named = [hash_from_json(h) for h in hashes] if isinstance(hashes, list) else None
        except (TypeError, ValueError):
            named = None
        if named is None:
            raise ApiError(
                400, "block_hashes must be a list of ints or hex strings", "invalid_value"
            )
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError(
                422,
                "token_ids missing: this engine can only fetch blocks whose tokens it is given",
                "unresolved_blocks",
            )
        bs = self.cache.block_size
        n = min(len(named), len(tokens) // bs)
        num_tokens = hint.get("num_tokens")
        if isinstance(num_tokens, int) and num_tokens >= 0:
            n = min(n, num_tokens // bs)
        own = self.cache.hash_blocks(tokens[: n * bs])
        # The source's names must be ours too (same hash function): keep the agreeing run.
        enc = self.cfg.encoding
        m = next((i for i in range(n) if wire_hash(own[i], enc) != named[i]), n)
        if m < n:
            log.warning("prefetch hint: %d of %d block hashes are not this engine's", n - m, n)
        delay = self.timing.scaled(m * self.timing.transfer_s_per_block)
        self._spawn(self._land(tokens[: m * bs], own[:m], delay))
        return {"blocks": m, "rejected_blocks": n - m, "transfer_ms": delay * 1000}

    async def _land(self, tokens: list[int], hashes: list[int], delay: float) -> None:
        await asyncio.sleep(delay)
        self.prefetched_blocks += self.cache.prefetch(tokens, block_hashes=hashes)
        self.scheduler.flush_events()


async def _once(data: bytes) -> AsyncGenerator[bytes, None]:
    yield data


async def _malformed(body: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """``body``'s events with their data replaced by a shape no endpoint has."""
    async for piece in body:
        yield piece if piece == DONE else b'data: {"unexpected": true}\n\n'



async def _whole(sched: Scheduler, seq: Sequence) -> list[str]:
    """A whole answer's pieces, once the sequence ends (aborted if the client left)."""
    pieces: list[str] = []
    try:
        while (step := await seq.out.get()) is not None:
            pieces.extend(step)
    finally:
        sched.abort(seq)  # no-op when it finished
    return pieces
async def _cut(body: AsyncGenerator[bytes, None], events: int) -> AsyncGenerator[bytes, None]:
    """``body``'s first ``events`` pieces, then a broken connection: uvicorn closes it
    without the chunked body's end when the app raises mid-answer."""
    sent = 0
    async for piece in body:
        if sent == events:
            break
        yield piece
        sent += 1
    await body.aclose()  # its own cleanup first (a stream's aborts its sequence)
    raise RuntimeError("injected fault: the connection is cut mid-answer")


async def _silent(body: AsyncGenerator[bytes, None], events: int) -> AsyncGenerator[bytes, None]:
    """``body``'s first ``events`` pieces, then silence until the client leaves."""
    sent = 0
    try:
        async for piece in body:
            if sent == events:
                await asyncio.Event().wait()
            yield piece
            sent += 1
    finally:
        await body.aclose()


async def _json(request: Request) -> Any:
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not JSON: {exc}", "invalid_json") from exc


# -- command line ---------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MockEngineConfig()
    t = Timing()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--model", default=d.model, help="served model name")
    parser.add_argument("--worker-id", default=d.worker_id, help="name used in logs")
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--gpu-blocks", type=int, default=d.gpu_blocks)
    parser.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME",
        help="LoRA adapters served beside --model (listed in /v1/models, own prefix space)",
    )
    parser.add_argument(
        "--kv-groups",
        default=d.kv_groups,
        help='a hybrid model\'s KV-cache groups, e.g. "full,sliding_window:64,mamba"',
    )
    parser.add_argument(
        "--group-blocks",
        type=int,
        default=d.group_blocks,
        help="blocks each KV-cache group past the first holds (0: --gpu-blocks)",
    )
    parser.add_argument(
        "--dp-size",
        type=int,
        default=d.dp_size,
        help="data-parallel ranks, each its own KV cache; rank r's event endpoints are the "
        "given ports plus r",
    )
    parser.add_argument("--host-blocks", type=int, default=d.host_blocks, help="0: no host tier")
    parser.add_argument("--seed", type=int, default=d.seed, help="engine block-hash seed")
    parser.add_argument("--zmq-endpoint", help="KV-event PUB endpoint to bind (tcp://HOST:PORT)")
    parser.add_argument("--replay-endpoint", help="KV-event replay ROUTER endpoint to bind")
    parser.add_argument("--topic", default=d.topic, help="ZMQ topic of KV-event messages")
    parser.add_argument("--buffer-steps", type=int, default=d.buffer_steps)
    parser.add_argument(
        "--events-as-map", action="store_true", help="vLLM's newer map-encoded events"
    )
    parser.add_argument(
        "--sha256-hashes",
        action="store_true",
        help="map events with vLLM's default sha256 (bytes) block hashes",
    )
    parser.add_argument(
        "--sglang",
        action="store_true",
        help="SGLang's event layout, metric names, /v1/models owner and chat input_ids",
    )
    parser.add_argument("--tokenizer", help="tokenizer.json (default: the router's fallback)")
    parser.add_argument("--speed", type=float, default=t.speed, help="divide all latencies by X")
    parser.add_argument("--decode-tps", type=float, default=t.decode_tps)
    parser.add_argument("--prefill-tps", type=float, default=t.prefill_tps)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=d.scheduling_policy,
        help="the waiting queue's order, as vLLM's: fcfs, or priority (the body's priority, "
        "lower first; no preemption at --max-num-seqs)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=d.stream_interval,
        help="output tokens per SSE chunk after the first (vLLM's --stream-interval)",
    )
    parser.add_argument(
        "--role",
        choices=("mixed", "prefill", "decode"),
        default=d.role,
        help="a disaggregated pool's prefill or decode engine (both protocols, sim/mock/pd.py)",
    )
    parser.add_argument(
        "--bootstrap-timeout",
        type=float,
        default=d.bootstrap_timeout,
        help="seconds an SGLang prefill waits for its decode engine to join the room",
    )
    parser.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve vLLM's tokens-in endpoints (/inference/v1/generate, chat render)",
    )
    parser.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--ssl-keyfile", help="the certificate's key (PEM)")
    parser.add_argument("--ssl-ca-certs", help="clients must show a certificate this CA signed")
    parser.add_argument("--log-level", default="INFO")


def config_from_args(args: argparse.Namespace) -> MockEngineConfig:
    if args.sglang + args.events_as_map + args.sha256_hashes > 1:
        raise SystemExit("--sglang, --events-as-map and --sha256-hashes are exclusive")
    if not 1 <= args.dp_size <= 64:
        raise SystemExit("--dp-size must be in [1, 64]")
    try:
        parse_groups(args.kv_groups)
    except ValueError as exc:
        raise SystemExit(f"--kv-groups: {exc}") from exc
    if args.group_blocks < 0:
        raise SystemExit("--group-blocks must be >= 0")
    if args.speed <= 0 or args.decode_tps <= 0 or args.prefill_tps <= 0:
        raise SystemExit("--speed, --decode-tps and --prefill-tps must be positive")
    return MockEngineConfig(
        port=args.port,
        host=args.host,
        model=args.model,
        worker_id=args.worker_id,
        block_size=args.block_size,
        gpu_blocks=args.gpu_blocks,
        dp_size=args.dp_size,
        kv_groups=args.kv_groups,
        lora_modules=tuple(args.lora_modules),
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs,
        scale_out=args.enable_scale_out,
        group_blocks=args.group_blocks,
        host_blocks=args.host_blocks,
        seed=args.seed,
        zmq_endpoint=args.zmq_endpoint,
        replay_endpoint=args.replay_endpoint,
        topic=args.topic,
        buffer_steps=args.buffer_steps,
        encoding="sglang"
        if args.sglang
        else "vllm-sha256"
        if args.sha256_hashes
        else "vllm-map"
        if args.events_as_map
        else "vllm",
        tokenizer=args.tokenizer,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
        stream_interval=max(1, args.stream_interval),
        timing=Timing(speed=args.speed, decode_tps=args.decode_tps, prefill_tps=args.prefill_tps),
        role=args.role,
        bootstrap_timeout=args.bootstrap_timeout,
    )


def run(args: argparse.Namespace) -> int:
    serve_until_signalled(MockEngine(config_from_args(args)), args.log_level)
    return 0
