"""Admission's order, shares, limits and shedding, on a fake clock (router.admission).

Deterministic: a ``Pool`` plays the router's part (in-flight counts, the bind callback
that places a ticket on the first allowed worker) and time moves only when a test says.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from router.admission.capacity import WINDOW, Capacity
from router.admission.core import (
    STANDING,
    Admission,
    AdmissionSettings,
    State,
    TenantSpec,
    Ticket,
    reserve_for,
)
from router.admission.fair import TokenBucket, VirtualCounters, retry_after
from router.admission.stats import MAX_TENANTS, OTHER, AdmissionStats


class Pool:
    """Workers with in-flight counts, a clock, and what was bound and shed, in order."""

    def __init__(self, workers: int = 1, **settings: object) -> None:
        self.now = 0.0
        self.inflight: Counter[str] = Counter()
        self.workers = tuple(f"w{i}" for i in range(workers))
        self.bound: list[Ticket] = []
        self.shed: list[Ticket] = []
        self.allowed: list[frozenset[str]] = []
        self.adm = Admission(
            AdmissionSettings(**settings),  # type: ignore[arg-type]
            self.inflight.__getitem__,
            self._bind,
            self.shed.append,
            lambda: self.now,
        )

    def _bind(self, ticket: Ticket, allowed: frozenset[str]) -> str | None:
        if not allowed:
            return None  # the router's routing answers (503: no healthy worker)
        worker = min(allowed)
        self.inflight[worker] += 1
        self.bound.append(ticket)
        self.allowed.append(allowed)
        return worker

    def full(self, limit: int = 1) -> None:
        """Every worker reports ``limit`` running and some waiting, twice (once could be
        a request between two steps)."""
        for w in self.workers:
            self.adm.report(w, limit, 1)
            self.adm.report(w, limit, 1)

    def ticket(
        self,
        tenant: str = "",
        priority: int = 0,
        tokens: int = 100,
        output: int = 0,
        candidates: tuple[str, ...] | None = None,
        saved: dict[str, float] | None = None,
    ) -> Ticket:
        """A new request of ``tokens`` prompt tokens expecting ``output`` more."""
        where = self.workers if candidates is None else candidates
        t = Ticket(tenant, priority, tokens, output, where, saved)
        self.adm.arrive(t)
        return t

    def end(self, ticket: Ticket, output: int | None = None) -> None:
        assert ticket.worker is not None
        self.inflight[ticket.worker] -= 1
        self.adm.finish(ticket, output)


def test_nothing_waits_while_no_engine_was_ever_full() -> None:
    pool = Pool(2, engine_queue=0)
    tickets = [pool.ticket() for _ in range(50)]
    assert all(t.state is State.BOUND for t in tickets)
    assert pool.allowed[0] == frozenset({"w0", "w1"})
    assert pool.adm.queued == 0


def test_a_full_engine_holds_requests_until_a_slot_frees() -> None:
    pool = Pool(1, engine_queue=0)
    first = pool.ticket()
    pool.full(1)  # running 1, waiting 1: its limit is 1
    second = pool.ticket()
    assert pool.adm.queued == 1
    pool.now = 0.2
    pool.end(first)
    assert second.state is State.BOUND and second.worker == "w0"
    assert pool.adm.stats.series[("none", "0")].admitted == 2


def test_engine_queue_lets_a_full_engine_take_more() -> None:
    pool = Pool(1, engine_queue=2)
    pool.full(1)
    states = [pool.ticket().state for _ in range(4)]
    assert states == [State.BOUND, State.BOUND, State.BOUND, State.QUEUED]


def test_lower_priority_values_go_first_and_arrival_order_breaks_ties() -> None:
    pool = Pool(1, engine_queue=0)
    running = pool.ticket()
    pool.full(1)
    held = [pool.ticket(priority=p) for p in (5, 0, -1, 0)]
    pool.end(running)
    while pool.adm.queued:
        pool.end(pool.bound[-1])
    assert [t.priority for t in pool.bound[1:]] == [-1, 0, 0, 5]
    assert pool.bound[2] is held[1]  # the first of the two 0s


def test_a_starved_request_gets_its_share() -> None:
    """Priority 9 waits while priority 0 keeps coming, until starve_after; then one
    dispatch in starve_share is its."""
    pool = Pool(1, engine_queue=0, starve_after=1.0, starve_share=3)
    current = pool.ticket()
    pool.full(1)
    low = pool.ticket(priority=9)
    order = []
    for step in range(12):
        pool.ticket(priority=0)
        pool.now += 0.25
        pool.end(current)
        current = pool.bound[-1]
        order.append((step, current.priority))
        if current is low:
            break
    served_low = [s for s, p in order if p == 9]
    # starved from t=1.0 (step 3); then the third dispatch after it is its own
    assert served_low == [5]


def test_a_flooding_tenant_does_not_delay_a_steady_one() -> None:
    pool = Pool(1, engine_queue=0)
    current = [pool.ticket("flood"), pool.ticket("flood")]
    pool.full(2)
    for _ in range(30):
        pool.ticket("flood")
    steady = pool.ticket("steady")
    # the busy period began with the queue: both counters are 0; flood's head is older,
    # but flood has a request in flight and steady none: the first slot freed is steady's
    pool.end(current[0])
    assert pool.bound[-1] is steady and steady.state is State.BOUND


def test_shares_are_counted_in_tokens_and_weighted() -> None:
    """Both tenants always backlogged: the tokens served follow the weights 2:1, whatever
    the sizes of their requests."""
    tenants = {"a": TenantSpec(weight=2.0), "b": TenantSpec(weight=1.0)}
    pool = Pool(1, engine_queue=0, queue_size=10_000, tenants=tenants)
    current = pool.ticket("a")
    pool.full(1)
    for _ in range(400):
        pool.ticket("a", tokens=1000)
        for _ in range(10):
            pool.ticket("b", tokens=50)
    served: Counter[str] = Counter()
    for _ in range(600):
        pool.end(current)
        current = pool.bound[-1]
        served[current.tenant] += current.tokens
    assert served["a"] / served["b"] == pytest.approx(2.0, rel=0.05)


def test_a_tenant_back_from_idle_banks_no_credit() -> None:
    pool = Pool(1, engine_queue=0, queue_size=10_000)
    current = pool.ticket("a")
    pool.full(1)
    for _ in range(40):
        pool.ticket("a")
    for _ in range(20):  # a alone for a while: its counter grows
        pool.end(current)
        current = pool.bound[-1]
    for _ in range(40):
        pool.ticket("b")
    served = []
    for _ in range(10):
        pool.end(current)
        current = pool.bound[-1]
        served.append(current.tenant)
    assert served.count("b") <= 6  # lifted to a's counter: alternating, not b ten times


def test_a_full_queue_sheds_at_once_with_429_and_a_better_newcomer_takes_the_worst_place() -> None:
    pool = Pool(1, engine_queue=0, queue_size=3)
    pool.ticket()
    pool.full(1)
    held = [pool.ticket("x", priority=p) for p in (0, 5, 5)]
    late = pool.ticket("x", priority=5)
    assert late.state is State.SHED and late.shed is not None
    assert (late.shed.status, late.shed.code) == (429, "queue_full")
    assert late.shed.retry_after >= 1
    urgent = pool.ticket("x", priority=-3)
    assert urgent.state is State.QUEUED
    assert pool.shed == [held[2]]  # the newest of the worst priority
    assert held[2].state is State.SHED and held[2].shed is not None
    assert held[2].shed.code == "queue_full"


def test_a_full_queue_sheds_the_tenant_furthest_over_its_share() -> None:
    pool = Pool(1, engine_queue=0, queue_size=4)
    current = pool.ticket("flood")
    pool.full(1)
    for _ in range(6):
        pool.ticket("flood")
    for _ in range(3):  # flood is served: its counter grows
        pool.end(current)
        current = pool.bound[-1]
    while pool.adm.queued < 4:
        pool.ticket("flood")
    steady = pool.ticket("steady")
    assert steady.state is State.QUEUED
    assert pool.shed and pool.shed[-1].tenant == "flood"


def test_a_deadline_that_cannot_be_met_is_shed_at_once_with_503() -> None:
    pool = Pool(1, engine_queue=0, queue_timeout=1.0, queue_size=1000)
    current = pool.ticket()
    pool.full(1)
    for _ in range(20):
        pool.ticket(priority=-1)
    for _ in range(5):  # the queue drains one every 0.1 s
        pool.now += 0.1
        pool.end(current)
        current = pool.bound[-1]
    # 15 held, newest first now (a standing queue): the oldest is bound after 15 more
    # slots free
    assert pool.adm.expected_wait(pool.adm._held[min(pool.adm._held)]) == pytest.approx(1.5)
    # one less urgent would wait for all 15 and its own: 1.6 s
    late = pool.ticket()
    assert late.state is State.SHED and late.shed is not None
    assert (late.shed.status, late.shed.code, late.shed.retry_after) == (503, "overloaded", 2)


def test_a_ticket_past_its_deadline_expires_with_503() -> None:
    pool = Pool(1, engine_queue=0, queue_timeout=2.0)
    pool.ticket()
    pool.full(1)
    held = pool.ticket()
    pool.now = 2.0
    shed = pool.adm.expire(held)
    assert shed is not None and (shed.status, shed.code) == (503, "queue_timeout")
    assert pool.adm.queued == 0 and pool.adm.expire(held) is None


def test_a_client_that_leaves_leaves_the_queue() -> None:
    pool = Pool(1, engine_queue=0)
    running = pool.ticket()
    pool.full(1)
    gone, kept = pool.ticket("a"), pool.ticket("b")
    pool.adm.leave(gone)
    assert gone.state is State.LEFT and pool.adm.queued == 1
    pool.end(running)
    assert kept.state is State.BOUND and gone.worker is None


def test_a_token_rate_limit_sheds_with_429_and_the_wait() -> None:
    tenants = {"t": TenantSpec(tokens_per_second=100.0, burst_tokens=200.0)}
    pool = Pool(1, tenants=tenants)
    first = pool.ticket("t", tokens=50, output=100)
    second = pool.ticket("t", tokens=50, output=100)
    assert first.state is State.BOUND
    shed = second.shed
    assert second.state is State.SHED and shed is not None
    assert (shed.status, shed.code, shed.retry_after) == (429, "rate_limited", 1)
    pool.end(first, output=0)  # settled: no answer at all, its 100 come back
    assert pool.ticket("t", tokens=150).state is State.BOUND
    assert pool.ticket("other", tokens=10_000).state is State.BOUND  # no limit of its own


def test_late_binding_waits_for_the_prefix_holder_when_that_is_cheaper() -> None:
    pool = Pool(2, engine_queue=0)
    pool.full(1)
    a = pool.ticket(candidates=("w0",))
    for t in (0.0, 0.05, 0.1):  # w0 frees a slot every 0.05 s
        pool.adm.capacity.freed("w0", t)
    # w0 is full, w1 open; w0's cache saves 0.5 s of prefill: wait for w0
    held = pool.ticket(saved={"w0": 0.5, "w1": 0.0})
    assert held.state is State.QUEUED
    pool.now = 0.12
    pool.end(a)
    assert held.worker == "w0"  # both open now: the policy chooses, and sees the hit


def test_late_binding_recomputes_when_the_holders_pace_is_unknown() -> None:
    pool = Pool(2, engine_queue=0)
    pool.full(1)
    pool.ticket(candidates=("w0",))
    # w0's pace unknown: waiting for it might cost anything; go to w1 at once
    cheap = pool.ticket(saved={"w0": 0.5})
    assert cheap.worker == "w1"


def test_a_held_request_waits_for_its_holder_while_the_holders_queue_drains_in_time() -> None:
    """Held for its prefix holder while the tickets held for it would drain there before
    its deadline, at the pace its slots free; not by how little prefill the hit saves."""
    pool = Pool(2, engine_queue=0, queue_timeout=1.0)
    pool.full(1)
    pool.ticket(candidates=("w0",))
    pool.adm.capacity.freed("w0", 0.0)
    pool.adm.capacity.freed("w0", 0.4)  # w0 frees a slot every 0.4 s
    a = pool.ticket(saved={"w0": 0.01})
    b = pool.ticket(saved={"w0": 0.01})
    assert a.state is b.state is State.QUEUED  # two held for w0: 0.8 s < 1 s
    c = pool.ticket(saved={"w0": 0.01})  # three: 1.2 s, past the deadline
    assert a.worker == "w1"  # the first in line takes the room elsewhere
    assert b.state is c.state is State.QUEUED
    pool.now = 0.3  # two held for w0, 0.8 s, 0.7 s left for b: b goes
    pool.inflight["w1"] = 0
    pool.adm.pump()
    assert b.worker == "w1" and c.state is State.QUEUED


def test_capacity_learns_each_engines_limit_from_its_reports() -> None:
    cap = Capacity(engine_queue=1)
    assert cap.limit("w") is None and cap.room("w", 10_000) > 0
    assert not cap.report("w", 3, 0, 0.0)  # never seen full: no limit
    assert not cap.report("w", 4, 1, 0.0)  # one waiting, once: maybe between two steps
    assert cap.report("w", 4, 1, 0.0) and cap.limit("w") == 4
    # waiting at fewer running than the engine was ever seen to run: not its slots
    ran9 = Capacity()
    ran9.report("w", 9, 0, 0.0)
    assert not ran9.report("w", 4, 1, 0.1) and not ran9.report("w", 4, 1, 0.2)
    assert ran9.limit("w") is None and ran9.first("w") is None
    # many waiting once: maybe a burst that arrived during one long step (the simulator's
    # seed 5 at 3x learnt 5 on an engine of 256 slots so), learnt only if they stay
    burst = Capacity()
    assert not burst.report("w", 5, 4, 0.0) and burst.limit("w") is None
    assert not burst.report("w", 9, 0, 0.5) and burst.limit("w") is None
    assert burst.report("w", 9, 4, 1.0) is False and burst.report("w", 9, 3, 1.5)
    assert burst.limit("w") == 9
    assert cap.room("w", 5) == 0 and cap.room("w", 4) == 1
    assert not cap.report("w", 3, 0, 1.0)  # fewer running, nobody waiting: says nothing
    assert cap.report("w", 6, 0, 2.0) and cap.limit("w") == 6  # ran more without a queue
    # one waiting at fewer running (a request between two steps): the most seen stands
    assert not cap.report("w", 2, 1, 3.0) and cap.limit("w") == 6
    # more waiting than its headroom twice running: it runs fewer now (a full KV cache)
    full = {"kv_usage": 0.95}
    assert not cap.report("w", 5, 2, 3.4, **full) and cap.limit("w") == 6
    assert cap.report("w", 5, 2, 3.5, **full) and cap.limit("w") == 5
    assert cap.report("w", 6, 1, 3.6) and cap.limit("w") == 6
    assert not cap.report("w", None, 5, 4.0)
    # a new window: the last one's peak; then one never full forgets the limit
    assert not cap.report("w", 3, 1, WINDOW, **full) and cap.limit("w") == 6
    assert cap.report("w", 1, 0, 2 * WINDOW) and cap.limit("w") == 3
    assert cap.report("w", 1, 0, 3 * WINDOW) and cap.limit("w") is None
    assert Capacity(max_inflight=3).limit("any") == 3


def test_virtual_counters_and_buckets() -> None:
    vtc = VirtualCounters(lambda t: 2.0 if t == "a" else 1.0)
    vtc.charge("a", 100)
    vtc.charge("b", 100)
    assert (vtc.value("a"), vtc.value("b")) == (50.0, 100.0)
    vtc.lift("c", ["a", "b"])
    assert vtc.value("c") == 50.0
    bucket = TokenBucket(10.0, 20.0, now=0.0)
    assert bucket.take(50, 0.0) == 0.0  # larger than the burst: passes when full
    assert bucket.take(5, 0.0) == pytest.approx(3.5)  # at -30: 5 tokens in 3.5 s
    assert [retry_after(x) for x in (0.0, math.nan, 0.2, 1.5, math.inf)] == [1, 1, 1, 2, 60]


def test_stats_labels_are_bounded() -> None:
    stats = AdmissionStats(["paying"])
    for i in range(MAX_TENANTS * 2):
        stats.queued(f"t{i}", i)
    tenants = {k[0] for k in stats.series}
    priorities = {k[1] for k in stats.series}
    assert len(tenants) <= MAX_TENANTS and OTHER in tenants
    assert stats.key("paying", 0)[0] == "paying" and OTHER in priorities


def test_reserved_slots_wait_for_the_tenant_under_its_share() -> None:
    """Alone, a flood takes every slot; once a steady tenant is active the flood keeps
    off a reserved slot per engine, so the steady tenant's next request starts at once."""
    pool = Pool(2, engine_queue=0, reserve=0.25, queue_size=100)
    pool.full(4)
    flood = [pool.ticket("flood") for _ in range(12)]
    assert sum(t.state is State.BOUND for t in flood) == 8  # alone: under its share
    steady = pool.ticket("steady")
    assert pool.adm.queued == 5  # four of the flood's, and the steady one
    pool.now = 0.1
    pool.end(flood[0])
    assert steady.state is State.BOUND  # the next slot: its counter is the lowest
    for t in flood[1:5]:  # four flood requests end: the flood may refill three of them
        pool.now += 0.05
        pool.end(t)
    assert pool.inflight == Counter({"w0": 3, "w1": 3})  # one slot idle per engine, kept
    pool.end(steady)
    urgent = pool.ticket("flood", priority=-1)  # urgent requests may take it too
    assert urgent.state is State.BOUND
    pool.end(urgent)
    pool.now += 0.5
    assert pool.ticket("steady").state is State.BOUND  # at once, no wait for a slot


