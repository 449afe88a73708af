"""The admin API under ``/admin/``, behind a bearer token.

Operators add, drain and remove workers, read the index and event counters, ask why a
request would go where it goes (``POST /admin/explain``, which decides without
sending), and watch the experiment arms. Without a configured token the whole API is
off: an unauthenticated admin API would let anyone point the router at any URL. With
``processes`` > 1 the changes to the worker set are refused (``409``): they would reach
only the process that took the request (``router.http.processes``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from policies.base import NO_MATCH, Decision
from router.config import worker_spec
from router.forward.relay import ClientGone, read_body
from router.http.auth import bearer_ok
from router.http.errors import ApiError

if TYPE_CHECKING:
    import httpx

    from policies.experiments import Experiment
    from router.events.bus import Bus
    from router.events.consumer import EventSync
    from router.events.feed import EventFeed
    from router.forward.hints import HintPublisher
    from router.observe.audit import HitAudit
    from router.observe.capacity import CapacityWatch
    from router.observe.metrics import RouterMetrics
    from router.pd.exchange import PdRouter
    from router.routing.decide import Kind, Router
    from router.tokens.tokenize import TokenizerSet
    from router.workers.pools import Pool
    from router.workers.registry import Worker, WorkerRegistry


class AdminSettings(Protocol):
    """The settings the admin API reads (a ``RouterConfig`` has them)."""

    @property
    def admin_token(self) -> str | None: ...
    @property
    def max_body_bytes(self) -> int: ...
    @property
    def body_timeout(self) -> float: ...
    @property
    def experiment(self) -> str: ...
    @property
    def processes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class AdminDeps:
    """What the admin API reads and changes (``RouterState.admin_deps`` fills it)."""

    cfg: AdminSettings
    registry: WorkerRegistry
    router: Router
    tokenizers: TokenizerSet
    experiment: Experiment
    events: EventSync
    hints: HintPublisher
    audit: HitAudit
    metrics: RouterMetrics
    client: httpx.AsyncClient  # health checks of an added worker
    in_sync: Callable[[str, Pool], bool]  # what operators are told (``RouterState.in_sync``)
    bus: Bus | None = None
    feed: EventFeed | None = None
    capacity: CapacityWatch | None = None
    pd: PdRouter | None = None  # disaggregated pools' two-sided choice (router.pd.exchange)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj, default=_default), status, media_type="application/json")


def _default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    raise TypeError(type(obj).__name__)


def _reader(feed: EventFeed | None) -> dict[str, object]:
    """Which reader takes the live batches and, for the native one, its own counters and
    queue: its oversized messages are counted nowhere else, and /metrics' event lag adds
    the ingest thread's queue to this one."""
    native = feed.native if feed is not None else None
    if native is None or feed is None or not feed.native_live:
        return {"kind": "python"}  # nats-py (the stream reader, until its hand-off)
    queued, oldest = native.lag()
    return {"kind": "native", **native.stats(), "queued": queued, "oldest_s": oldest}


