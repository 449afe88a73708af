"""Admission on the router's event loop: a request's tenant and priority, its ticket, its
wait, and its answer when it is shed (the core is ``router.admission.core``).

Binding a ticket is routing it: ``bind`` runs the request's routing policy among the
workers admission allows (``Router.decide`` with the others excluded), keeps the
decision for the proxy and counts the request on its worker at once (``_reserved``,
until its flight begins), so that one pump binding several tickets does not overfill
one worker. A held request waits on a future that ``bind`` resolves, with its deadline
as the timeout; a client that goes away cancels the wait and leaves the queue.

Engine load reaches admission without a hook in the event or health code: a task
(``run``) reads each worker's last report ten times a second and hands new ones on, with
the prompt tokens the engine had to prefill since its previous report (what tells a
spent token budget from full slots, ``capacity.cause``); it also pumps the queue, so a
ticket waiting for its prefix holder is let go elsewhere when its hold ends even if
nothing else happens.

Three paths enter besides the proxy's: the Endpoint Picker (router.epp: ``exclude``
holds the workers outside the gateway's subset, which the ticket may never be bound
to; ``timeout`` bounds the hold by the gateway's per-message timeout), prefill/decode
pools (router.pd: ``pd`` binds with the two-sided choice, and the ticket's candidates
are the prefill engines, the scarce side; see docs/overload.md) and gateway mode (the
proxy's own path, clusters for engines). Each request is counted by the path it came
by (``via``) beside the per-tenant numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from policies.cost_model import EngineCosts
from router.admission.core import Admission, AdmissionSettings, Shed, State, Ticket
from router.admission.stats import WAIT_BUCKETS
from router.http.errors import ApiError

if TYPE_CHECKING:
    from policies.base import Decision, WorkerView
    from policies.pd import PdDecision
    from router.config import RouterConfig
    from router.observe.tracing import Trace
    from router.routing.decide import Prepared, Router
    from router.workers.registry import Worker, WorkerRegistry

POLL = 0.1  # seconds between two readings of the engines' reports
MAX_TENANT_CHARS = 128
PRIORITY_BOUND = 1 << 31  # |priority| below this (vLLM takes any int; a label takes less)


def make_gate(cfg: RouterConfig, router: Router, registry: WorkerRegistry) -> Gate:
    """The gate a router's config describes."""
    settings = AdmissionSettings(
        queue_size=cfg.queue_size,
        queue_timeout=cfg.queue_timeout,
        engine_queue=cfg.engine_queue,
        engine_batch_tokens=cfg.engine_batch_tokens,
        max_inflight=cfg.engine_max_inflight,
        starve_after=cfg.priority_starve_after,
        starve_share=cfg.priority_starve_share,
        reserve=cfg.reserve_share,
        engine_priority=cfg.engine_priority_scheduling,
        lifo=cfg.queue_lifo,
        pool_reserve=cfg.pool_reserve,
        tenants=cfg.tenants,
    )
    keys = {key: name for name, spec in cfg.tenants.items() for key in spec.api_keys}
    gate = Gate(
        settings, router, registry, tenant_header=cfg.tenant_header, key_tenants=keys,
        expected_output=cfg.expected_output_tokens,
    )  # fmt: skip
    if cfg.gateway:  # clusters for engines: a session's cache is on its home cluster
        gate.home = getattr(router, "home", None)
        gate.default_via = "gateway"
    return gate


class ShedError(ApiError):
    """A request admission turned away: 429 or 503 with ``Retry-After``."""

    def __init__(self, shed: Shed) -> None:
        super().__init__(shed.status, shed.message, shed.code)
        self.headers = ((b"retry-after", b"%d" % shed.retry_after),)


class PdChosen(Protocol):
    """Both sides' choice for a request of a disaggregated pool
    (``router.pd.exchange.PdChoice``)."""

    @property
    def decision(self) -> PdDecision: ...