def test_a_request_with_no_worker_at_all_is_not_held() -> None:
    """No candidate (every engine down): routing answers at once, not a queue timeout."""
    pool = Pool(1, engine_queue=0)
    pool.ticket()
    pool.full(1)
    lost = pool.ticket(candidates=())
    assert lost.state is State.BOUND and lost.worker is None and pool.adm.queued == 0


def test_without_headroom_a_limit_cut_by_a_passing_wait_comes_back() -> None:
    """engine_queue 0: the engine is never offered more than its limit, so a request
    reported waiting between two steps, twice, must not cut the limit for good."""
    cap = Capacity(engine_queue=0)
    cap.report("w", 4, 1, 0.0)
    cap.report("w", 4, 1, 0.1)
    assert cap.limit("w") == 4
    # a slot freed, its next request not yet scheduled: fewer running than the engine
    # ran, so not what its slots hold (until session 21 this cut the limit to 3)
    cap.report("w", 3, 1, 0.2)
    cap.report("w", 3, 1, 0.3)
    assert cap.limit("w") == 4
    cap.report("w", 3, 1, 0.2, kv_usage=0.95)  # its KV cache full: it runs fewer now
    cap.report("w", 3, 1, 0.3, kv_usage=0.95)
    assert cap.limit("w") == 3
    cap.report("w", 3, 0, 0.4)  # all it was given runs, nothing waits: one more
    assert cap.limit("w") == 4
    cap.report("w", 4, 0, 0.5)
    assert cap.limit("w") == 5
    cap.report("w", 4, 1, 0.6)  # it runs 4: the fifth waits, twice: back to 4
    cap.report("w", 4, 1, 0.7)
    assert cap.limit("w") == 4


