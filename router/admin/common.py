"""What every admin handler shares: its dependencies, the JSON answer, the body it reads
under the completion's limits, and how a worker is described and looked up.

The API is off without ``admin_token`` (an unauthenticated admin API would let anyone
point the router at any URL). With ``processes`` > 1 the changes to the worker set are
refused (``409``): they would reach only the process that took the request
(``router.http.processes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from fastapi import Request
from fastapi.responses import Response

from router.forward.relay import ClientGone, read_body
from router.http.auth import bearer_ok
from router.http.errors import ApiError

if TYPE_CHECKING:
    import httpx

    from policies.experiments import Experiment
    from router.admission.gate import Gate
    from router.events.bus import Bus
    from router.events.consumer import EventSync
    from router.events.feed import EventFeed
    from router.forward.hints import HintPublisher
    from router.observe.audit import HitAudit
    from router.observe.capacity import CapacityWatch
    from router.observe.loop import LoopWatch
    from router.observe.metrics import RouterMetrics
    from router.pd.exchange import PdRouter
    from router.routing.decide import Router
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
    loop: LoopWatch | None = None  # the event loop's recent lateness (router.observe.loop)
    bus: Bus | None = None
    feed: EventFeed | None = None
    capacity: CapacityWatch | None = None
    pd: PdRouter | None = None  # disaggregated pools' two-sided choice (router.pd.exchange)
    gate: Gate | None = None  # admission at the router (router.admission)


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj, default=_default), status, media_type="application/json")


def _default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    raise TypeError(type(obj).__name__)


def authorizer(state: AdminDeps) -> Callable[[Request], None]:
    """The dependency every admin route has: 403 without a token configured, 401 without
    the right bearer token."""

    def authorize(request: Request) -> None:
        token = state.cfg.admin_token
        if not token:
            raise ApiError(
                403, "the admin API is disabled: configure admin_token", "admin_disabled"
            )
        if not bearer_ok(request.scope["headers"], [token.encode()]):
            raise ApiError(401, "admin API: missing or wrong bearer token", "unauthorized")

    return authorize


async def raw_body(state: AdminDeps, request: Request) -> bytes:
    """The body, under the same size and time limits as a completion's (a 9 MiB explain
    body was read whole)."""
    cfg = state.cfg
    try:
        return await read_body(request.scope, request.receive, cfg.max_body_bytes, cfg.body_timeout)
    except ClientGone:
        message = "the client left before its body was complete"
        raise ApiError(400, message, "invalid_body") from None


async def json_body(state: AdminDeps, request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await raw_body(state, request))
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}", "invalid_json") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object", "invalid_json")
    return body


def describe(state: AdminDeps, worker: Worker, now: float) -> dict[str, object]:
    """A worker as operators see it, with whether the index may be trusted for it."""
    in_sync = all(state.in_sync(t, worker.pool) for t in worker.targets)
    return {**worker.describe(now), "in_sync": in_sync}
