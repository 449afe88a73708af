"""Endpoints routed on load alone, their bodies passed through unchanged.

``/v1/embeddings``, ``/v1/score`` (and ``/score``), ``/v1/rerank`` (and ``/rerank``,
``/v2/rerank``), ``/tokenize`` and ``/detokenize`` reuse no KV cache worth routing for
(a pooling request's prompt runs once), so the request goes to the usable engine of the
body's ``model`` with the fewest requests in flight (this replica's and its peers'),
plus the engine's own queue when its load report is fresh; ties are broken at random.
A body without ``model`` goes to the one model served, as vLLM's single-model server
takes it. Everything else is the completion proxy's: limits, retries on another worker
when nothing reached the engine, the failure table, disconnects, the OpenAI error shape.

``/v1/responses/{id}`` (GET: retrieve) and ``/v1/responses/{id}/cancel`` (POST) go to
the engine that stored ``id`` (``router.routing.affinity``); an id the router never saw goes to
any engine, which answers for itself.
"""

from __future__ import annotations

import random
import re
import time
from typing import TYPE_CHECKING

import orjson

from router.forward.proxy import Proxy
from router.forward.relay import REQ_DROP, Exchange, ProxyDeps, read_body, send_failure
from router.forward.upstream import UpstreamError
from router.http.errors import ApiError

if TYPE_CHECKING:
    from router.http.asgi import Receive, Scope
    from router.observe.tracing import Trace
    from router.workers.registry import Worker

PATHS = (
    "/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank",
    "/tokenize", "/detokenize",
)  # fmt: skip
RESPONSES = "/v1/responses/"
_RESPONSE_PATH = re.compile(r"/v1/responses/([A-Za-z0-9_-]{1,256})(/cancel)?")


class Passthrough(Proxy):
    """One load-routed endpoint (``PATHS``)."""

    def __init__(self, deps: ProxyDeps, path: str) -> None:
        super().__init__(deps, "completion", path)
        self.endpoint = path

    async def _handle(
        self, scope: Scope, receive: Receive, ex: Exchange, trace: Trace | None
    ) -> None:
        st = self.deps
        raw = await read_body(scope, receive, st.cfg.max_body_bytes, st.cfg.body_timeout)
        workers = self.candidates(scope, raw)
        ex.watch(receive)
        await self._relay(scope, raw, workers, ex)

    def candidates(self, scope: Scope, raw: bytes) -> list[Worker]:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "invalid_json")
        model = body.get("model")
        if model is None:
            models = self.deps.registry.models()
            if len(models) > 1:
                raise ApiError(400, "model is required: the router serves several models",
                               "missing_field", "model")  # fmt: skip
            if not models:
                return list(self.deps.registry)
            (model,) = models
        if not isinstance(model, str) or not model:
            raise ApiError(400, "model must be a non-empty string", "invalid_value", "model")
        return self.deps.router.workers_for(model)

    async def _relay(
        self, scope: Scope, raw: bytes, workers: list[Worker], ex: Exchange
    ) -> None:
        st = self.deps
        method = scope["method"].encode()
        query = scope.get("query_string") or b""
        path = scope["path"] + ("?" + query.decode("latin-1") if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k not in REQ_DROP]
        exclude: set[str] = set()
        while True:
            worker = least_loaded(workers, exclude, st.cfg.load_stale_after)
            flight = worker.load.begin(0)
            try:
                resp = await st.upstream.send(
                    worker.url, path, headers, raw, st.cfg.request_timeout, method
                )
                break
            except UpstreamError as exc:
                flight.finish()
                self.failed(worker, send_failure(exc), exc, "-", exclude)
            except BaseException:
                flight.finish()
                raise
        try:
            st.metrics.passthrough.labels(self.endpoint, worker.id).inc()
            await self.stream(ex, resp, worker.id, flight, None, "-", 0)
        finally:
            resp.close()
            flight.finish()


class ResponseLookup(Passthrough):
    """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``."""

    def __init__(self, deps: ProxyDeps) -> None:
        super().__init__(deps, RESPONSES)
        self.endpoint = "/v1/responses/{id}"

    def candidates(self, scope: Scope, raw: bytes) -> list[Worker]:
        found = _RESPONSE_PATH.fullmatch(scope["path"])
        if found is None:
            raise ApiError(404, "not a response path", "response_not_found")
        wanted = "POST" if found.group(2) else "GET"
        if scope["method"] != wanted:
            raise ApiError(405, f"use {wanted} on {scope['path']}", "invalid_request")
        rid = found.group(1)
        registry = self.deps.registry
        worker_id = self.deps.affinity.lookup(rid)
        if worker_id is None:
            return list(registry)
        worker = registry.get(worker_id)
        if worker is None:
            raise ApiError(
                404,
                f"Response with id '{rid}' was stored by engine {worker_id}, which has "
                "left the pool.",
                "response_not_found",
            )
        return [worker]


def least_loaded(workers: list[Worker], exclude: set[str], stale_after: float) -> Worker:
    """The usable worker with the least in flight (engine queue included when fresh)."""
    now = time.monotonic()
    usable = [w for w in workers if w.id not in exclude and w.usable(now)]
    if not usable:
        raise ApiError(503, "no healthy worker for this request", "no_healthy_worker")

    def load(w: Worker) -> int:
        engine = w.load.engine_fresh(stale_after, now)
        waiting = engine.waiting if engine is not None else None
        return w.load.inflight_requests + (waiting or 0)

    loads = [load(w) for w in usable]
    low = min(loads)
    return random.choice([w for w, n in zip(usable, loads, strict=True) if n == low])