def _saturated(pool: Pool, limit: int) -> list[Ticket]:
    """Every worker full at ``limit``, its tickets bound 0.1 s apart (w0's first)."""
    pool.full(limit)
    running = []
    for _ in range(limit * len(pool.workers)):
        running.append(pool.ticket())
        pool.now += 0.1
    return running


def test_an_urgent_request_goes_to_a_priority_scheduling_engine_past_its_limit() -> None:
    """With engines that order their queue by priority, an urgent request (below its
    tenant's default) is not held for a slot: it goes to the full engine where a slot is
    expected to free first (the one whose oldest request began first), one past the
    limit per engine; more urgent ones wait at the router, in priority order."""
    tenants = {"gold": TenantSpec(priority=-5)}
    pool = Pool(2, engine_queue=0, engine_priority=True, tenants=tenants)
    running = _saturated(pool, 2)  # w0: bound at 0.0, 0.1; w1: at 0.2, 0.3
    held = pool.ticket("flood")
    assert held.state is State.QUEUED
    pool.end(running[0])  # w0 frees; the held ticket takes it (bound at 0.4)
    assert held.worker == "w0"
    # w0's oldest now began at 0.1, w1's at 0.2: w0's slot frees first
    urgent = pool.ticket("flood", priority=-10)
    assert urgent.state is State.BOUND and pool.allowed[-1] == frozenset({"w0"})
    # w0 has one urgent request waiting: the next goes to w1
    second = pool.ticket("flood", priority=-1)
    assert second.state is State.BOUND and second.worker == "w1"
    # one past the limit on each: the third waits at the router, first in line
    third = pool.ticket("flood", priority=-10)
    assert third.state is State.QUEUED
    # not urgent: its tenant's default priority, or the flood's own 0
    assert pool.ticket("gold", priority=-5).state is State.QUEUED
    assert pool.ticket("flood").state is State.QUEUED
    pool.end(running[2])
    assert pool.bound[-1] is third


