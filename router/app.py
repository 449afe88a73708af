"""The router application: its state, its lifecycle, and the ASGI entry point.

``build_app(cfg)`` returns an ASGI app: completions go straight to the raw proxy
handlers (``router.proxy``); everything else (``/v1/models``, ``/health``,
``/metrics``, ``/admin/*``) is a FastAPI app where convenience beats microseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from policies.experiments import Arm, Experiment
from router.admin import admin_router
from router.bus import Bus
from router.config import RouterConfig
from router.errors import ApiError, error_body
from router.events import EventSync
from router.hints import HintPublisher
from router.metrics import RouterMetrics, StateCollector
from router.proxy import Proxy, Receive, Scope, Send
from router.routing import Router
from router.tokenize import TokenizerSet
from router.upstream import Upstream
from router.workers import WorkerRegistry

log = logging.getLogger(__name__)


def make_experiment(cfg: RouterConfig) -> Experiment:
    """The configured A/B arms, or one arm named after the policy."""
    arms = [Arm(a.name, a.policy, a.params, a.weight) for a in cfg.arms] or [
        Arm(cfg.policy, cfg.policy, cfg.policy_params)
    ]
    return Experiment(arms, salt=cfg.experiment)


class RouterState:
    """Everything one router process holds; created at build time, started in the lifespan."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.registry = WorkerRegistry(cfg)
        for spec in cfg.workers:
            self.registry.add(spec)
        self.tokenizers = TokenizerSet(cfg.tokenizer_for)
        self.experiment = make_experiment(cfg)
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.router = Router(cfg, self.registry, self.tokenizers, self.experiment, self.executor)
        self.bus = Bus(cfg.nats_url) if cfg.nats_url else None
        self.events = EventSync(self.registry, cfg.subject_prefix)
        self.hints = HintPublisher(self.bus, cfg.subject_prefix)
        self.metrics = RouterMetrics()
        self.metrics.add_collector(StateCollector(self.registry, lambda: dict(self.events.counts)))
        self.client: httpx.AsyncClient = _client(cfg)  # cold paths: health, scrapes
        self.upstream = Upstream()  # the hot path's engine connections
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        self.warn_fallbacks()
        if self.bus is None:
            log.warning("no NATS url: KV events are off, routing on load alone")
        else:
            self.bus.on_connect(self.events.attach)
            self.bus.on_connect(self.events.resync_all)
            self.bus.on_reconnect(self.events.resync_all)
            self.bus.start()
        self._tasks.append(asyncio.create_task(self.registry.monitor(self.client), name="health"))

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

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.events.close()
        if self.bus is not None:
            await self.bus.close()
        await self.client.aclose()
        self.upstream.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


def _client(cfg: RouterConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.health_timeout), follow_redirects=False)


def _fastapi(state: RouterState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="cache-router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router_state = state

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
        now = time.monotonic()
        usable = sum(1 for w in state.registry if w.usable(now))
        body = {"status": "ok", "workers": len(state.registry), "usable_workers": usable}
        return Response(orjson.dumps(body), media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(ApiError)
    async def api_error(_req: Request, exc: ApiError) -> Response:
        return Response(exc.body(), status_code=exc.status, media_type="application/json")

    @app.exception_handler(HTTPException)
    async def http_error(_req: Request, exc: HTTPException) -> Response:
        body = error_body(exc.status_code, str(exc.detail), f"http_{exc.status_code}")
        return Response(body, status_code=exc.status_code, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def invalid(_req: Request, exc: RequestValidationError) -> Response:
        return Response(error_body(400, str(exc.errors()), "invalid_request"), 400)

    app.include_router(admin_router(state))
    return app


class RouterApp:
    """The ASGI entry point: completions to the proxy, the rest to FastAPI."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.state = RouterState(cfg)
        self.api = _fastapi(self.state)
        self.hot = {
            "/v1/chat/completions": Proxy(self.state, "chat", "/v1/chat/completions"),
            "/v1/completions": Proxy(self.state, "completion", "/v1/completions"),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.hot.get(scope["path"])
            if handler is not None:
                await handler(scope, receive, send)
                return
        await self.api(scope, receive, send)


def build_app(cfg: RouterConfig) -> RouterApp:
    return RouterApp(cfg)
