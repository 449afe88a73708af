"""The router application: its state, its lifecycle, and the ASGI entry point.

``build_app(cfg)`` returns an ASGI app: completions go straight to the raw proxy
handlers (``router.forward.proxy``); everything else (``/v1/models``, ``/health``,
``/metrics``, ``/admin/*``) is a FastAPI app where convenience beats microseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from index.capacity import Sampling
from policies.experiments import Arm, Experiment
from router.admin.api import admin_router
from router.admin.common import AdminDeps
from router.admission.gate import AdmissionCollector, make_gate
from router.config import ConfigError, PdSettings, RouterConfig
from router.events.bus import Bus, nats_options
from router.events.consumer import EventSync
from router.events.feed import EventFeed
from router.events.replicas import ReplicaShare, default_replica_id
from router.forward.hints import HintPublisher
from router.forward.passthrough import PATHS as PASSTHROUGH_PATHS
from router.forward.passthrough import RESPONSES, Passthrough, ResponseLookup
from router.forward.proxy import Proxy
from router.forward.relay import ProxyDeps, send_error
from router.forward.upstream import Upstream
from router.http.asgi import Receive, Scope, Send
from router.http.auth import bearer_ok
from router.http.edge import Edge
from router.http.errors import ApiError, error_body
from router.http.openapi import completion_paths
from router.http.tls import ReloadingTls, engine_tls
from router.observe.audit import AuditCollector, HitAudit
from router.observe.capacity import CapacityCollector, CapacityWatch
from router.observe.loop import LoopWatch
from router.observe.metrics import RouterMetrics, StateCollector
from router.observe.tracing import Tracing
from router.pd.exchange import PdRouter
from router.routing.affinity import ResponseAffinity
from router.routing.decide import Router
from router.routing.gateway import GatewayRouter
from router.tokens.pool import EncodeProcesses, TokenizePool
from router.tokens.prefix_cache import PrefixCache
from router.tokens.tokenize import TokenizerSet
from router.workers.pools import Pool
from router.workers.registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)


def make_experiment(cfg: RouterConfig) -> Experiment:
    """The configured A/B arms, or one arm named after the policy."""
    arms = list(cfg.arms) or [
        Arm(cfg.policy, cfg.policy, cfg.policy_params, prefill_params=cfg.prefill_params)
    ]
    return Experiment(arms, salt=cfg.experiment)


def discovery_sources(cfg: RouterConfig, registry: WorkerRegistry) -> list[Any]:
    """The DNS discovery sources (dnspython is imported only when one is configured) and
    the Kubernetes API's (router.workers.kubernetes)."""
    from router.workers.kubernetes import kubernetes_sources

    pods = kubernetes_sources(cfg.kubernetes, registry, cfg.drain_timeout)
    if not cfg.discovery:
        return list(pods)
    from router.workers.discovery import DnsDiscovery, extra_missing

    missing = extra_missing()
    if missing is not None:
        raise ConfigError(missing)
    return [*(DnsDiscovery(spec, registry, cfg.drain_timeout) for spec in cfg.discovery), *pods]


