"""One request picked for a gateway: the proxy's decision, and its accounting without it.

The decision is the proxy's own: ``Router.parse`` -> ``Router.prepare`` (tokens, block
hashes) -> ``Router.decide`` (index match, policy), the same objects the HTTP proxy
calls, so the two cannot disagree. What differs is who carries the bytes: the gateway
does, so the load a request puts on its engine (a ``Flight``), its time to first token,
the engine's reported ``cached_tokens`` and the end of the request are read from the
response phase of the ``ext_proc`` stream (``Routed.response_headers`` /
``response_body``), and ``Routed.finish`` runs when the stream ends, however it ends
(a gateway configured to send no response phase still frees the flight then).

Requests the proxy would not tokenize go as its passthrough sends them: endpoints it
routes on load (``router.forward.passthrough.PATHS``, and any other path with a body) to the
least-loaded engine of the body's model, a request without a body (``GET /v1/models``)
to the least-loaded engine of all.

Admission (router.admission) holds the requests the proxy would hold, in the same
queue: ``Gate.enter`` with the workers outside the gateway's subset excluded (a held
request is bound late, and only ever to an endpoint the gateway allowed; a prefix held
outside the subset is no reason to wait) and, where the gateway times each message
(buffered mode), a hold bounded by that timeout. A shed request is an immediate
response with the proxy's status, body and ``retry-after``. The slot is freed when the
response phase ends or the stream does, however it ends; a stream cancelled while its
request is held leaves the queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from router.admission.gate import waiter
from router.forward.passthrough import Passthrough, least_loaded
from router.forward.proxy import CACHED_TOKENS, COMPLETION_TOKENS, HEAD_BYTES, HIT_HEADER, Proxy
from router.forward.relay import ProxyDeps
from router.http.errors import ApiError
from router.routing.decide import Kind, Prepared, hit_blocks
from router.workers.dp import DP_HEADER, forward_rank
from router.workers.load import WAITING, Flight

if TYPE_CHECKING:
    from policies.base import Policy, RouteRequest
    from router.admission.core import Ticket
    from router.admission.gate import Gate
    from router.observe.metrics import Series
    from router.workers.registry import Worker

KINDS: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
WORKER_HEADER = "x-cache-router-worker"


def endpoint(url: str) -> str:
    """A worker's ``ip:port`` as the protocol names endpoints (``[v6]:port``)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def allowed(worker: Worker, subset: list[str]) -> bool:
    """Whether the gateway's subset names the worker (``ip:port``, or a bare ``ip``: any
    port of it, as the reference picker reads one)."""
    ep = endpoint(worker.url)
    host = ep.rpartition(":")[0].strip("[]")
    return any(s == ep or s.strip("[]") == host for s in subset)


