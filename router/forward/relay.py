"""What the proxy offers the code that sends a request its own way (PD, passthrough).

``router.forward.proxy`` is the hot path for one engine; ``router.pd.exchange`` (prefill
then decode) and ``router.forward.passthrough`` (load-routed endpoints) reuse its parts
through what is here, and only through it: the failure table (which send failures are
retried, on whom they count), the client's exchange (its body, its disconnect watcher,
its error answer), the dependencies a request reads, and the ``Relay`` protocol (count a
failed send, hint, stream the engine's answer back). ``Disaggregation`` is what the proxy
asks of PD in turn, so neither side imports the other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from router.forward.upstream import ConnectFailed, UpstreamError, UpstreamStalled, UpstreamTimeout
from router.http.asgi import Receive, Scope, Send
from router.http.errors import ApiError, ErrorCode, ErrorKind

if TYPE_CHECKING:
    from policies.base import Decision
    from policies.experiments import Experiment
    from router.admission.gate import Gate
    from router.forward.hints import HintPublisher
    from router.forward.upstream import Response, Upstream
    from router.http.edge import Edge
    from router.observe.audit import HitAudit
    from router.observe.capacity import CapacityWatch
    from router.observe.metrics import RouterMetrics, Series
    from router.observe.tracing import Tracing
    from router.routing.affinity import ResponseAffinity
    from router.routing.decide import Prepared, Router
    from router.workers.load import Flight
    from router.workers.registry import Worker, WorkerRegistry

# Hop-by-hop and recomputed headers: never forwarded either way.
REQ_DROP = frozenset(
    (b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
     b"upgrade", b"proxy-connection", b"proxy-authorization", b"expect", b"trailer")
)  # fmt: skip
_JSON = [(b"content-type", b"application/json")]


class ProxySettings(Protocol):
    """The settings the hot path reads (a ``RouterConfig`` has them)."""

    @property
    def max_body_bytes(self) -> int: ...
    @property
    def body_timeout(self) -> float: ...
    @property
    def request_timeout(self) -> float: ...
    @property
    def connect_retries(self) -> int: ...
    @property
    def migrate_max(self) -> int: ...
    @property
    def first_token_stall_after(self) -> float: ...
    @property
    def token_stall_after(self) -> float: ...
    @property
    def load_stale_after(self) -> float: ...
    @property
    def gateway(self) -> bool: ...
    @property
    def forward_authorization(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class ProxyDeps:
    """What the hot path works with, and nothing more: the parts of the router state
    a request reads or counts into (``RouterState.proxy_deps`` fills it)."""

    cfg: ProxySettings
    router: Router
    registry: WorkerRegistry
    upstream: Upstream
    metrics: RouterMetrics
    edge: Edge
    hints: HintPublisher
    audit: HitAudit
    experiment: Experiment
    affinity: ResponseAffinity
    capacity: CapacityWatch | None = None
    tracing: Tracing | None = None  # None: off, and free
    pd: Disaggregation | None = None  # disaggregated pools (router.pd.exchange)
    gate: Gate | None = None  # admission at the router (router.admission); None: off


@dataclass(frozen=True, slots=True)
class Failure:
    """What one way of failing before the engine answered costs, and who pays.

    ``retry``: the next-best worker gets the request; only when nothing can have run on
    this one, since a request an engine may have started is never replayed.
    ``suspect``: the health checker probes the worker now instead of at its next round.
    """

    status: int  # the client's, when no worker is left to try
    code: ErrorCode  # the OpenAI error ``code``
    kind: ErrorKind | ErrorCode  # the ``errors_total`` label
    reason: str  # logged as the worker's failure
    retry: bool
    suspect: bool
    message: str | None = None  # None: the exception's text


# Failures raised by ``Upstream.send``; the first row whose class matches wins, so a
# subclass comes before its base (both others are ``UpstreamError``s).
# A stall is retried: the engine is down by its health checks and sent nothing on any
# connection for ``stall_after``; its connection is closed, so it aborts the request
# when it wakes (issue 32: 3 of 9 requests got 504s a SIGSTOPped engine never read).
SEND_FAILURES: tuple[tuple[type[UpstreamError], Failure], ...] = (
    (ConnectFailed, Failure(502, "upstream_unreachable", "connect", "connect failed", True, True)),
    (UpstreamStalled, Failure(504, "upstream_timeout", "stall", "stalled", True, True)),
    (UpstreamTimeout, Failure(504, "upstream_timeout", "timeout", "timeout", False, True)),
    (UpstreamError, Failure(502, "upstream_error", "upstream", "upstream error", False, False)),
)
# A gateway's cluster answered 503: it has no usable engine, nothing ran, another may.
CLUSTER_UNAVAILABLE = Failure(
    503, "no_healthy_worker", "cluster_unavailable", "cluster unavailable", True, False,
    "no cluster could take the request",
)  # fmt: skip


def send_failure(exc: UpstreamError) -> Failure:
    return next(f for cls, f in SEND_FAILURES if isinstance(exc, cls))


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def read_body(scope: Scope, receive: Receive, limit: int, timeout: float) -> bytes:
    """The request body; ``ApiError`` 413 once it is known to exceed ``limit`` bytes, 408
    when it takes over ``timeout`` seconds (a slow client holds a connection, not a worker).
    """
    for key, value in scope["headers"]:
        if key == b"content-length" and value.isdigit() and int(value) > limit:
            raise ApiError(413, f"request body over {limit} bytes", "request_too_large")
    chunks: list[bytes] = []
    size = 0
    try:
        # the timer covers the first body byte too: complete headers announcing a body
        # and then silence used to hold the connection for ever (one timer handle, ~1 us)
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body over {limit} bytes", "request_too_large")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return chunk if len(chunks) == 1 else b"".join(chunks)
    except TimeoutError:
        raise ApiError(
            408, f"request body not received within {timeout:g} s", "request_timeout"
        ) from None


_CLOSE = [*_JSON, (b"connection", b"close")]


async def send_error(send: Send, err: ApiError, close: bool = False) -> None:
    """The error response; ``close`` ends the connection (its request may be unread)."""
    body = err.body()
    headers = [*(_CLOSE if close else _JSON), (b"content-length", b"%d" % len(body)), *err.headers]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# A request still running after this long gets a task watching for the client leaving.
# Watching costs a task and a wake-up per request (a third of the router's CPU in
# bench/proxy.py); fast requests finish before, slow ones (every real generation) are
# watched, and a client that left meanwhile is noticed at once when watching starts.
WATCH_AFTER = 0.05


class Exchange:
    """One request's way back to its client and its progress, shared with its disconnect
    watcher: the task to cancel, the ASGI ``send``, what has been sent."""

    __slots__ = (
        "done", "gone", "output_tokens", "send", "started", "t0", "task", "timer", "watcher",
    )  # fmt: skip

    def __init__(self, task: asyncio.Task[Any], send: Send) -> None:
        self.t0 = time.perf_counter()
        self.task = task
        self.send = send
        self.started = False  # response headers sent: errors can no longer be a status
        self.done = False  # final body sent: a disconnect now is the normal end
        self.gone = False
        self.timer: asyncio.TimerHandle | None = None
        self.watcher: asyncio.Task[None] | None = None
        self.output_tokens: int | None = None  # the answer's usage, when it gave one

    def watch(self, receive: Receive) -> None:
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(WATCH_AFTER, self._start, receive)

    def _start(self, receive: Receive) -> None:
        if not self.done:
            self.watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        """Cancel the request when the client disconnects (uvicorn's receive says so)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.done:
                    self.gone = True
                    self.task.cancel()
                return

    def stop(self) -> None:
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        if self.watcher is not None:
            self.watcher.cancel()


class Relay(Protocol):
    """What another sender uses of the proxy that took the request (``Proxy`` has it)."""

    @property
    def deps(self) -> ProxyDeps: ...
    @property
    def path(self) -> str: ...
    @property
    def drop(self) -> frozenset[bytes]: ...

    async def hint(self, decision: Decision | None, prep: Prepared) -> int:
        """Publish the decision's prefetch hint; the blocks it pulls into its worker."""
        ...

    def failed(
        self,
        worker: Worker,
        failure: Failure,
        error: UpstreamError | None,
        arm: str,
        exclude: set[str],
    ) -> None:
        """Count a failed send; raise the client's error unless another worker may try."""
        ...

    async def stream(
        self,
        ex: Exchange,
        resp: Response,
        worker_id: str,
        flight: Flight,
        series: Series | None,
        arm: str,
        hit: int,
        remember: Callable[[bytes], None] | None = None,
        prefilled_remotely: bool = False,
        first_token: Callable[[float], None] | None = None,
    ) -> None:
        """Send the engine's answer on to the client, counting what it says."""
        ...


class Disaggregation(Protocol):
    """What the proxy asks of prefill/decode routing (``router.pd.exchange.PdRouter``)."""

    def disaggregated(self, prep: Prepared) -> bool: ...

    async def forward(
        self, relay: Relay, scope: Scope, raw: bytes, prep: Prepared, ex: Exchange
    ) -> None: ...