class TwoSided(Protocol):
    """What binding a request of a disaggregated pool asks of its router
    (``router.pd.exchange.PdRouter``): a protocol, so that admission imports nothing of
    router.pd, which holds its requests through the gate."""

    def remote_prefill(self, prep: Prepared) -> bool: ...
    def prefills_locally(self, prep: Prepared) -> bool: ...
    def decide(self, prep: Prepared, exclude: frozenset[str]) -> PdChosen: ...
    def finish(self, prep: Prepared, d: PdDecision) -> None: ...


class Waiter:
    """A ticket's request, and what binding it decided."""

    __slots__ = (
        "choice", "decision", "error", "exclude", "future", "pd", "prep", "started", "trace",
        "via", "views",
    )  # fmt: skip

    def __init__(
        self,
        prep: Prepared,
        trace: Trace | None = None,
        exclude: frozenset[str] = frozenset(),
        pd: TwoSided | None = None,
        via: str = "proxy",
    ) -> None:
        self.prep = prep
        self.trace = trace  # binding's match and decide spans go to the request's trace
        self.exclude = exclude  # workers or targets it may never go to (a gateway's subset)
        self.pd = pd  # a disaggregated pool's router: binding chooses both sides
        self.via = via
        self.future: asyncio.Future[None] | None = None
        self.decision: Decision | None = None
        self.choice: PdChosen | None = None  # with ``pd``: both sides' choice
        self.views: list[WorkerView] = []
        self.error: ApiError | None = None
        self.started = False


def waiter(ticket: Ticket) -> Waiter:
    w = ticket.payload
    assert isinstance(w, Waiter)
    return w