@dataclass(slots=True)
class Routed:
    """A request routed to ``target``: what the gateway is told, and the accounting that
    follows it until ``finish``."""

    endpoint: str
    target: str  # the worker, or one of its DP ranks (router/dp.py)
    set_headers: list[tuple[str, str]]
    remove_headers: list[str]
    body: bytes | None  # the engine's body when it differs from the client's
    flight: Flight
    worker: Worker
    registry_ok: Callable[[int], None]
    series: Series | None = None
    policy: Policy | None = None
    request: RouteRequest | None = None
    hit_tokens: int = 0
    audit: Callable[[int | None], None] | None = None
    remember: Callable[[bytes], None] | None = None
    t0: float = field(default_factory=time.perf_counter)
    status: int = 0
    sse: bool = False
    cached: int | None = None
    tail: bytes = b""
    head: bytes = b""
    done: bool = False
    gate: Gate | None = None  # admission's, with the request's ``ticket``
    ticket: Ticket | None = None
    output_tokens: int | None = None  # the answer's usage, when it gave one

    def response_headers(self, headers: dict[str, str]) -> list[tuple[str, str]]:
        """The engine answered: its status counts for the worker's health as in the proxy;
        the headers the client gets beside the engine's (which worker, the predicted hit)."""
        status = headers.get(":status", "0")
        self.status = int(status) if status.isdigit() else 0
        self.sse = headers.get("content-type", "").startswith("text/event-stream")
        self.registry_ok(self.status)
        out = [(WORKER_HEADER, self.target)]
        if self.series is not None:
            out.append((HIT_HEADER.decode(), str(self.hit_tokens)))
        return out

    def response_body(self, chunk: bytes, end: bool) -> None:
        """A piece of the answer: the first is the time to first token (a stream's), every
        one is scanned for ``cached_tokens``, the last ends the request."""
        if self.flight.state is WAITING and (chunk or end):
            elapsed = time.perf_counter() - self.t0
            if self.series is not None:
                self.series.ttft.observe(elapsed)
            if self.sse and self.status < 400 and self.policy is not None:
                assert self.request is not None
                self.policy.on_first_token(self.request, self.target, elapsed * 1000.0)
            self.flight.first_byte()
        if self.remember is not None and len(self.head) < HEAD_BYTES:
            self.head += chunk
        window = self.tail + chunk  # '"cached_tokens": 12' may be cut between chunks
        if b"_tokens" in window:  # usage
            numbers = CACHED_TOKENS.findall(window)
            if numbers:
                self.cached = int(numbers[-1])
            if self.ticket is not None:  # settles admission's fair share
                numbers = COMPLETION_TOKENS.findall(window)
                if numbers:
                    self.output_tokens = int(numbers[-1])
        self.tail = chunk[-32:]
        if end:
            self.finish(complete=True)

    def finish(self, complete: bool = False) -> None:
        """The request is over (``complete``: its answer ended normally); once."""
        if self.done:
            return
        self.done = True
        self.flight.finish()
        if self.gate is not None and self.ticket is not None:  # its slot is free
            self.gate.finish(self.ticket, self.output_tokens)
        if complete and self.status < 400:
            if self.cached is not None and self.series is not None:
                self.series.hit_tokens.inc(self.cached)
            if self.audit is not None:
                self.audit(self.cached)
            if self.remember is not None:
                self.remember(self.head)
        if self.policy is not None:
            assert self.request is not None
            self.policy.on_finish(self.request, self.target)