def test_without_priority_scheduling_engines_an_urgent_request_waits_for_a_slot() -> None:
    pool = Pool(2, engine_queue=0)
    _saturated(pool, 2)
    assert pool.ticket("flood", priority=-10).state is State.QUEUED


def test_urgent_requests_do_not_jump_past_a_starved_ones_turn() -> None:
    """The anti-starvation share holds for urgent requests sent past a full engine: once
    a starved ticket's turn is due, the next urgent one waits at the router."""
    pool = Pool(2, engine_queue=1, engine_priority=True, starve_after=1.0, starve_share=2)
    running = _saturated(pool, 2)  # headroom 1: three a worker
    for _ in range(2):
        pool.ticket()  # fills each worker's headroom
    low = pool.ticket(priority=5)
    assert low.state is State.QUEUED
    pool.now += 1.5  # low is starved now
    jumped = pool.ticket(priority=-10)
    # the first dispatch past the starved ticket is allowed (one in starve_share = 2 is its)
    assert jumped.state is State.BOUND
    blocked = pool.ticket(priority=-10)
    assert blocked.state is State.QUEUED
    pool.end(running[0])  # w0 back to its limit and headroom (the urgent one is there)
    assert low.state is blocked.state is State.QUEUED
    pool.end(running[1])  # a slot: the starved ticket's turn, then the urgent one again
    assert pool.bound[-2:] == [low, blocked]


