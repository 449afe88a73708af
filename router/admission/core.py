"""Admission: which held request goes next, where, and which is refused at once.

Plain and synchronous, on an injected clock (seconds): the router drives it from its
event loop, the simulator from its virtual clock, the tests from a fake one.

A request becomes a ``Ticket`` (tenant, priority, tokens, the workers it may go to and
how much prefill each one's cache saves it). ``Admission.arrive`` either binds it at
once, through the ``bind`` callback (the caller runs its routing policy among the
workers it is allowed and starts the request there), or holds it, or sheds it. Held
tickets are bound by ``pump``, run whenever capacity may have freed (a request ended,
an engine reported), in this order:

1. strict priority: the lowest ``priority`` first (vLLM's convention), except that once
   a ticket has waited ``starve_after`` seconds, one dispatch in ``starve_share`` goes to
   the oldest such ticket even while more urgent ones wait (the anti-starvation bound:
   a lower priority keeps a known share of the pool, an urgent one loses at most that);
2. within a priority, the tenant with the lowest virtual token counter (``fair``);
3. within a tenant, arrival order, or newest first once its queue stands (``_lifo``).

With engines that order their own queue by priority (``engine_priority``), an urgent
ticket may also go past a full engine, to wait at the head of that engine's queue
(``_jump_to``).

Late binding: a ticket is bound only when a worker it may use has room (``capacity``),
so it goes where the capacity is at that moment, not where it was when it came. It
keeps its affinity: if its prefix holder is full but another worker is open, it waits
for the holder when a slot there is expected to free sooner than the prefill its cache
saves, and at most that long in all (waiting never costs more than recomputing would).

Shedding is immediate: a full queue (429 ``queue_full``; the newcomer takes the place
of the worst queued ticket when it ranks above it, that one is shed instead), a tenant
over its token rate (429 ``rate_limited``), a wait that the queue's drain rate says
cannot end before the deadline (503 ``overloaded``). A ticket still queued at its
deadline is shed by its holder with ``expire`` (503 ``queue_timeout``). Every shed
carries a ``Retry-After`` estimate.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from router.admission.capacity import BUDGET, Capacity
from router.admission.fair import TokenBucket, VirtualCounters, retry_after
from router.admission.stats import AdmissionStats

ShedCode = Literal["queue_full", "rate_limited", "overloaded", "queue_timeout"]
SHED_STATUS: Mapping[ShedCode, int] = {
    "queue_full": 429, "rate_limited": 429, "overloaded": 503, "queue_timeout": 503,
}  # fmt: skip
# tickets of one tenant looked at per pump: one held for its prefix holder does not
# block the next, which may go elsewhere (or be for another pool). Bounded, since a
# pump with nothing to bind looks at all of them; a hold lasts no longer than a
# recompute, so a ticket further back waits at most that long for its turn to be seen.
# (4 blocked the simulator's chat trace: TTFT p50 161 ms -> 5.5 s behind four tickets
# holding for one full engine while three others idled.)
LOOKAHEAD = 32
# How much a new interval between two dispatches moves the queue's drain estimate.
_ALPHA = 0.125
# A tenant counts as active (shares the pool) this long after its last request: longer
# than the gap between two requests of a steady tenant, so that it is still counted
# when its next one comes.
ACTIVE = 2.0
MAX_SEEN = 4096  # tenants remembered as seen before the quiet ones are forgotten
# The pool reserve (``Admission._kept_off``): the chance an entitled request may find
# no idle slot kept for it, the p99 the targets are stated at.
RESERVE_MISS = 0.01
# A tenant's queue stands (``Admission._lifo``) once its oldest ticket has waited this
# many times what a request takes end to end on an engine it may use: about one such
# wait is common in a queue at capacity, which arrival order serves best.
STANDING = 2.0


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant's share and limits (``[tenants.<name>]`` in the router's config)."""

    weight: float = 1.0  # its share of a saturated pool, relative to the others'
    tokens_per_second: float | None = None  # its token-rate limit (None: none)
    burst_tokens: float | None = None  # saved-up tokens (None: ten seconds of the rate)
    priority: int = 0  # the priority of its requests that name none
    api_keys: tuple[str, ...] = ()  # the API keys whose requests are its


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    queue_size: int = 1024  # tickets held at once
    queue_timeout: float = 10.0  # seconds a ticket may wait before it is shed
    engine_queue: int = 1  # requests a full engine is still given (see ``capacity``)
    # the engines' token budget of one step (vLLM's max_num_batched_tokens): waiting while
    # more prompt tokens than that are sent and not started is compute, not full slots
    # (``capacity.cause``); 0: all waiting counts, as before
    engine_batch_tokens: int = BUDGET
    max_inflight: int | None = None  # a fixed per-worker limit (None: learnt)
    starve_after: float = 5.0
    starve_share: int = 8
    # a share of each full engine's slots kept for requests of tenants under their fair
    # share, and urgent ones (priority < 0); see ``capacity``. Off by default: on
    # bench/overload.py, 0.1 kept a steady tenant's TTFT p99 at 1.4x its value alone at 2x
    # load (4.3x without), but at 1x the flooding tenant's goodput halved (18 vs 35 rps)
    reserve: float = 0.0
    # the engines order their waiting queue by the body's priority (vLLM's
    # --scheduling-policy priority): an urgent request (below its tenant's default
    # priority) is sent to a full engine where it goes first (``Admission._jump_to``)
    engine_priority: bool = False
    # a tenant's standing queue goes newest first (``Admission._lifo``); off: arrival order
    lifo: bool = True
    # while a tenant over its share has a standing queue, keep idle slots pool-wide for
    # entitled requests, as many as their measured rate needs (``Admission._kept_off``)
    pool_reserve: bool = False
    tenants: Mapping[str, TenantSpec] = field(default_factory=dict)