class Gate:
    def __init__(
        self,
        settings: AdmissionSettings,
        router: Router,
        registry: WorkerRegistry,
        *,
        tenant_header: str = "x-tenant-id",
        key_tenants: Mapping[str, str] | None = None,
        expected_output: int = 256,
        costs: EngineCosts | None = None,
    ) -> None:
        self.router = router
        self.registry = registry
        self.tenant_header = tenant_header.lower().encode()
        self.key_tenants = dict(key_tenants or {})
        # tenants named by a key: no header may claim them
        self._keyed = frozenset(self.key_tenants.values())
        self.expected_output = expected_output
        self.costs = costs or EngineCosts()
        self._reserved: Counter[str] = Counter()  # bound, flight not begun, per target
        # the last plain request's (model's workers list, candidates, their set)
        self._every: tuple[list[Worker], tuple[str, ...], frozenset[str]] | None = None
        self._seen: dict[str, float] = {}  # worker -> the report last handed on
        self._prefilled: dict[str, int] = {}  # worker -> its ``prefilled`` then
        self.via: Counter[tuple[str, str]] = Counter()  # (path, outcome) -> requests
        self.default_via = "proxy"  # the proxy's path ("gateway" in gateway mode)
        # gateway mode: a request's home cluster (router.routing.gateway), held for as a
        # prefix holder is: the gateway sees no prompt hashes, a cluster holds the session
        self.home: Callable[[Prepared], str | None] | None = None
        self.core = Admission(settings, self._inflight, self._bind, self._evicted, time.monotonic)
        # every move of a target's in-flight count told to the core (the loads' through
        # the registry, the slots reserved here in ``_release``): its pumps read which
        # workers have room from counts kept as they move, not from every candidate's
        self.core.track_moves()
        registry.watch_moves(self.core.moved)

    # -- who and how urgent ------------------------------------------------------------
    def identify(
        self, headers: Iterable[tuple[bytes, bytes]], body: Mapping[str, Any]
    ) -> tuple[str, int]:
        """A request's tenant (its API key's, else the tenant header's, else none) and
        priority (the body's ``priority``, else its tenant's default); 400 for a
        priority that is not an integer."""
        keyed = named = None
        for key, value in headers:
            if key == b"authorization" and self.key_tenants:
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    keyed = self.key_tenants.get(token.strip())
            elif key == self.tenant_header:
                named = value.decode("latin-1").strip()[:MAX_TENANT_CHARS]
        if keyed is not None:
            tenant = keyed
        elif named and named not in self._keyed:
            tenant = named
        else:
            tenant = ""
        priority = body.get("priority")
        if priority is None:
            return tenant, self.core.default_priority(tenant)
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not (-PRIORITY_BOUND < priority < PRIORITY_BOUND)
        ):
            raise ApiError(
                400, "priority must be an integer (lower is served first)", "invalid_value",
                "priority",
            )  # fmt: skip
        return tenant, priority

    def ticket(
        self,
        prep: Prepared,
        tenant: str,
        priority: int,
        trace: Trace | None = None,
        *,
        exclude: frozenset[str] = frozenset(),
        timeout: float | None = None,
        pd: TwoSided | None = None,
        via: str = "proxy",
    ) -> Ticket:
        """The request's ticket: its candidates are the targets it may be bound to (not in
        ``exclude``, by worker or target; in a disaggregated pool, the prefill engines)."""
        body = prep.parsed.body
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        output = asked if isinstance(asked, int) and asked > 0 else self.expected_output
        candidates, every = self._candidates(prep, exclude, pd)
        saved: dict[str, float] = {}
        capacity = self.core.capacity
        if pd is not None and candidates and self._full(candidates) and pd.prefills_locally(prep):
            candidates, every = (), frozenset()  # its decode engine prefills it: no slot
        if self.core.queued or (
            capacity.limited and any(capacity.limit(t) is not None for t in candidates)
        ):
            saved = self._saved(prep)  # only a full pool binds late: nothing to pay before
            if exclude or pd is not None:
                # a holder it may not go to (outside the gateway's subset; a decode
                # engine) is none of its business: it would wait for it in vain
                saved = {t: s for t, s in saved.items() if t in every}
            if self.home is not None:
                home = self.home(prep)
                if home is not None and home in candidates:
                    # what another cluster would recompute: the whole prompt
                    saved = {home: self.costs.prefill_ms(prep.request.num_tokens) / 1000.0}
        held = Waiter(prep, trace, exclude, pd, via)
        return Ticket(
            tenant, priority, prep.request.num_tokens, output, candidates, saved, held,
            timeout=timeout, every=every,
        )  # fmt: skip

    def _candidates(
        self, prep: Prepared, exclude: frozenset[str], pd: TwoSided | None
    ) -> tuple[tuple[str, ...], frozenset[str]]:
        """``_candidates`` and their set; for the plain case (nothing excluded, no PD) kept
        while the registry hands out the same list of the model's workers (``for_model``
        keeps it until a worker changes): at 1,024 targets building both for every request
        cost ~150 us (session 18), more than the pruned decision's growth."""
        if exclude or pd is not None:
            found = _candidates(prep, exclude, pd)
            return found, frozenset(found)
        kept = self._every
        if kept is not None and kept[0] is prep.workers:
            return kept[1], kept[2]
        found = _candidates(prep, exclude, pd)
        self._every = (prep.workers, found, frozenset(found))
        return found, self._every[2]

    def _full(self, targets: tuple[str, ...]) -> bool:
        """Whether a request for ``targets`` would wait now: others wait, or none has room."""
        if self.core.queued:
            return True
        room, inflight = self.core.capacity.room, self._inflight
        return all(room(t, inflight(t)) <= 0 for t in targets)

    def _saved(self, prep: Prepared) -> dict[str, float]:
        """Seconds of prefill each worker's cache saves the request; in a wide pool, each
        hit class's least loaded (``Router.views(pruned=True)``, router/routing/prune.py):
        the best saving and, when kept, the holder are those of every candidate."""
        req = prep.request
        n = req.num_tokens
        full = self.costs.prefill_ms(n)
        saved = {}
        for view in self.router.views(prep, pruned=True):
            hit = min(view.match.total * req.block_size, n - 1)
            if hit > 0:
                saved[view.worker_id] = (full - self.costs.prefill_ms(n - hit, hit)) / 1000.0
        return saved

    # -- a request's way through ---------------------------------------------------------
    async def enter(
        self,
        prep: Prepared,
        headers: Iterable[tuple[bytes, bytes]],
        trace: Trace | None = None,
        *,
        exclude: frozenset[str] = frozenset(),
        timeout: float | None = None,
        pd: TwoSided | None = None,
        via: str | None = None,
    ) -> Ticket:
        """Admit a request: its ticket once bound (``waiter(t).decision`` is where it
        goes, ``waiter(t).choice`` with ``pd``); ``ShedError`` if it is shed, the routing
        error if it could not be placed. ``exclude``: workers or targets it may never go
        to; ``timeout``: seconds it may be held at most, when less than ``queue_timeout``
        (``via`` names the path, for the counts; None: the proxy's, or the gateway's)."""
        via = via or self.default_via
        tenant, priority = self.identify(headers, prep.parsed.body)
        ticket = self.ticket(
            prep, tenant, priority, trace, exclude=exclude, timeout=timeout, pd=pd, via=via
        )
        try:
            await self._wait(ticket)
        finally:
            self.via[via, _outcome(ticket)] += 1
        if ticket.state is State.SHED:
            assert ticket.shed is not None
            raise ShedError(ticket.shed)
        w = waiter(ticket)
        if w.error is not None:
            raise w.error
        return ticket

    async def _wait(self, ticket: Ticket) -> None:
        """Arrive, and wait while held (until bound, shed, or its deadline)."""
        state = self.core.arrive(ticket)
        if state is State.QUEUED:
            w = waiter(ticket)
            w.future = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(max(0.0, ticket.deadline - time.monotonic())):
                    await w.future
            except TimeoutError:
                self.core.expire(ticket)
            except asyncio.CancelledError:
                if ticket.state is State.BOUND:  # bound, then cancelled before it woke
                    self.release(ticket)
                self.core.leave(ticket)
                raise

    def started(self, ticket: Ticket) -> None:
        """The request's flight began: its worker counts it now."""
        w = waiter(ticket)
        if not w.started and ticket.worker is not None:
            w.started = True
            self._release(ticket.worker)

    def finish(self, ticket: Ticket, output_tokens: int | None = None) -> None:
        """The request ended (answered, failed or cancelled): its slot is free."""
        self.started(ticket)
        self.core.finish(ticket, output_tokens)

    def release(self, ticket: Ticket) -> None:
        """A bound request that will never be sent: its slot is free, and the policy
        forgets the choice it counted (``on_finish``, as a request that ended)."""
        w = waiter(ticket)
        if ticket.state is State.BOUND and not w.started:
            prep = w.prep
            if w.choice is not None and w.pd is not None:
                w.pd.finish(prep, w.choice.decision)
            elif w.decision is not None:
                policy = self.router.experiment.policy_for(prep.arm)
                policy.on_finish(prep.request, w.decision.worker_id)
        self.finish(ticket)

    def _release(self, target: str) -> None:
        self._reserved[target] -= 1
        if self._reserved[target] <= 0:
            del self._reserved[target]
        self.core.moved(target)

    # -- the core's callbacks --------------------------------------------------------------
    def _inflight(self, target: str) -> int:
        found = self.registry.target(target)
        if found is None:
            return self._reserved[target]
        worker, rank = found
        return worker.rank_load(rank).inflight_requests + self._reserved[target]

    def _bind(self, ticket: Ticket, allowed: frozenset[str]) -> str | None:
        w = waiter(ticket)
        # ``allowed`` is a subset of the candidates: all of them (the common case, a pool
        # never full) excludes none, without a pass over a wide pool's targets
        if len(allowed) == len(ticket.candidates):
            exclude: frozenset[str] = frozenset()
        else:
            exclude = frozenset(t for t in ticket.candidates if t not in allowed)
        if w.exclude:
            exclude |= w.exclude
        try:
            if w.pd is not None:  # both sides; the prefill engine's slot is the one held
                w.choice = w.pd.decide(w.prep, exclude)
                d = w.choice.decision
                target = (d.decode if d.prefill is None else d.prefill).worker_id
            else:
                w.decision, w.views = self.router.decide(w.prep, exclude, w.trace)
                target = w.decision.worker_id
        except ApiError as err:
            w.error = err
            self._wake(w)
            return None
        self._reserved[target] += 1
        self._wake(w)
        return target

    def _evicted(self, ticket: Ticket) -> None:
        self._wake(waiter(ticket))

    @staticmethod
    def _wake(w: Waiter) -> None:
        if w.future is not None and not w.future.done():
            w.future.set_result(None)

    # -- engine reports ----------------------------------------------------------------------
    def poll(self) -> None:
        """Hand each worker's new engine report to admission; let go what can go."""
        for worker in self.registry:
            load = worker.load
            if self._seen.get(worker.id) == load.engine_seen:
                continue
            self._seen[worker.id] = load.engine_seen
            engine = load.engine
            ranks = len(worker.targets)
            # prompt tokens whose first byte came since the last report (the engine
            # prefilled them meanwhile)
            prefilled = load.prefilled - self._prefilled.get(worker.id, load.prefilled)
            self._prefilled[worker.id] = load.prefilled
            # why its requests wait (``capacity.cause``): the engine's KV cache, deferred
            # requests and preemptions, and the prompts it had to prefill since its last
            # report (sent there without a first token yet, or whose first token came)
            why = {
                "deferred": _share(engine.deferred, ranks),
                "kv_usage": engine.kv_usage,
                "kv_tokens": engine.kv_tokens,
                "preemptions": engine.preemptions,
                "prefill": _share(load.inflight_prefill_tokens + prefilled, ranks),
                "need": load.prefills.smallest(),
            }
            for target in worker.targets:
                self.core.report(
                    target, _share(engine.running, ranks), _share(engine.waiting, ranks), **why
                )
        if self.core.queued:
            self.core.pump()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(POLL)
            with contextlib.suppress(Exception):  # a bug here must not stop admission
                self.poll()

    # -- telling -----------------------------------------------------------------------------
    def explain(
        self,
        prep: Prepared,
        headers: Iterable[tuple[bytes, bytes]],
        pd: TwoSided | None = None,
    ) -> dict[str, Any]:
        """Where a request would queue and why, without admitting it (``/admin/explain``;
        with ``pd``: a disaggregated pool's, whose prefill engines are the ones held for)."""
        tenant, priority = self.identify(headers, prep.parsed.body)
        ticket = self.ticket(prep, tenant, priority, pd=pd)
        core = self.core
        now = time.monotonic()
        reserves = core.capacity.reserve > 0 or core.settings.pool_reserve
        entitled = not reserves or core.entitled(ticket, now)
        shared = core.capacity.reserve <= 0 or entitled  # room past reserve_share's slots
        workers = {}
        for t in ticket.candidates:
            limit = core.capacity.limit(t)
            inflight = self._inflight(t)
            workers[t] = {
                "limit": limit,
                "inflight": inflight,
                "room": None if limit is None else core.capacity.room(t, inflight, shared),
                "saved_prefill_s": ticket.saved.get(t, 0.0),
            }
        allowed = None if core.queued else core.allowed(ticket, now)
        if allowed is not None:
            would = f"bound at once, to one of {sorted(allowed)}"
        elif core.queued >= core.settings.queue_size:
            would = "shed (429 queue_full) unless it ranks above the worst queued request"
        else:
            would = "held at the router until a worker it may use has room"
        return {
            "tenant": tenant or None,
            "priority": priority,
            "entitled_to_reserve": entitled,
            "would": would,
            "queued": core.snapshot(),
            "workers": workers,
        }