class Paced:
    """One worker of 4 slots of 0.4 s each on the pool's fake clock: every 0.1 s its
    oldest request ends (once all 4 run), after requests arrive at ``per_step`` a step
    (0.05 s apart; 2 a step is twice its pace), held ones past their deadline expire."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        pool.full(4)
        pool.adm.capacity.freed("w0", -0.2)  # its pace, as if measured
        pool.adm.capacity.freed("w0", -0.1)
        self.seen = 0  # of pool.bound, how many are in flying
        self.flying: list[Ticket] = []

    def _track(self) -> None:
        self.flying.extend(self.pool.bound[self.seen :])
        self.seen = len(self.pool.bound)

    def step(self, k: int, per_step: int) -> Ticket | None:
        """Step ``k``; the ticket the freed slot went to (None: none was held)."""
        pool = self.pool
        for i in range(per_step):
            pool.now = round(k * 0.1 + i * 0.1 / per_step, 6)
            for t in [t for t in pool.adm._held.values() if t.deadline <= pool.now]:
                pool.adm.expire(t)
            pool.ticket("flood")
            self._track()
        pool.now = round((k + 1) * 0.1, 6)
        if len(self.flying) < 4:
            return None
        n = len(pool.bound)
        pool.end(self.flying.pop(0))
        self._track()
        return pool.bound[-1] if len(pool.bound) > n else None


def _standing(queue_timeout: float, steps: int = 300, lifo: bool = True) -> tuple[int, int]:
    """One tenant at twice the worker's pace for 30 s: (requests bound within 0.5 s of
    arriving, requests bound)."""
    pool = Pool(1, engine_queue=0, queue_timeout=queue_timeout, queue_size=100_000, lifo=lifo)
    paced = Paced(pool)
    for k in range(steps):
        paced.step(k, 2)
    waits = [t.bound_at - t.arrival for t in pool.bound]
    return sum(w <= 0.5 for w in waits), len(waits)


def test_a_standing_queue_goes_newest_first_so_goodput_does_not_depend_on_the_timeout() -> None:
    """Past saturation, arrival order made every request wait about queue_timeout (those
    ahead of it timed out first): with a 2 s timeout none of them met a 0.5 s bound.
    Newest first once the queue stands, the served ones wait about a slot's interval
    whatever the timeout, and the oldest time out instead."""
    good_short, served_short = _standing(0.5)
    good_long, served_long = _standing(2.0)
    # a slot frees every 0.1 s for 30 s: ~300 served either way
    assert served_short >= 290 and served_long >= 290
    assert good_long >= 0.95 * served_long
    assert good_long >= 0.95 * good_short
    # in arrival order (queue_lifo off) the same load meets the bound with the short
    # timeout only
    good_fifo, served_fifo = _standing(2.0, lifo=False)
    assert served_fifo >= 290 and good_fifo <= 0.05 * served_fifo
    assert _standing(0.5, lifo=False)[0] >= 0.95 * served_short


def test_a_queue_goes_newest_first_only_once_it_stands() -> None:
    """Arrival order while the oldest held ticket has waited no longer than twice what a
    request takes end to end (4 slots freeing every 0.1 s: 0.8 s), so a burst is served
    in order; newest first past that; arrival order again once it has drained."""
    pool = Pool(1, engine_queue=0, queue_size=1000, queue_timeout=100.0)
    paced = Paced(pool)
    took = {"oldest": 0, "newest": 0}
    for k in range(60):
        per_step = 2 if k < 20 else 0  # twice the pace, then nothing
        held_before = None
        if per_step == 0:
            held_before = list(pool.adm._held.values())
        if per_step:
            # arrivals first, then the slot frees: judge the queue as it is then
            for i in range(per_step):
                pool.now = round(k * 0.1 + i * 0.05, 6)
                pool.ticket("flood")
                paced._track()
            per_step = 0
            held_before = list(pool.adm._held.values())
        went = paced.step(k, 0) if held_before else None
        if not held_before or went is None:
            continue
        turn = STANDING * pool.adm.capacity.free_in("w0") * 4  # as the slot freed
        standing = len(held_before) > 1 and pool.now - held_before[0].arrival > turn
        assert went is (held_before[-1] if standing else held_before[0]), k
        took["newest" if standing else "oldest"] += 1
    assert took["oldest"] >= 5 and took["newest"] >= 5


def _two_tenants(
    pool_reserve: bool, seconds: float = 20.0
) -> tuple[list[Ticket], list[Ticket], Pool]:
    """Two workers of 4 slots, every request 0.4 s (a slot frees every 0.05 s pool-wide
    at full load), a flood at twice the pool's pace and a steady tenant every 0.35 s:
    (the steady tenant's tickets, the flood's, the pool), on the fake clock."""
    import heapq

    pool = Pool(2, engine_queue=0, queue_size=100_000, queue_timeout=2.0, pool_reserve=pool_reserve)
    pool.full(4)
    events: list[tuple[float, int, str, Ticket | None]] = []
    seq = itertools.count()
    for i in range(int(seconds / 0.025)):
        heapq.heappush(events, (round(i * 0.025, 6), next(seq), "flood", None))
    for i in range(int(seconds / 0.35)):
        heapq.heappush(events, (round(0.0123 + i * 0.35, 6), next(seq), "steady", None))
    steady: list[Ticket] = []
    flood: list[Ticket] = []
    seen = 0
    while events:
        at, _, kind, ticket = heapq.heappop(events)
        pool.now = at
        for held in [t for t in pool.adm._held.values() if t.deadline <= at]:
            pool.adm.expire(held)
        if kind == "end":
            assert ticket is not None
            pool.end(ticket)
        else:
            (steady if kind == "steady" else flood).append(pool.ticket(kind))
        for t in pool.bound[seen:]:  # what this event bound runs 0.4 s
            heapq.heappush(events, (round(at + 0.4, 6), next(seq), "end", t))
        seen = len(pool.bound)
    return steady, flood, pool


def test_the_pool_reserve_keeps_idle_slots_for_the_tenant_under_its_share() -> None:
    """Past saturation every slot is taken: a steady tenant's request waits for the next
    to free (here up to 0.05 s; on bench/overload.py's pool several times its TTFT
    alone). With ``pool_reserve`` the flood, once its queue stands, is held back while
    the pool has no more idle slots than the steady tenant's pace needs (here 3: with 5
    slots busy one frees every 0.08 s, within which a second steady arrival has a chance
    of 0.02, a third 0.002), so every steady request is bound at once; the flood still
    runs in the rest."""
    steady, _, _ = _two_tenants(pool_reserve=False)
    waits = [t.bound_at - t.arrival for t in steady if t.arrival > 3.0]
    assert sum(w > 0 for w in waits) >= len(waits) // 2  # without: most wait for a slot
    steady, flood, _ = _two_tenants(pool_reserve=True)
    waits = [t.bound_at - t.arrival for t in steady if t.arrival > 3.0]
    assert waits and max(waits) == 0.0
    served = sum(t.state in (State.BOUND, State.DONE) for t in flood)
    # 8 slots of 0.4 s for 20 s: 400 requests; the steady tenant takes ~1.1 slots and
    # three are kept idle, ~4 slots for the flood: ~190
    assert served >= 170


def test_the_pool_reserve_keeps_nothing_without_a_standing_queue_or_a_second_tenant() -> None:
    """A burst (the flood's queue not standing yet) and a tenant alone (under its share
    whatever it sends) take every slot; once the flood's queue stands, the freed slots
    stay idle up to the reserve."""
    pool = Pool(2, engine_queue=0, queue_size=100, pool_reserve=True)
    pool.full(4)
    pool.adm.reserve_size = lambda candidates: 2  # type: ignore[method-assign]
    flying = [pool.ticket("flood") for _ in range(8)]
    steady = pool.ticket("steady")
    assert pool.inflight.total() == 8 and steady.state is State.QUEUED
    pool.ticket("flood")
    busy = []
    for k in range(1, 41):  # a slot frees every 0.1 s, the flood comes twice as often
        pool.now = round(k * 0.1, 6)
        if flying:
            pool.end(flying.pop(0))
        pool.ticket("flood")
        pool.ticket("flood")
        flying += [t for t in pool.bound if t.tenant == "flood" and t.state is State.BOUND
                   and t not in flying]  # fmt: skip
        busy.append(pool.inflight.total())
    assert steady.state is State.BOUND
    assert busy[:7] == [8] * 7  # a burst: every slot taken
    assert busy[-3:] == [6] * 3  # once the queue stands two slots are kept idle
    alone = Pool(2, engine_queue=0, queue_size=100, pool_reserve=True)
    alone.full(4)
    alone.adm.reserve_size = lambda candidates: 2  # type: ignore[method-assign]
    burst = [alone.ticket("flood") for _ in range(12)]
    for k in range(1, 5):
        alone.now = k * 0.5
        alone.end(burst[k - 1])
    assert alone.inflight.total() == 8  # alone, under its share: nothing kept


def test_the_pool_reserve_is_the_poisson_quantile_of_the_entitled_arrivals() -> None:
    """k idle slots: the least k such that k or more entitled arrivals within one slot
    interval have a chance of at most 1 %."""
    assert reserve_for(0.005, 4) == 1  # P(N >= 1) = 0.005
    assert reserve_for(0.1, 4) == 2  # P(N >= 1) = 0.095, P(N >= 2) = 0.005
    assert reserve_for(0.5, 8) == 4  # 0.39, 0.090, 0.014, 0.0018
    assert reserve_for(0.5, 3) == 3  # at most half the slots
    assert reserve_for(5.0, 4) == 4


@pytest.mark.parametrize("reserve", [False, True])
def test_under_the_pool_reserve_an_entitled_request_takes_an_idle_slot(reserve: bool) -> None:
    """w0 has room only in its engine's queue (``engine_queue``), w1 an idle slot: the
    steady tenant's request goes to w1 under the pool reserve (the bind would take w0,
    the first allowed, and the request would wait there for a slot)."""
    pool = Pool(2, engine_queue=1, queue_size=100, pool_reserve=reserve)
    pool.full(4)
    for _ in range(11):
        pool.ticket("flood")
    assert pool.inflight == Counter({"w0": 5, "w1": 5}) and pool.adm.queued == 1
    pool.inflight.update({"w0": -1, "w1": -2})  # as if those had ended unseen
    steady = pool.ticket("steady")
    assert steady.state is State.BOUND
    assert steady.worker == ("w1" if reserve else "w0")


def test_a_flood_is_held_from_the_first_report_with_waiting_a_steady_tenant_is_not() -> None:
    """A flood's onset: before any limit is learnt the flood fills both engines past their
    slots; from the first report with requests waiting (not the second, which confirms a
    limit), the tenant over its fair share waits at the router, while a tenant under it
    and an urgent request still go at once (bench/overload.py's onset, session 20)."""
    pool = Pool(2, engine_queue=1)
    pool.ticket("steady")  # a second tenant is active: the flood has a share, not all
    flood = [pool.ticket("flood", candidates=(f"w{i % 2}",)) for i in range(10)]
    assert all(t.state is State.BOUND for t in flood)  # nothing learnt: nothing held
    pool.adm.report("w0", 4, 1)
    pool.adm.report("w1", 4, 1)  # once: no limit yet, a provisional one
    more = pool.ticket("flood")
    assert more.state is State.QUEUED  # 5-6 in flight on each, its share of 8 slots is 4
    assert pool.adm.capacity.limit("w0") is None and pool.adm.capacity.first("w0") == 4
    steady = pool.ticket("steady")
    urgent = pool.ticket("flood", priority=-10)
    assert steady.state is State.BOUND and urgent.state is State.BOUND
    # the second report confirms: the limit holds everyone as before
    pool.adm.report("w0", 4, 2)
    pool.adm.report("w1", 4, 2)
    assert pool.adm.capacity.limit("w0") == 4 and pool.adm.capacity.first("w0") is None
    assert pool.ticket("steady").state is State.QUEUED and more.state is State.QUEUED


def test_a_provisional_limit_the_next_report_does_not_confirm_lets_the_held_go() -> None:
    """A burst that the next step takes (no waiting in the next report): the provisional
    limit goes, and what it held goes with it."""
    pool = Pool(1, engine_queue=0)
    pool.ticket("steady")
    for _ in range(3):
        pool.ticket("flood")
    pool.adm.report("w0", 3, 1)
    held = pool.ticket("flood")
    assert held.state is State.QUEUED
    pool.adm.report("w0", 4, 0)
    assert held.state is State.BOUND and pool.adm.capacity.first("w0") is None
    assert pool.adm.capacity.limit("w0") is None and pool.adm.queued == 0


def test_a_tenant_alone_never_waits_on_a_provisional_limit() -> None:
    """One tenant is under its share whatever it sends: a single report with requests
    waiting (a burst during one long step, the simulator's case) holds none of its
    requests; only the second, confirming the limit, does."""
    pool = Pool(2, engine_queue=0)
    for _ in range(12):
        pool.ticket("only")
    pool.adm.report("w0", 5, 4)
    pool.adm.report("w1", 5, 4)
    assert all(pool.ticket("only").state is State.BOUND for _ in range(5))
    anonymous = Pool(1, engine_queue=0)
    anonymous.ticket()
    anonymous.adm.report("w0", 1, 3)
    assert anonymous.ticket().state is State.BOUND


def test_capacity_keeps_a_provisional_limit_for_one_report() -> None:
    cap = Capacity(engine_queue=1)
    assert cap.slots("w") is None and cap.first("w") is None
    assert not cap.report("w", 3, 0, 0.0) and cap.slots("w") == 3 and cap.first("w") is None
    assert not cap.report("w", 4, 2, 0.25)  # the limit itself is not learnt from one
    assert cap.first("w") == 4 and cap.limited
    assert cap.room("w", 5, entitled=True) > 1000  # an entitled request passes it
    assert cap.room("w", 5, entitled=False) == 0 and cap.room("w", 4, entitled=False) == 1
    assert cap.report("w", 4, 1, 0.5) and cap.limit("w") == 4 and cap.first("w") is None
    dropped = Capacity()
    dropped.report("w", 4, 2, 0.0)
    dropped.report("w", 4, 0, 0.25)
    assert dropped.first("w") is None and not dropped.limited
    assert Capacity(max_inflight=2).first("w") is None
    fixed = Capacity(max_inflight=2)
    fixed.report("w", 2, 3, 0.0)
    assert fixed.first("w") is None


def test_a_flood_held_off_one_full_engine_does_not_pile_onto_the_other() -> None:
    """One engine reports requests waiting, the other only that it runs 4: the tenant over
    its share may fill the second up to what it ran (and its headroom), not without
    bound (bench/overload.py at 2x: 20 in flight on the engine of 4 slots that had not
    reported waiting yet, while the other was held at its provisional limit)."""
    pool = Pool(2, engine_queue=1)
    pool.ticket("steady", candidates=("w1",))
    for _ in range(5):
        pool.ticket("flood", candidates=("w0",))
    pool.adm.report("w0", 4, 1)
    pool.adm.report("w1", 1, 0)
    states = [pool.ticket("flood").state for _ in range(6)]
    # w1 ran 1 in its last report: up to 1 + its headroom 1 in flight there (1 is steady's)
    assert states == [State.BOUND] + [State.QUEUED] * 5
    assert pool.ticket("steady").state is State.BOUND  # under its share: not held