class RouterState:
    """Everything one router process holds; created at build time, started in the lifespan."""

    def __init__(self, cfg: RouterConfig, tracing: Tracing | None = None) -> None:
        self.cfg = cfg
        self.tracing = tracing or Tracing.from_config(cfg)  # None: off, and free
        self.edge = Edge(cfg)
        self.experiment = make_experiment(cfg)
        self.bus = Bus(cfg.nats_url, options=nats_options(cfg)) if cfg.nats_url else None
        # vLLM's 32-byte block names are kept only where a hint can carry them, on this
        # bus (24 B a block natively: ~94 -> ~71 B a (block, worker) pair, BENCHMARKS.md
        # session 15)
        hints = self.experiment.sends_hints and self.bus is not None
        self.engine_tls = _engine_tls(cfg)
        tls = self.engine_tls.context if self.engine_tls is not None else None
        self.registry = WorkerRegistry(cfg, keep_names=hints, tls=tls)
        for spec in cfg.workers:
            self.registry.add(spec)
        self.discovery = discovery_sources(cfg, self.registry)
        self.encoders = (
            EncodeProcesses(cfg.tokenize_processes, cfg.tokenize_timeout)
            if cfg.tokenize_processes
            else None
        )
        self.tokenizers = TokenizerSet(self._tokenizer_path, self.encoders)
        self.tokenize_pool = TokenizePool(
            cfg.tokenize_threads, cfg.tokenize_queue, cfg.tokenize_timeout
        )
        self.events = EventSync(self.registry, cfg.subject_prefix, tracing=self.tracing)
        self.feed = EventFeed.from_config(cfg, self.events) if self.bus else None
        self.replicas = ReplicaShare.from_config(cfg, self.registry, self.bus)
        self.affinity = ResponseAffinity()
        # a gateway never tokenizes; 0 MiB turns the cache off
        self.prefixes = (
            PrefixCache(cfg.prefix_cache_mb << 20)
            if cfg.prefix_cache_mb and not cfg.gateway
            else None
        )
        router_class = GatewayRouter if cfg.gateway else Router
        self.router = router_class(
            cfg,
            self.registry,
            self.tokenizers,
            self.experiment,
            self.tokenize_pool,
            blind=self.feed.blind if self.feed is not None else None,
            on_predict=self.replicas.mark if self.replicas is not None else None,
            affinity=self.affinity,
            prefixes=self.prefixes,
        )
        if self.bus is not None:
            replica = self.replicas.id if self.replicas else cfg.replica_id or default_replica_id()
            self.affinity.share(self.bus, cfg.subject_prefix, replica, cfg.share_interval)
        self.hints = HintPublisher(self.bus, cfg.subject_prefix)
        self.metrics = RouterMetrics()
        self.pd: PdRouter | None = None
        self.metrics.add_collector(StateCollector(self.registry, self.counts, self.events.lag))
        self.loop = LoopWatch(self.metrics.registry)  # is the router's own loop late, and why
        self.metrics.add_collector(self.tokenize_pool)
        if self.prefixes is not None:
            self.metrics.add_collector(self.prefixes)
        self.audit = HitAudit(cfg.audit_bound, self._events_seen)
        self.metrics.add_collector(AuditCollector(self.audit))
        self.capacity: CapacityWatch | None = None
        if cfg.forecast_tracked and not cfg.gateway:  # a gateway sees no block hashes
            self.capacity = CapacityWatch(self.registry, Sampling(max_tracked=cfg.forecast_tracked))
            self.metrics.add_collector(CapacityCollector(self.capacity, self.metrics))
        self.client: httpx.AsyncClient = _client(cfg, tls)  # cold paths: health, scrapes
        self.upstream = Upstream(tls=tls)  # the hot path's engine connections
        # admission at the router (router.admission); in gateway mode its workers are
        # clusters, held for only under a fixed per-cluster limit (docs/overload.md)
        self.gate = make_gate(cfg, self.router, self.registry) if cfg.admission else None
        if self.gate is not None:
            self.metrics.add_collector(AdmissionCollector(self.gate))
        self.pd = PdRouter(cfg.section(PdSettings), self.proxy_deps())  # disaggregated pools
        self._tasks: list[asyncio.Task[Any]] = []
        self.epp: Any = None  # the EPP's gRPC server (router.epp), when epp_port is set

    def proxy_deps(self) -> ProxyDeps:
        """The part of this state the hot path works with."""
        return ProxyDeps(
            cfg=self.cfg,
            router=self.router,
            registry=self.registry,
            upstream=self.upstream,
            metrics=self.metrics,
            edge=self.edge,
            hints=self.hints,
            audit=self.audit,
            experiment=self.experiment,
            affinity=self.affinity,
            capacity=self.capacity,
            tracing=self.tracing,
            pd=self.pd,
            gate=self.gate,
        )

    def admin_deps(self) -> AdminDeps:
        """The part of this state the admin API reads and changes."""
        return AdminDeps(
            cfg=self.cfg,
            registry=self.registry,
            router=self.router,
            tokenizers=self.tokenizers,
            experiment=self.experiment,
            events=self.events,
            hints=self.hints,
            audit=self.audit,
            metrics=self.metrics,
            client=self.client,
            in_sync=self.in_sync,
            loop=self.loop,
            bus=self.bus,
            feed=self.feed,
            capacity=self.capacity,
            pd=self.pd,
            gate=self.gate,
        )

    async def start(self) -> None:
        if self.cfg.gateway:
            log.info("gateway mode: %d clusters, policy %s", len(self.registry), self.cfg.policy)
        else:
            self.warn_fallbacks()
        if self.bus is None:
            if not self.cfg.gateway:
                log.warning("no NATS url: KV events are off, routing on load alone")
        else:
            # a worker back from the dead resyncs from its agent (its engine restarted)
            self.registry.on_up.append(self._resync_worker)
            self.registry.on_leave.append(self._worker_left)
            if self.feed is not None:
                self.bus.on_connect(self.feed.on_connect)
                self.bus.on_reconnect(self.feed.on_reconnect)
                self.bus.on_disconnect(self.feed.on_disconnect)
                self.bus.on_error(self.events.on_nats_error)
            if self.replicas is not None:
                self.bus.on_connect(self.replicas.attach)
                self.bus.on_reconnect(self.replicas.on_reconnect)
            self.bus.on_connect(self.affinity.attach)
            self.bus.start()
        # requests waiting on an engine that hangs (SIGSTOP, a wedged process) fail now
        stall = self.cfg.stall_after

        def fail_stalled(worker: Worker) -> None:
            self.upstream.stalled(worker.url, stall)

        self.registry.on_failing.append(fail_stalled)
        if self.engine_tls is not None:
            self.engine_tls.follow()  # a renewed client certificate reaches new connections
        self._tasks.append(asyncio.create_task(self.loop.run(), name="loop-watch"))
        self._tasks.append(asyncio.create_task(self.registry.monitor(self.client), name="health"))
        for source in self.discovery:
            self._tasks.append(asyncio.create_task(source.run(self.client), name="discovery"))
        if self.capacity is not None:
            self._tasks.append(asyncio.create_task(self.capacity.run(), name="capacity"))
        if self.gate is not None:
            self._tasks.append(asyncio.create_task(self.gate.run(), name="admission"))
        if self.cfg.epp_port is not None:  # a Gateway API inference gateway's picker
            from router.epp.server import start_picker

            self.epp = await start_picker(
                self.cfg, self.cfg.host, self.proxy_deps(), self.discovery
            )

    def _resync_worker(self, worker: Worker) -> None:
        for tid in worker.targets:  # each DP rank is its own event source
            self.events.resync(tid)

    def _worker_left(self, worker: Worker) -> None:
        """The native reader's counts for a leaving worker are taken while it is known
        (they are collected on a tick), and its routes end: a slot the index gives the
        next newcomer must not take the old worker's late batches."""
        native = self.feed.native if self.feed is not None else None
        if native is not None:
            native.collect()
            for tid in worker.targets:
                native.unroute(tid)

    def _events_seen(self, worker_id: str) -> bool:
        worker = self.registry.source(worker_id)  # a worker or one of its DP ranks
        return worker is not None and bool(worker.pool.ingest.last_seqs(worker_id))

    def _tokenizer_path(self, model: str) -> str | None:
        """A model's tokenizer; a LoRA adapter learnt from an engine uses its base's."""
        base = self.registry.adapters.get(model)
        if model not in self.cfg.models and base is not None:
            return self.cfg.tokenizer_for(base)
        return self.cfg.tokenizer_for(model)

    def in_sync(self, worker_id: str, pool: Pool) -> bool:
        """What operators are told: the worker's events applied in order *and* the event
        feed up to date (while NATS is away nobody knows what the engines did)."""
        return (self.feed is None or self.feed.up_to_date) and pool.ingest.in_sync(worker_id)

    def counts(self) -> dict[str, int]:
        """Event, stream and replica counters, for metrics."""
        peers = {**(self.replicas.counts if self.replicas is not None else {}),
                 **self.affinity.counts}  # fmt: skip
        return {**self.events.counts, **peers}

    def warn_fallbacks(self) -> None:
        models = {w.model for w in self.cfg.workers if w.model} | set(self.cfg.models)
        missing = sorted(m for m in models if self.cfg.tokenizer_for(m) is None)
        if missing or (not models and self.cfg.tokenizer is None):
            log.warning(
                "no tokenizer for %s: using the byte fallback (prefix hashes match only "
                "engines that tokenize the same way, e.g. the mock engine)",
                ", ".join(missing) or "any model",
            )
        for m in models:
            if self.cfg.tokenizer_for(m) is not None:
                self.tokenizers.get(m)  # load now: a bad path fails at start, not mid-traffic
        if self.cfg.tokenizer is not None:
            # the models learnt from the engines later use it: loaded now, not by the
            # first request (router.tokens.tokenize.TokenizerSet.load)
            self.tokenizers.load(self.cfg.tokenizer)

    async def stop(self) -> None:
        if self.epp is not None:
            await self.epp.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.registry.close()
        if self.pd is not None:
            await self.pd.close()
        if self.replicas is not None:
            await self.replicas.close()
        await self.affinity.close()
        if self.feed is not None:
            await self.feed.close()
        await self.events.close()
        if self.bus is not None:
            await self.bus.close()
        await self.client.aclose()
        self.upstream.close()
        if self.engine_tls is not None:
            self.engine_tls.close()
        self.tokenize_pool.shutdown()
        if self.encoders is not None:
            self.encoders.shutdown()
        if self.tracing is not None:
            self.tracing.shutdown()  # flushes the spans still batched