class Picker:
    """Decides for the gateway with the proxy's objects (``ProxyDeps``)."""

    def __init__(self, deps: ProxyDeps) -> None:
        self.deps = deps
        # the proxy's own handlers, for the parts of a request they share (prefetch hints)
        self.proxies = {kind: Proxy(deps, kind, path) for path, kind in KINDS.items()}
        self.passthrough = Passthrough(deps, "/v1/embeddings")  # its model -> workers
        self.drop_auth = not deps.cfg.forward_authorization

    def refused(self, path: str, headers: dict[str, str]) -> ApiError | None:
        """The edge's checks (header limits, API keys) on the client's headers."""
        pairs = [(k.encode(), v.encode("latin-1")) for k, v in headers.items() if k[0] != ":"]
        return self.deps.edge.check({"headers": pairs, "path": path})

    async def pick(
        self,
        path: str,
        raw: bytes | None,
        headers: dict[str, str],
        subset: list[str] | None,
        hold: float | None = None,
    ) -> Routed:
        """The engine for one request (``raw``: its body; None: it has none); ``ApiError``
        for the gateway to answer instead (400 malformed, 404 unknown model, 503 none
        usable, 429/503 shed by admission with ``headers``). ``hold``: seconds admission
        may hold it at most (the gateway's message timeout; None: ``queue_timeout``)."""
        exclude = self._excluded(subset)
        kind = KINDS.get(path)
        if kind is None or raw is None:
            return self._by_load(path, raw, exclude)
        st = self.deps
        wanted: dict[str, str] = {
            k: headers[k] for k in ("x-session-id", "x-request-id") if k in headers
        }
        parsed = st.router.parse(kind, raw, wanted)
        st.edge.check_sampling(parsed.body)
        prep = await st.router.prepare(parsed, len(raw))
        if st.pd is not None and st.pd.disaggregated(prep):
            raise ApiError(
                501,
                "prefill/decode pools are routed by the proxy, not by the endpoint picker",
                "invalid_request",
            )
        gate = st.gate
        if gate is None or prep.pinned is not None:  # a stored response has one engine
            return await self._decided(kind, prep, raw, headers, exclude, parsed.body)
        # admission: held while the engines it may use are full, or shed
        pairs = [(k.encode(), v.encode("latin-1")) for k, v in headers.items() if k[0] != ":"]
        ticket = await gate.enter(prep, pairs, exclude=frozenset(exclude), timeout=hold, via="epp")
        try:
            routed = await self._decided(kind, prep, raw, headers, exclude, parsed.body, ticket)
        except BaseException:
            gate.release(ticket)  # never routed: its slot is free
            raise
        routed.gate, routed.ticket = gate, ticket
        return routed

    async def _decided(
        self,
        kind: Kind,
        prep: Prepared,
        raw: bytes,
        headers: dict[str, str],
        exclude: set[str],
        body: dict[str, Any],
        ticket: Ticket | None = None,
    ) -> Routed:
        """Routed where admission bound it (``ticket``), else where the policy decides."""
        st = self.deps
        bound = None if ticket is None else waiter(ticket)
        if bound is not None and bound.decision is not None:
            decision, views = bound.decision, bound.views
        else:
            decision, views = st.router.decide(prep, exclude)
        tid = decision.worker_id
        found = st.registry.target(tid)
        if found is None:
            raise ApiError(503, f"worker {tid} left the pool", "no_healthy_worker")
        worker, rank = found
        req = prep.request
        hit = hit_blocks(views, decision) * req.block_size
        prefetched = await self.proxies[kind].hint(decision, prep)
        flight = worker.rank_load(rank).begin(max(0, req.num_tokens - hit))
        if ticket is not None and st.gate is not None:
            st.gate.started(ticket)  # its worker counts it now
        st.router.predict(prep, tid)
        series = st.metrics.series(prep.arm, tid)
        series.requests.inc()
        series.prompt_tokens.inc(req.num_tokens)
        series.routed_hit_tokens.inc(hit)
        st.audit.routed(tid, req.block_hashes[0] if req.block_hashes else None)
        if st.capacity is not None and req.block_hashes:
            st.capacity.record(
                req.model, req.block_size, tid, req.block_hashes, req.num_tokens, prefetched
            )
        remember = None
        if kind == "responses" and body.get("store") is not False:
            remember = st.affinity.remembers(worker.id)
        routed = self._routed(worker, tid, flight, headers, raw, prep, rank)
        routed.series = series
        routed.policy = st.experiment.policy_for(prep.arm)
        routed.request = req
        routed.hit_tokens = hit
        routed.remember = remember
        if not st.cfg.gateway:

            def audit(cached: int | None) -> None:
                st.audit.record(tid, hit, cached)

            routed.audit = audit
        return routed

    def _excluded(self, subset: list[str] | None) -> set[str]:
        """The workers outside the gateway's subset (none without one)."""
        if subset is None:
            return set()
        if not subset:
            raise ApiError(503, "the gateway allowed no endpoint", "no_healthy_worker")
        return {w.id for w in self.deps.registry if not allowed(w, subset)}

    def _by_load(self, path: str, raw: bytes | None, exclude: set[str]) -> Routed:
        st = self.deps
        if raw is None:
            workers = list(st.registry)
        else:
            workers = self.passthrough.candidates({"path": path}, raw)
        worker = least_loaded(workers, exclude, st.cfg.load_stale_after)
        flight = worker.load.begin(0)
        if raw is not None:
            st.metrics.passthrough.labels(path, worker.id).inc()
        return self._routed(worker, worker.id, flight, {}, None, None, None)

    def _routed(
        self,
        worker: Worker,
        tid: str,
        flight: Flight,
        headers: dict[str, str],
        raw: bytes | None,
        prep: Prepared | None,
        rank: int | None,
    ) -> Routed:
        st = self.deps
        sent: list[tuple[str, str]] = []
        body: bytes | None = None
        if prep is not None and raw is not None:
            out_raw, out_body = prep.engine_body(raw)
            pairs, engine_raw = forward_rank([], out_raw, out_body, rank, worker.dp_field)
            sent = [(k.decode(), v.decode()) for k, v in pairs]
            if engine_raw is not raw:
                body = engine_raw
            if "x-request-id" not in headers:
                sent.append(("x-request-id", prep.request.request_id))
        remove = ["authorization"] if self.drop_auth and "authorization" in headers else []
        if rank is None and DP_HEADER.decode() in headers:
            remove.append(DP_HEADER.decode())

        arm = "-" if prep is None else prep.arm

        def outcome(status: int) -> None:
            if status >= 400:
                st.metrics.error(arm, tid, f"engine_{status}")
            if status >= 500:
                st.registry.request_failed(worker, f"status {status}")
            else:
                st.registry.request_succeeded(worker)

        return Routed(endpoint(worker.url), tid, sent, remove, body, flight, worker, outcome)