def admin_router(state: AdminDeps) -> APIRouter:
    async def _raw(request: Request) -> bytes:
        """The body, under the same size and time limits as a completion's (a 9 MiB
        explain body was read whole)."""
        cfg = state.cfg
        try:
            return await read_body(
                request.scope, request.receive, cfg.max_body_bytes, cfg.body_timeout
            )
        except ClientGone:
            message = "the client left before its body was complete"
            raise ApiError(400, message, "invalid_body") from None

    async def _body(request: Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await _raw(request))
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"body is not valid JSON: {exc}", "invalid_json") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "body must be a JSON object", "invalid_json")
        return body

    def authorize(request: Request) -> None:
        token = state.cfg.admin_token
        if not token:
            raise ApiError(
                403, "the admin API is disabled: configure admin_token", "admin_disabled"
            )
        if not bearer_ok(request.scope["headers"], [token.encode()]):
            raise ApiError(401, "admin API: missing or wrong bearer token", "unauthorized")

    api = APIRouter(prefix="/admin", dependencies=[Depends(authorize)])
    registry = state.registry

    def describe(worker: Worker, now: float) -> dict[str, object]:
        in_sync = all(state.in_sync(t, worker.pool) for t in worker.targets)
        return {**worker.describe(now), "in_sync": in_sync}

    def single_process(what: str) -> None:
        """Refuse a change to the worker set when other processes would not see it."""
        n = state.cfg.processes
        if n > 1:
            raise ApiError(
                409,
                f"{what} is refused: this router runs {n} processes (processes = {n}) and the "
                "change would reach only the one that answered; change the workers in the "
                "config (or --worker) and restart, or run one process",
                "multiple_processes",
            )

    def worker_or_404(worker_id: str) -> Any:
        worker = registry.get(worker_id)
        if worker is None:
            raise ApiError(404, f"no worker {worker_id}", "worker_not_found")
        return worker

    @api.get("/workers")
    async def list_workers() -> Response:
        now = time.monotonic()
        return _json({"workers": [describe(w, now) for w in registry]})

    @api.post("/workers")
    async def add_worker(request: Request) -> Response:
        single_process("adding a worker")
        try:
            spec = worker_spec(await _body(request), "worker")
            worker = registry.add(spec)
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_worker") from exc
        await registry.check(state.client, worker)
        state.events.resync(worker.id)
        return _json(describe(worker, time.monotonic()), 201)

    @api.post("/workers/{worker_id}/drain")
    async def drain_worker(worker_id: str) -> Response:
        single_process("draining a worker")
        worker_or_404(worker_id)
        return _json(describe(registry.drain(worker_id), time.monotonic()))

    @api.delete("/workers/{worker_id}")
    async def remove_worker(worker_id: str) -> Response:
        single_process("removing a worker")
        worker_or_404(worker_id)
        worker = registry.remove(worker_id)
        return _json({"removed": worker_id, "inflight_requests": worker.load.inflight_requests})

    @api.get("/index")
    async def index_stats() -> Response:
        pools = {}
        for pool in registry.pools.values():
            ing = pool.ingest
            pools[pool.name] = {
                "block_size": pool.block_size,
                "index": pool.index.stats(),
                "events_applied": ing.events_applied,
                "batches_applied": ing.batches_applied,
                "gaps": ing.gaps,
                "restarts": ing.restarts,
                "duplicates": ing.duplicates,
                "dropped_events": dict(ing.errors),
                "in_sync": {w: state.in_sync(w, pool) for w in pool.index.workers},
                # vLLM's sha256 block names, which only prefetch hints read (router/http/app.py)
                "engine_names_kept": ing.keep_names,
            }
        nats = {
            "connected": state.bus.connected if state.bus else False,
            "events_up_to_date": state.feed.up_to_date if state.feed else False,
            "reconnects": state.bus.reconnects if state.bus else 0,
            "dropped_publishes": state.bus.dropped_publishes if state.bus else 0,
            "counts": dict(state.events.counts),
            "hints_published": state.hints.published,
            "hints_skipped": state.hints.skipped,
            "reader": _reader(state.feed),
        }
        return _json({"pools": pools, "nats": nats, "audit": state.audit.snapshot()})

    @api.post("/explain")
    async def explain(request: Request) -> Response:
        """The decision for a request body and every worker's numbers; nothing is sent."""
        raw = await _raw(request)
        kind: Kind = "chat" if b'"messages"' in raw else "completion"
        headers = {
            k: v for k, v in request.headers.items() if k in ("x-session-id", "x-request-id")
        }
        router = state.router
        prep = await router.prepare(router.parse(kind, raw, headers), len(raw))
        disaggregated = state.pd is not None and state.pd.disaggregated(prep)
        pd = state.pd.explain(prep) if state.pd is not None and disaggregated else None
        if pd is None:
            decision, views = router.decide(prep)
        else:  # "decision" is the engine that answers: the decode side's choice
            views = router.views(prep)
            decision = Decision(pd["decode"]["worker_id"], pd["decode"]["prefetch"],
                                pd["decode"]["scores"], pd["decode"]["reason"])  # fmt: skip
        by_id = {v.worker_id: v for v in views}
        matches = prep.pool.index.match_tiers(prep.request.block_hashes)
        now = time.monotonic()
        workers = []
        for w in prep.workers:
            for rank, tid in enumerate(w.targets):  # one row per DP rank (router/workers/dp.py)
                view = by_id.get(tid)
                workers.append(
                    {
                        "worker_id": tid,
                        "worker": w.id,
                        "dp_rank": rank if w.dp_size > 1 else None,
                        "usable": view is not None,
                        "in_sync": state.in_sync(tid, prep.pool),
                        "match": matches.get(tid, NO_MATCH),
                        "view": view,
                        "scores": decision.scores.get(tid, {}),
                        "state": describe(w, now),
                    }
                )
        chosen = registry.target(decision.worker_id)
        return _json(
            {
                "request_id": prep.request.request_id,
                "model": prep.request.model,
                "pool": prep.pool.name,
                "arm": prep.arm,
                "policy": state.experiment.policy_for(prep.arm).name,
                "num_tokens": prep.request.num_tokens,
                "blocks": len(prep.request.block_hashes),
                "decision": {
                    "worker_id": decision.worker_id,
                    "worker": chosen[0].id if chosen is not None else decision.worker_id,
                    "dp_rank": chosen[1] if chosen is not None else None,
                    "reason": decision.reason,
                    "prefetch": decision.prefetch,
                },
                "workers": workers,
                **({} if pd is None else {"pd": pd}),
            }
        )

    @api.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """The router's token ids for a request body, to hold against the engine's own
        ``/tokenize`` (``cache-router doctor`` does): hashes match only if these agree."""
        raw = await request.body()
        kind: Kind = "chat" if b'"messages"' in raw else "completion"
        parsed = state.router.parse(kind, raw, {})
        tok = state.tokenizers.get(parsed.model)
        body = parsed.body
        if kind == "chat":
            ids, _ = tok.chat(body)
        else:
            ids, _ = tok.completion(body["prompt"], bool(body.get("add_special_tokens", True)))
        tokens = (
            list(ids)
            if not isinstance(ids, bytes)
            else [int.from_bytes(ids[i : i + 4], "little") for i in range(0, len(ids), 4)]
        )
        return _json({"model": parsed.model, "tokenizer": tok.name, "tokens": tokens})

    @api.get("/capacity")
    async def capacity(model: str | None = None) -> Response:
        """The capacity forecast (router/observe/capacity.py), per model or for ``?model=``."""
        watch = state.capacity
        if watch is None:
            raise ApiError(404, "the capacity forecast is off (forecast_tracked = 0)", "off")
        if model is None:
            return _json(watch.reports())
        if not registry.for_model(model):
            raise ApiError(404, f"no worker serves model {model}", "model_not_found")
        return _json(watch.report(model))

    @api.get("/experiments")
    async def experiments() -> Response:
        live = state.metrics.by_arm()
        arms = [
            {
                "name": a.name,
                "policy": a.policy,
                "weight": a.weight,
                "params": dict(a.params),
                "decode_policy": a.decode_policy,  # disaggregated pools; None: the router's
                "decode_params": dict(a.decode_params),
                "prefill_params": dict(a.prefill_params),  # over params, on prefill engines
                "metrics": live.get(a.name, {}),
            }
            for a in state.experiment.arms
        ]
        return _json({"experiment": state.cfg.experiment, "arms": arms})

    return api