def _client(cfg: RouterConfig, tls: ssl.SSLContext | None) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.health_timeout), follow_redirects=False, verify=tls or True
    )


def _engine_tls(cfg: RouterConfig) -> ReloadingTls | None:
    """The router's TLS towards ``https`` engines, when any ``engine_tls_*`` is set."""
    if cfg.engine_tls_ca is None and cfg.engine_tls_cert is None and cfg.engine_tls_check_hostname:
        return None
    return engine_tls(
        cfg.engine_tls_ca, cfg.engine_tls_cert, cfg.engine_tls_key, cfg.engine_tls_check_hostname
    )


def _fastapi(state: RouterState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(
        title="cache-router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )

    @app.get("/v1/models")
    async def models() -> Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "cache-router"}
            for m in sorted(state.registry.models())
        ]
        return Response(
            orjson.dumps({"object": "list", "data": data}), media_type="application/json"
        )

    @app.get("/health")
    async def health() -> Response:
        """200 while some worker is usable; 503 otherwise, so a gateway moves away."""
        now = time.monotonic()
        usable = sum(1 for w in state.registry if w.usable(now))
        status = "ok" if usable else "no usable worker"
        body = {"status": status, "workers": len(state.registry), "usable_workers": usable}
        code = 200 if usable else 503
        return Response(orjson.dumps(body), code, media_type="application/json")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        token = state.cfg.metrics_token
        if token is not None and not bearer_ok(request.scope["headers"], [token.encode()]):
            raise ApiError(401, "metrics: missing or wrong bearer token", "unauthorized")
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(ApiError)
    async def api_error(_req: Request, exc: ApiError) -> Response:
        # a refused upload (413) or a stalled one (408) may still be arriving: end it
        close = {"connection": "close"} if exc.status in (408, 413) else None
        return Response(
            exc.body(), status_code=exc.status, media_type="application/json", headers=close
        )

    @app.exception_handler(HTTPException)
    async def http_error(_req: Request, exc: HTTPException) -> Response:
        body = error_body(exc.status_code, str(exc.detail), f"http_{exc.status_code}")
        return Response(body, status_code=exc.status_code, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def invalid(_req: Request, exc: RequestValidationError) -> Response:
        return Response(error_body(400, str(exc.errors()), "invalid_request"), 400)

    app.include_router(admin_router(state.admin_deps()))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema["paths"] = {**completion_paths(state.cfg), **schema.get("paths", {})}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    admin_token = [state.cfg.admin_token.encode()] if state.cfg.admin_token else []

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json(request: Request) -> Response:
        """The schema; the admin API's paths only for a caller with the admin token (a map
        of the admin surface is no business of the public port's clients)."""
        schema = openapi()
        if not (admin_token and bearer_ok(request.scope["headers"], admin_token)):
            paths = {p: op for p, op in schema["paths"].items() if not p.startswith("/admin")}
            schema = {**schema, "paths": paths}
        return Response(orjson.dumps(schema), media_type="application/json")

    return app


class RouterApp:
    """The ASGI entry point: completions to the proxy, the rest to FastAPI."""

    def __init__(self, cfg: RouterConfig, tracing: Tracing | None = None) -> None:
        self.state = RouterState(cfg, tracing)
        self.edge = self.state.edge
        self.api = _fastapi(self.state)
        deps = self.state.proxy_deps()
        self.hot = {
            "/v1/chat/completions": Proxy(deps, "chat", "/v1/chat/completions"),
            "/v1/completions": Proxy(deps, "completion", "/v1/completions"),
            "/v1/responses": Proxy(deps, "responses", "/v1/responses"),
            "/v1/messages": Proxy(deps, "messages", "/v1/messages"),
            **{path: Passthrough(deps, path) for path in PASSTHROUGH_PATHS},
        }
        self.lookup = ResponseLookup(deps)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self.edge.check(scope)
            if refused is not None:
                self.state.metrics.error("-", "-", refused.code)
                await send_error(send, refused, close=True)
                return
            if scope["method"] == "POST":
                handler = self.hot.get(scope["path"])
                if handler is not None:
                    await handler(scope, receive, send)
                    return
            if scope["path"].startswith(RESPONSES):
                await self.lookup(scope, receive, send)
                return
        await self.api(scope, receive, send)


def build_app(cfg: RouterConfig) -> RouterApp:
    return RouterApp(cfg)