class State(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    BOUND = "bound"  # on a worker (or its bind found none: ``worker`` is None)
    SHED = "shed"
    LEFT = "left"  # its client went away while it was held
    DONE = "done"


@dataclass(frozen=True, slots=True)
class Shed:
    status: int
    code: ShedCode
    message: str
    retry_after: int  # seconds


class Ticket:
    """One request as admission sees it; ``payload`` is the caller's (its waiter)."""

    __slots__ = (
        "arrival",
        "bound_at",
        "candidates",
        "charged",
        "deadline",
        "every",
        "output_tokens",
        "payload",
        "priority",
        "prompt_tokens",
        "saved",
        "seq",
        "shed",
        "state",
        "tenant",
        "timeout",
        "worker",
    )

    def __init__(
        self,
        tenant: str,
        priority: int,
        prompt_tokens: int,
        output_tokens: int,
        candidates: tuple[str, ...],
        saved: Mapping[str, float] | None = None,
        payload: object = None,
        timeout: float | None = None,
        every: frozenset[str] | None = None,
    ) -> None:
        self.tenant = tenant
        self.priority = priority
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens  # expected; settled by ``Admission.finish``
        self.candidates = candidates
        # the candidates as a set, where the caller keeps one (a wide pool's thousand
        # targets: not built again for every ticket that goes at once)
        self.every = frozenset(candidates) if every is None else every
        self.saved = saved or {}  # seconds of prefill each worker's cache saves
        self.payload = payload
        # seconds it may wait at most, when its caller allows less than ``queue_timeout``
        # (a gateway's per-message timeout: router.epp)
        self.timeout = timeout
        self.state = State.NEW
        self.worker: str | None = None
        self.shed: Shed | None = None
        self.seq = 0
        self.arrival = 0.0
        self.deadline = math.inf
        self.charged = -1  # the busy period whose fair-share counters it was charged in
        self.bound_at = math.inf  # when it was bound to its worker

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


# ``bind(ticket, allowed)``: route the ticket among ``allowed`` and start it; the worker
# chosen (None: it could not be placed, the caller answers it). ``shed(ticket)``: a
# queued ticket was shed by someone else's arrival; answer it with ``ticket.shed``.
Bind = Callable[[Ticket, frozenset[str]], "str | None"]
ShedHook = Callable[[Ticket], None]


class Rooms:
    """Which workers have no room, kept as their counts move, so that a full pool's pump
    does not ask every candidate's room (``Admission.allowed``: at 1,024 targets a pass
    over them all for every pump, each pump a request ending; issue 34).

    Exact when told every change of a worker's room: its in-flight count (``dirty``: the
    caller's ``Admission.moved`` for the loads, the core's own binds and ends) and its
    limit (a report). A worker told is asked again at the next ``free``, once however
    often it moved. Per candidate set (the tickets of one model share one), the members
    with room are kept too: a full pool's free workers are read, not searched for.
    """

    __slots__ = ("_capacity", "_inflight", "_sets", "closed", "dirty", "known", "tracking")

    SETS = 8  # candidate sets kept (one a model; a retry's set without a target is new)

    def __init__(self, capacity: Capacity, inflight: Callable[[str], int]) -> None:
        self._capacity = capacity
        self._inflight = inflight
        self.tracking = False
        self.dirty: set[str] = set()  # workers whose room may have changed
        self.known: set[str] = set()  # workers whose room was asked once
        # per ``entitled`` (False, True): the workers without room
        self.closed: tuple[set[str], set[str]] = (set(), set())
        # a candidate set -> per ``entitled``, its members with room; the same frozen
        # (None: to freeze again, a member's room changed)
        self._sets: dict[frozenset[str], tuple[list[set[str]], list[frozenset[str] | None]]] = {}

    def _settle(self) -> None:
        dirty, room, inflight = self.dirty, self._capacity.room, self._inflight
        self.known |= dirty
        while dirty:
            w = dirty.pop()
            n = inflight(w)
            for e in (False, True):
                has = room(w, n, e) > 0
                closed = self.closed[e]
                if has == (w not in closed):
                    continue
                (closed.discard if has else closed.add)(w)
                for every, (kept, frozen) in self._sets.items():
                    if w in every:
                        (kept[e].add if has else kept[e].discard)(w)
                        frozen[e] = None

    def free(self, every: frozenset[str], entitled: bool) -> frozenset[str]:
        """``every``'s members with room now (``entitled``: its headroom too)."""
        found = self._sets.get(every)
        if found is None:  # a new candidate set: those never asked are asked once
            self.dirty |= every - self.known
            self._settle()
            if len(self._sets) >= self.SETS:
                del self._sets[next(iter(self._sets))]
            kept = [set(every) - self.closed[False], set(every) - self.closed[True]]
            found = self._sets[every] = (kept, [None, None])
        elif self.dirty:
            self._settle()
        if not self.closed[entitled]:
            return every
        kept, frozen = found
        free = frozen[entitled]
        if free is None:
            free = frozen[entitled] = frozenset(kept[entitled])
        return free


class Admission:
    def __init__(
        self,
        settings: AdmissionSettings,
        inflight: Callable[[str], int],
        bind: Bind,
        shed: ShedHook,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.capacity = Capacity(
            settings.engine_queue, settings.max_inflight, settings.reserve,
            settings.engine_batch_tokens,
        )  # fmt: skip
        self.stats = AdmissionStats(settings.tenants)
        self._inflight = inflight
        self._bind = bind
        self._on_shed = shed
        self._clock = clock
        self._vtc = VirtualCounters(self.weight)
        self._buckets: dict[str, TokenBucket] = {}
        # priority -> tenant -> its queued tickets in arrival order
        self._levels: dict[int, dict[str, deque[Ticket]]] = {}
        self._held: dict[int, Ticket] = {}  # seq -> ticket, in arrival order
        self._backlog: Counter[str] = Counter()  # tokens held per tenant
        self._holders: Counter[str] = Counter()  # held tickets per prefix holder
        self._seq = 0
        self._skips = 0  # dispatches that passed over a starved ticket
        self._drain: float | None = None  # seconds between dispatches while held
        self._last_dispatch = -math.inf
        self._period = 0  # busy periods (a backlog, until it empties) so far
        self._flying: Counter[str] = Counter()  # bound tickets not finished, per tenant
        self._seen: dict[str, float] = {}  # tenant -> its last arrival
        # worker -> its bound tickets not finished, in the order they were bound
        self._bound: dict[str, dict[int, Ticket]] = {}
        self._rooms = Rooms(self.capacity, inflight)  # once told each move (``track_moves``)
        # a candidate set -> the slots its engines are known to run (``entitled``; -1: one
        # never reported)
        self._slots: dict[frozenset[str], int] = {}
        # the pool reserve: seconds between two entitled requests bound (their pace), and
        # when the last one was
        self._entitled_gap: float | None = None
        self._entitled_at = -math.inf

    # -- tenants ------------------------------------------------------------------------
    def spec(self, tenant: str) -> TenantSpec:
        return self.settings.tenants.get(tenant) or _DEFAULT

    def weight(self, tenant: str) -> float:
        return self.spec(tenant).weight

    def default_priority(self, tenant: str) -> int:
        return self.spec(tenant).priority

    def _bucket(self, tenant: str, now: float) -> TokenBucket | None:
        spec = self.settings.tenants.get(tenant)
        if spec is None or spec.tokens_per_second is None:
            return None
        bucket = self._buckets.get(tenant)
        if bucket is None:
            burst = spec.burst_tokens or spec.tokens_per_second * 10.0
            bucket = self._buckets[tenant] = TokenBucket(spec.tokens_per_second, burst, now)
        return bucket

    # -- the life of a ticket -------------------------------------------------------------
    @property
    def queued(self) -> int:
        return len(self._held)

    def arrive(self, ticket: Ticket) -> State:
        """Bind, hold or shed a new ticket; its ``state`` says which (and ``worker`` or
        ``shed`` the rest)."""
        now = self._clock()
        self._seq += 1
        ticket.seq, ticket.arrival = self._seq, now
        self._saw(ticket.tenant, now)
        limit = self.settings.queue_timeout
        if ticket.timeout is not None:
            limit = min(limit, ticket.timeout)
        ticket.deadline = now + limit
        bucket = self._bucket(ticket.tenant, now)
        if bucket is not None:
            wait = bucket.take(ticket.tokens, now)
            if wait > 0:
                return self._shed(
                    ticket, "rate_limited", f"tenant over its token rate; retry in {wait:.1f} s",
                    wait,
                )  # fmt: skip
        if not ticket.candidates or (not self._held and not self.capacity.limited):
            # no engine ever full: go; no engine at all: routing answers why
            self._dispatch(ticket, ticket.every, now)
            return ticket.state
        if not self._held:  # nobody waits: no ordering to respect
            allowed = self.allowed(ticket, now)
            if allowed is not None:
                self._dispatch(ticket, allowed, now)
                return ticket.state
        if len(self._held) >= self.settings.queue_size and not self._evict_for(ticket):
            return self._shed(ticket, "queue_full", "the router's queue is full", self._wait())
        self._hold(ticket)
        self.pump()
        if ticket.state is State.QUEUED:
            wait = self.expected_wait(ticket)
            if wait > ticket.deadline - now:
                self._remove(ticket)
                return self._shed(
                    ticket, "overloaded",
                    f"the pool is saturated: about {wait:.1f} s of queue ahead, over the "
                    f"{limit:g} s it may wait", wait,
                )  # fmt: skip
            self.stats.queued(ticket.tenant, ticket.priority)
        return ticket.state

    def leave(self, ticket: Ticket) -> None:
        """The ticket's client went away while it was held."""
        if ticket.state is State.QUEUED:
            self._remove(ticket)
            self._refund(ticket)
            ticket.state = State.LEFT
            self.stats.left(ticket.tenant, ticket.priority)

    def expire(self, ticket: Ticket) -> Shed | None:
        """The ticket's deadline passed while it was held: shed it (None: it was bound or
        answered meanwhile)."""
        if ticket.state is not State.QUEUED:
            return None
        self._remove(ticket)
        self._shed(
            ticket, "queue_timeout",
            f"no engine had room within {ticket.deadline - ticket.arrival:g} s", self._wait(),
        )  # fmt: skip
        return ticket.shed

    def finish(self, ticket: Ticket, output_tokens: int | None = None) -> None:
        """A bound ticket's request ended (its slot is free); ``output_tokens`` generated,
        when known, settle the estimate it was charged. Binds what can go now."""
        if ticket.state is not State.BOUND:
            return
        ticket.state = State.DONE
        now = self._clock()
        if ticket.worker is not None:
            self._rooms.dirty.add(ticket.worker)  # the slot it frees there
            on = self._bound.get(ticket.worker)
            if on is not None:
                on.pop(ticket.seq, None)
                if not on:
                    del self._bound[ticket.worker]
            self._flying[ticket.tenant] -= 1
            if self._flying[ticket.tenant] <= 0:
                del self._flying[ticket.tenant]
            self.capacity.freed(ticket.worker, now)
            if output_tokens is not None:
                extra = output_tokens - ticket.output_tokens
                if ticket.charged == self._period:
                    self._vtc.charge(ticket.tenant, extra)
                bucket = self._bucket(ticket.tenant, now)
                if bucket is not None:
                    bucket.settle(-extra)
                self.stats.tokens(ticket.tenant, ticket.priority, extra)
        if self._held:
            self.pump()

    def report(
        self, worker: str, running: int | None, waiting: int | None, **why: Any
    ) -> None:
        """An engine's load; a raised limit may let held tickets go. ``why``: what tells
        why its requests wait (``Capacity.report``'s keywords)."""
        capacity = self.capacity
        first, ran, limited = capacity.first(worker), capacity.slots(worker), capacity.limited
        changed = capacity.report(worker, running, waiting, self._clock(), **why)
        if capacity.limited != limited:  # every engine without a limit: see ``room``
            self._rooms.dirty |= self._rooms.known
            changed = True
        if changed or capacity.first(worker) != first or capacity.slots(worker) != ran:
            self._slots.clear()
            self._rooms.dirty.add(worker)
            if self._held:
                self.pump()

    # -- binding ---------------------------------------------------------------------------
    def pump(self) -> int:
        """Bind held tickets while some may go; how many went."""
        now = self._clock()
        bound = 0
        reserve = self.settings.pool_reserve
        while self._held:
            rooms: dict[tuple[str, bool], bool] = {}
            idle: dict[object, tuple[int, int] | bool] = {}
            for ticket in self._order(now):
                if reserve and self._kept_off(ticket, now, idle):
                    continue
                allowed = self.allowed(ticket, now, rooms)
                if allowed is not None:
                    if reserve:
                        allowed = self._idle_first(ticket, allowed, now)
                    self._count_skip(ticket, now)
                    self._remove(ticket)
                    self._dispatch(ticket, allowed, now)
                    bound += 1
                    break
            else:
                break
        if not self._held:  # the busy period is over
            self._vtc.reset()
            self._period += 1
        return bound

    def _order(self, now: float) -> Iterator[Ticket]:
        """Held tickets in the order they are offered a worker."""
        levels = self._levels
        best = min(levels)
        oldest = next(iter(self._held.values()))
        if self._starved(oldest, best, now) and self._skips + 1 >= self.settings.starve_share:
            yield oldest
        value, weight, flying = self._vtc.value, self.weight, self._flying
        for priority in sorted(levels):
            tenants = levels[priority]
            # equal counters (a tenant joining the backlog is lifted to the lowest): the
            # one with fewer requests in flight per weight first, then the older head. On
            # bench/overload.py at 2x, the steady tenant lifted to the flood's counter
            # waited for the flood's older head: two slots freeing instead of one
            order = sorted(
                tenants, key=lambda t: (value(t), flying[t] / weight(t), tenants[t][0].seq)
            )
            for tenant in order:
                queue = tenants[tenant]
                if self._lifo(queue, now):
                    for i in range(1, min(len(queue), LOOKAHEAD) + 1):
                        yield queue[-i]
                else:
                    for i in range(min(len(queue), LOOKAHEAD)):
                        yield queue[i]

    def _lifo(self, queue: deque[Ticket], now: float) -> bool:
        """Whether a tenant's held tickets go newest first: its oldest has waited longer
        than ``STANDING`` times what an engine it may use takes to serve a request end
        to end (the interval at which its slots free times their number, measured from
        the requests that ended there), so the queue is standing, not a burst being
        absorbed or the ordinary queue of a pool at capacity.

        Past saturation a standing queue served oldest first makes every request wait
        about ``queue_timeout`` (it leaves when those ahead of it have timed out or gone),
        so goodput fell as the timeout grew (bench/overload.py, 2 mock engines: 21 -> 13
        requests/s within 0.5 s at 2x load, timeout 0.5 s -> 2 s). Newest first, a served
        request waits about one drain interval whatever the timeout, and the oldest, the
        ones about to time out anyway, are the ones shed (adaptive LIFO, as Facebook's
        queues and CoDel's standing-queue test). Not congested, arrival order: with one
        such time as the bound, the queues of a pool at 1x load (open loop) went newest
        first now and then, and their oldest waited to the timeout (goodput 34.0 and
        33.5 requests/s against 34.8 in arrival order, 2 mock engines); with two, 34.8,
        and at 2x 37.7-38.2 as with one."""
        return self.settings.lifo and self._stands(queue, now)

    def _stands(self, queue: deque[Ticket], now: float) -> bool:
        """Whether a tenant's queue stands (``_lifo``): two tickets or more, its oldest held
        past ``STANDING`` times an engine's turnover."""
        if len(queue) < 2:
            return False
        head = queue[0]
        waited = now - head.arrival
        capacity = self.capacity
        for w in head.candidates:
            limit = capacity.limit(w)
            if limit is not None and waited > STANDING * capacity.free_in(w) * limit:
                return True
        return False

    def _kept_off(
        self, ticket: Ticket, now: float, idle: dict[object, tuple[int, int] | bool]
    ) -> bool:
        """Whether the pool reserve keeps a held ticket waiting: it is not entitled, its
        tenant's queue stands, and its candidates have no more idle slots than the
        entitled requests are expected to need (``reserve_size``). ``idle`` keeps, over
        one pass of the queue, each candidate set's (idle slots, reserve) and each
        tenant's answer.

        An entitled request (urgent, or of a tenant under its share) that finds every
        slot taken waits for the next to free, ~one slot interval of the pool, several
        times its TTFT alone on a short-answer pool: only an idle slot serves it at once,
        and no order at the router gets there. The slots kept idle are sized by
        construction, not a share of each engine: while one is being refilled (one slot
        interval of the pool, once the flood is held back), entitled requests arrive at
        their measured pace; enough are kept that more than that arrive within one
        refill with a chance under ``RESERVE_MISS``."""
        key = (ticket.tenant, ticket.priority, ticket.every)
        known = idle.get(key)
        if known is not None:
            return known is True
        idle[key] = False
        tenants = self._levels.get(ticket.priority)
        queue = None if tenants is None else tenants.get(ticket.tenant)
        if queue is None or not self._stands(queue, now) or self.entitled(ticket, now):
            return False
        found = idle.get(ticket.every)
        if not isinstance(found, tuple):
            free = 0
            for w in ticket.candidates:
                limit = self.capacity.limit(w)
                if limit is None:
                    return False
                free += max(0, limit - self._inflight(w))
            found = idle[ticket.every] = (free, self.reserve_size(ticket.candidates))
        free, keep = found
        idle[key] = kept = free <= keep
        return kept

    def _idle_first(self, ticket: Ticket, allowed: frozenset[str], now: float) -> frozenset[str]:
        """Under the pool reserve, an entitled ticket goes to a worker with an idle slot
        when one is allowed: the slots kept are idle ones, and a worker with room only in
        its engine's queue (``engine_queue``) would start it when its next slot frees,
        the wait the reserve is there to spare it."""
        if len(allowed) < 2 or not self.entitled(ticket, now):
            return allowed
        capacity, inflight = self.capacity, self._inflight
        idle = frozenset(
            w for w in allowed if (limit := capacity.limit(w)) is None or inflight(w) < limit
        )
        return idle or allowed

    def reserve_size(self, candidates: tuple[str, ...]) -> int:
        """Idle slots the pool reserve keeps among ``candidates``: the least k with
        P(Poisson(m) >= k) <= ``RESERVE_MISS``, m the entitled requests expected within
        one slot interval of the pool (0 while their pace or the pool's is unknown); at
        most half their slots. Their pace is the measured one, or slower since the last
        came (a pace that ended is not kept for)."""
        gap = self._entitled_gap
        if gap is None:
            return 0
        gap = max(gap, self._clock() - self._entitled_at)
        if gap <= 0:
            return 0
        rate = 0.0  # slots freeing per second, pool-wide
        slots = 0
        for w in candidates:
            free_in = self.capacity.free_in(w)
            if math.isfinite(free_in) and free_in > 0:
                rate += 1.0 / free_in
            slots += self.capacity.limit(w) or 0
        if rate <= 0 or slots < 2:
            return 0
        return reserve_for(1.0 / (rate * gap), slots // 2)

    def _saw(self, tenant: str, now: float) -> None:
        seen = self._seen
        seen[tenant] = now
        if len(seen) > MAX_SEEN:  # forget the tenants quiet for a while
            for name in [t for t, at in seen.items() if now - at > ACTIVE]:
                del seen[name]

    def entitled(self, ticket: Ticket, now: float) -> bool:
        """Whether ``ticket`` may take a worker's reserved slots, or pass a provisional
        limit (``Capacity.first``): it is urgent (priority below 0), or its tenant has
        fewer requests in flight than its weighted share of the candidates' slots among
        the tenants active now (in flight, or arrived within ``ACTIVE`` seconds). A
        tenant alone is under its share whatever it sends. A candidate without a limit
        counts the most it ran in its last report (``Capacity.slots``: at least what it
        runs); one never reported leaves the share unknown, and every ticket entitled."""
        if ticket.priority < 0:
            return True
        active = {t for t, at in self._seen.items() if now - at <= ACTIVE}
        active.update(self._flying)
        active.add(ticket.tenant)
        if len(active) == 1:
            return True
        total = self._slots.get(ticket.every)
        if total is None:  # kept until a report changes what an engine is known to run
            total = 0
            for w in ticket.candidates:
                slots = self.capacity.slots(w)
                if slots is None:
                    total = -1
                    break
                total += slots
            if len(self._slots) >= Rooms.SETS:
                self._slots.clear()
            self._slots[ticket.every] = total
        if total < 0:  # an engine never reported: the share is unknown
            return True
        weight = self.weight
        share = total * weight(ticket.tenant) / sum(weight(t) for t in active)
        return self._flying[ticket.tenant] < share

    def track_moves(self) -> None:
        """The caller tells ``moved`` every change of a worker's in-flight count made
        outside this class: ``allowed`` then reads the workers without room from counts
        kept as they move (``Rooms``), not from every candidate's room on each pump."""
        self._rooms.tracking = True

    def moved(self, worker: str) -> None:
        """``worker``'s in-flight count may have changed (``track_moves``)."""
        self._rooms.dirty.add(worker)

    def allowed(
        self, ticket: Ticket, now: float, rooms: dict[tuple[str, bool], bool] | None = None
    ) -> frozenset[str] | None:
        """The workers ``ticket`` may be bound to now (None: it waits); ``rooms`` keeps
        whether each worker has room over one pass of the queue."""
        rooms = {} if rooms is None else rooms
        capacity = self.capacity
        # a share decides only where a reserve or a limit is kept
        entitled = not capacity.limited or self.entitled(ticket, now)
        free: frozenset[str]
        if self._rooms.tracking:
            free = self._rooms.free(ticket.every, entitled)
        else:
            found = []
            for w in ticket.candidates:
                has = rooms.get((w, entitled))
                if has is None:
                    room = self.capacity.room(w, self._inflight(w), entitled)
                    has = rooms[w, entitled] = room > 0
                if has:
                    found.append(w)
            free = frozenset(found)
        if not free:
            if self.settings.engine_priority and self.urgent(ticket) and self._may_jump(now):
                jump = self._jump_to(ticket)
                if jump is not None:
                    return frozenset((jump,))
            return None
        saved = ticket.saved
        if saved:
            best = max(saved.values())
            # the best saving among the free ones (0 for one saving nothing), read from
            # the few holders, not from every free candidate
            mine = [v for w, v in saved.items() if w in free]
            most = max(mine, default=0.0)
            if len(mine) < len(free):
                most = max(most, 0.0)
            loss = best - most
            if loss > 0:
                holder = max(saved, key=saved.__getitem__)
                # wait for the holder while the tickets held for it are expected to
                # drain there before this one's deadline (at the pace its slots free):
                # while tickets are held the pool is full, the room elsewhere is taken
                # by another ticket soon enough, and a recompute there costs the pool
                # the prefill the hit saves. Bounding the wait by that prefill instead
                # gave hits away while the pool stayed full: on the simulator's chat
                # trace (tests/test_sim_admission.py's; seeds 1-3, 4 engines) at 2x load
                # TTFT p90 went 5.1 -> 6.6 s and 3.9 -> 9.7 s with admission (5.7 s,
                # 3.6 s with this rule), at 3x seed 2's p50 0.57 -> 2.0 s (0.48 s). The
                # holder's queue (the held tickets whose holder it is, this one among
                # them) counts: waiting while a slot frees there before the deadline,
                # whatever waits for it, shed 39 requests where the policy piles them
                # on the holders (the unfaded charge; none with this rule).
                queue = self._holders[holder] + (ticket.state is not State.QUEUED)
                if self.capacity.free_in(holder) * queue < ticket.deadline - now:
                    return None
        return free

    def urgent(self, ticket: Ticket) -> bool:
        """More urgent than its tenant's default priority."""
        return ticket.priority < self.default_priority(ticket.tenant)

    def _may_jump(self, now: float) -> bool:
        """Whether an urgent ticket may go past a full engine now: not while the
        anti-starvation turn is due (the oldest starved ticket goes first then)."""
        if not self._held:
            return True
        oldest = next(iter(self._held.values()))
        due = self._skips + 1 >= self.settings.starve_share
        return not (due and self._starved(oldest, min(self._levels), now))

    def _jump_to(self, ticket: Ticket) -> str | None:
        """The full engine an urgent ticket goes to, in front of its waiting queue (the
        engines order it by priority, ``engine_priority``); None: none may take it.

        An engine takes urgent tickets past its limit and headroom up to its headroom
        again, at least one (one for an engine of fewer than 16 slots, or none waiting
        otherwise): a bound per engine, so a flood of urgent requests waits at the
        router, in strict priority order and behind the anti-starvation share
        (``_may_jump``), as it would without this, and its tokens are charged to its
        tenant's fair share like any other's. Engines never preempt
        a running request for a waiting one (vLLM: not at ``max_num_seqs``), so the
        ticket waits for the next slot to free there: the engine where one frees first,
        taken as the one whose oldest request in flight was bound first (requests of
        like length end in the order they began), past those urgent tickets sent there
        ahead of it."""
        best: tuple[float, str] | None = None
        for w in ticket.candidates:
            limit = self.capacity.limit(w)
            if limit is None:
                continue
            headroom = self.capacity.headroom(limit)
            over = self._inflight(w) - (limit + headroom)  # urgent ones waiting there
            if over >= max(1, headroom):
                continue
            bound = self._bound.get(w)
            if bound:
                ahead = max(0, over)
                when = next(itertools.islice(bound.values(), min(ahead, len(bound) - 1), None))
                key = (when.bound_at, w)
            else:
                key = (-math.inf, w)
            if best is None or key < best:
                best = key
        return None if best is None else best[1]

    def _starved(self, oldest: Ticket, best: int, now: float) -> bool:
        return oldest.priority > best and now - oldest.arrival >= self.settings.starve_after

    def _count_skip(self, ticket: Ticket, now: float) -> None:
        """Before ``ticket`` leaves the queue: whether it passes over a starved one."""
        oldest = next(iter(self._held.values()))
        if ticket is oldest or not self._starved(oldest, min(self._levels), now):
            self._skips = 0
        else:
            self._skips += 1

    def _dispatch(self, ticket: Ticket, allowed: frozenset[str], now: float) -> None:
        backlog = ticket.state is State.QUEUED
        if backlog:  # the queue's pace: seconds between two tickets leaving it
            gap = now - self._last_dispatch
            drain = self._drain
            self._drain = gap if drain is None else drain + _ALPHA * (gap - drain)
        self._last_dispatch = now
        waited = now - ticket.arrival
        ticket.state = State.BOUND
        ticket.worker = self._bind(ticket, allowed)
        if ticket.worker is None:
            self._refund(ticket)
            return
        self._rooms.dirty.add(ticket.worker)  # the slot it takes there
        if self.settings.pool_reserve and self.entitled(ticket, now):  # its pace
            gap = now - self._entitled_at
            self._entitled_at = now
            if math.isfinite(gap):
                old = self._entitled_gap
                self._entitled_gap = gap if old is None else old + _ALPHA * (gap - old)
        self._flying[ticket.tenant] += 1
        ticket.bound_at = now
        self._bound.setdefault(ticket.worker, {})[ticket.seq] = ticket
        if backlog or self._held:  # fair shares count only while someone waits
            self._vtc.charge(ticket.tenant, ticket.tokens)
            ticket.charged = self._period
        self.stats.admitted(ticket.tenant, ticket.priority, ticket.tokens, waited)

    def _refund(self, ticket: Ticket) -> None:
        """A ticket charged to its tenant's token rate that never ran."""
        bucket = self._buckets.get(ticket.tenant)
        if bucket is not None:
            bucket.settle(ticket.tokens)

    # -- the queue -----------------------------------------------------------------------
    def _hold(self, ticket: Ticket) -> None:
        if not self._held:  # a backlog forms: its pace counts from now
            self._last_dispatch = ticket.arrival
        tenants = self._levels.setdefault(ticket.priority, {})
        backlogged = any(ticket.tenant in level for level in self._levels.values())
        if not backlogged:
            self._vtc.lift(ticket.tenant, self._backlogged())
        tenants.setdefault(ticket.tenant, deque()).append(ticket)
        self._held[ticket.seq] = ticket
        self._backlog[ticket.tenant] += ticket.tokens
        if ticket.saved:
            self._holders[max(ticket.saved, key=ticket.saved.__getitem__)] += 1
        ticket.state = State.QUEUED

    def _backlogged(self) -> Iterator[str]:
        for tenants in self._levels.values():
            yield from tenants

    def _remove(self, ticket: Ticket) -> None:
        del self._held[ticket.seq]
        backlog = self._backlog
        backlog[ticket.tenant] -= ticket.tokens
        if backlog[ticket.tenant] <= 0:
            del backlog[ticket.tenant]
        if ticket.saved:
            holder = max(ticket.saved, key=ticket.saved.__getitem__)
            self._holders[holder] -= 1
            if self._holders[holder] <= 0:
                del self._holders[holder]
        tenants = self._levels[ticket.priority]
        queue = tenants[ticket.tenant]
        if queue[0] is ticket:
            queue.popleft()
        elif queue[-1] is ticket:
            queue.pop()
        else:
            queue.remove(ticket)
        if not queue:
            del tenants[ticket.tenant]
            if not tenants:
                del self._levels[ticket.priority]

    def _projected(self, tenant: str) -> float:
        """A tenant's counter once what it has queued is served: how far over its share
        it is asking to be."""
        return self._vtc.value(tenant) + self._backlog[tenant] / self.weight(tenant)

    def _evict_for(self, ticket: Ticket) -> bool:
        """Make room for ``ticket`` by shedding the worst held ticket, if it ranks below
        (a later priority; or the same, of the tenant asking furthest over its share)."""
        worst_priority = max(self._levels)
        tenants = self._levels[worst_priority]
        worst_tenant = max(tenants, key=lambda t: (self._projected(t), -tenants[t][0].seq))
        if ticket.priority > worst_priority:
            return False
        if ticket.priority == worst_priority:
            if ticket.tenant == worst_tenant:
                return False
            tenant = ticket.tenant
            mine = self._projected(tenant) + ticket.tokens / self.weight(tenant)
            if tenant not in self._backlog:  # it would be lifted on joining
                floor = min(self._vtc.value(t) for t in self._backlog)
                mine += max(0.0, floor - self._vtc.value(tenant))
            if mine >= self._projected(worst_tenant):
                return False
        queue = tenants[worst_tenant]
        # the one with the most still ahead: its newest, or its oldest when it is served
        # newest first
        victim = queue[0] if self._lifo(queue, self._clock()) else queue[-1]
        self._remove(victim)
        self._shed(victim, "queue_full", "the router's queue is full", self._wait())
        self._on_shed(victim)
        return True

    def _shed(self, ticket: Ticket, code: ShedCode, message: str, wait: float) -> State:
        if code != "rate_limited":
            self._refund(ticket)
        ticket.state = State.SHED
        ticket.shed = Shed(SHED_STATUS[code], code, message, retry_after(wait))
        self.stats.shed(ticket.tenant, ticket.priority, code)
        return ticket.state

    # -- estimates -----------------------------------------------------------------------
    def _wait(self) -> float:
        """Seconds for the whole queue to drain at its recent pace (0: unknown)."""
        return 0.0 if self._drain is None else self._drain * len(self._held)

    def expected_wait(self, ticket: Ticket) -> float:
        """Seconds until a held ticket is expected to be bound: the tickets served before
        it, at the queue's recent drain pace (0 while the pace is unknown). Those before it
        are the more urgent ones, and within its priority, for each other tenant, as many
        as its weight gives that tenant while this ticket's own turn comes."""
        if self._drain is None:
            return 0.0
        ahead = 0.0
        for priority, tenants in self._levels.items():
            if priority < ticket.priority:
                ahead += sum(len(q) for q in tenants.values())
            elif priority == ticket.priority:
                mine = tenants.get(ticket.tenant)
                if mine is None:
                    k = 1
                elif self._lifo(mine, self._clock()):  # newest first
                    if mine[-1] is ticket:
                        k = 1
                    else:
                        k = len(mine) - mine.index(ticket) if ticket in mine else 1
                elif mine[-1] is ticket:  # a newcomer: the usual case, no search
                    k = len(mine)
                else:
                    k = 1 + mine.index(ticket) if ticket in mine else 1
                share = k / self.weight(ticket.tenant)
                for tenant, queue in tenants.items():
                    if tenant == ticket.tenant:
                        ahead += k - 1
                    else:
                        ahead += min(len(queue), math.ceil(share * self.weight(tenant)))
        return (ahead + 1) * self._drain

    def held(self) -> Iterator[tuple[str, int, int]]:
        """(tenant, priority, tickets held) for each tenant and priority waiting."""
        for priority, tenants in self._levels.items():
            for tenant, queue in tenants.items():
                yield tenant, priority, len(queue)

    def snapshot(self) -> dict[str, object]:
        """The queue as ``/admin`` shows it."""
        return {
            "queued": len(self._held),
            "queue_size": self.settings.queue_size,
            "drain_every_s": self._drain,
            "levels": {
                str(p): {t: len(q) for t, q in tenants.items()}
                for p, tenants in sorted(self._levels.items())
            },
        }


def reserve_for(expected: float, most: int) -> int:
    """The least k >= 1 with P(N >= k) <= ``RESERVE_MISS`` for N ~ Poisson(``expected``),
    at most ``most`` (and at least 1)."""
    k, term = 0, math.exp(-expected)
    tail = 1.0 - term  # P(N >= k + 1)
    while tail > RESERVE_MISS and k + 1 < most:
        k += 1
        term *= expected / k
        tail -= term
    return k + 1


_DEFAULT = TenantSpec()