def _candidates(prep: Prepared, exclude: frozenset[str], pd: TwoSided | None) -> tuple[str, ...]:
    """The targets a ticket may be bound to: not excluded (by worker or target); in a
    disaggregated pool the prefill engines (none when the request cannot take one: the
    PD router then prefills on the decode engine, and nothing is held)."""
    if pd is not None and not pd.remote_prefill(prep):
        return ()
    return tuple(
        t
        for w in prep.workers
        if w.id not in exclude and (pd is None or w.role == "prefill")
        for t in w.targets
        if t not in exclude
    )


def _outcome(ticket: Ticket) -> str:
    state = ticket.state
    if state is State.SHED:
        return "shed"
    if state is State.LEFT or state is State.QUEUED:
        return "left"
    return "admitted" if ticket.worker is not None else "unplaced"


def _share(count: int | None, ranks: int) -> int | None:
    return count if count is None or ranks <= 1 else -(-count // ranks)


class AdmissionCollector:
    """Admission's numbers for ``/metrics``, read at scrape time."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        core = self.gate.core
        labels = ["tenant", "priority"]
        queued_now = GaugeMetricFamily(
            "cache_router_admission_held", "Requests held at the router now", labels=labels
        )
        now: Counter[tuple[str, str]] = Counter()
        for tenant, priority, n in core.held():
            now[core.stats.key(tenant, priority)] += n
        for key, n in now.items():
            queued_now.add_metric(list(key), n)
        yield queued_now
        families = {
            "queued": CounterMetricFamily(
                "cache_router_admission_queued", "Requests that waited at the router", labels=labels
            ),
            "admitted": CounterMetricFamily(
                "cache_router_admission_admitted", "Requests admitted to a worker", labels=labels
            ),
            "tokens": CounterMetricFamily(
                "cache_router_admission_tokens",
                "Prompt and generated tokens of admitted requests (estimates settled)",
                labels=labels,
            ),
            "left": CounterMetricFamily(
                "cache_router_admission_left",
                "Requests whose client left while held",
                labels=labels,
            ),
        }
        shed = CounterMetricFamily(
            "cache_router_admission_shed", "Requests shed, by code", labels=[*labels, "code"]
        )
        wait = HistogramMetricFamily(
            "cache_router_admission_wait_seconds", "Time held at the router before admission",
            labels=labels,
        )  # fmt: skip
        for key, s in core.stats.series.items():
            for name, family in families.items():
                family.add_metric(list(key), getattr(s, name))
            for code, n in s.shed.items():
                shed.add_metric([*key, code], n)
            cumulative, buckets = 0, []
            for bound, n in zip([*map(str, WAIT_BUCKETS), "+Inf"], s.wait_buckets, strict=True):
                cumulative += n
                buckets.append((bound, cumulative))
            wait.add_metric(list(key), buckets, s.wait_sum)
        yield from families.values()
        yield shed
        yield wait
        via = CounterMetricFamily(
            "cache_router_admission_requests",
            "Requests that went through admission, by the path they came by (proxy, epp: "
            "the endpoint picker, pd: a disaggregated pool, gateway: gateway mode) and what "
            "became of them "
            "(admitted, shed, left while held, unplaced: no worker could take them)",
            labels=["via", "outcome"],
        )
        for (path, outcome), n in sorted(self.gate.via.items()):
            via.add_metric([path, outcome], n)
        yield via
        limits = GaugeMetricFamily(
            "cache_router_admission_limit",
            "Requests a worker runs before it queues, as admission learnt it",
            labels=["worker"],
        )
        for worker in self.gate.registry:
            for t in worker.targets:
                limit = core.capacity.limit(t)
                if limit is not None:
                    limits.add_metric([t], limit)
        yield limits
