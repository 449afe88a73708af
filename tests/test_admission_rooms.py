"""Admission told each move of the workers' in-flight counts (``Admission.track_moves``,
``Rooms``) against the same admission asking every candidate's room on each pump.

Two admissions driven alike over random scripts (arrivals with their candidate sets,
ends, engine reports that set and lower limits, moves the core does not make itself such
as a peer's flights, time passing): every ticket ends in the same state on the same
worker, and ``allowed`` answers alike for any ticket at any point. Then the reason for
it: once the engines are full, a pump asks the room of the workers that moved, not of
every candidate.
"""

from __future__ import annotations

import random
from collections import Counter

from router.admission.core import Admission, AdmissionSettings, State, TenantSpec, Ticket


class Side:
    """One admission with its own in-flight counts and clock; ``tracked``: told the
    moves (``Admission.moved``) as the gate's loads tell them."""

    def __init__(self, settings: AdmissionSettings, tracked: bool) -> None:
        self.now = 0.0
        self.counts: Counter[str] = Counter()
        self.asked = 0  # in-flight counts read
        self.tracked = tracked
        self.adm = Admission(settings, self._inflight, self._bind, lambda t: None, self._clock)
        if tracked:
            self.adm.track_moves()

    def _clock(self) -> float:
        return self.now

    def _inflight(self, worker: str) -> int:
        self.asked += 1
        return self.counts[worker]

    def _bind(self, ticket: Ticket, allowed: frozenset[str]) -> str | None:
        worker = min(allowed)  # the policy's choice: any of them, the same on both
        self.counts[worker] += 1  # reserved: the core marks it itself
        return worker

    def move(self, worker: str, by: int) -> None:
        """A change the core does not make (a peer's flight, a request not admitted)."""
        self.counts[worker] = max(0, self.counts[worker] + by)
        if self.tracked:
            self.adm.moved(worker)

    def end(self, ticket: Ticket) -> None:
        """The ticket's request ends: its flight leaves the worker's load (told, as the
        load tells it), then the core hears of it."""
        if ticket.worker is not None:
            self.move(ticket.worker, -1)
        self.adm.finish(ticket)


def _run(seed: int) -> None:
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(rng.choice([3, 12, 40]))]
    fixed = rng.choice([None, None, 1, 2])
    reserve = rng.choice([0.0, 0.0, 0.3])
    tenants = {"a": TenantSpec(weight=2.0), "b": TenantSpec(priority=1)}
    settings = AdmissionSettings(
        max_inflight=fixed, engine_queue=rng.choice([0, 1, 2]), reserve=reserve,
        queue_size=64, queue_timeout=1e9, tenants=tenants,
    )  # fmt: skip
    sides = [Side(settings, tracked=False), Side(settings, tracked=True)]
    every = frozenset(workers)  # the tickets of one model share one set (the gate's)
    subsets = [frozenset(rng.sample(workers, max(1, len(workers) // 3))) for _ in range(3)]
    tickets: list[list[Ticket]] = [[], []]
    for step in range(300):
        op = rng.random()
        if op < 0.35:  # a request arrives
            cands = every if rng.random() < 0.7 else rng.choice(subsets)
            tenant, priority = rng.choice(["a", "b", ""]), rng.randrange(2)
            saved = {}
            if rng.random() < 0.3:
                holders = rng.sample(sorted(cands), min(2, len(cands)))
                saved = {w: rng.choice([0.0, 0.2, 1.0]) for w in holders}
            for side, mine in zip(sides, tickets, strict=True):
                t = Ticket(tenant, priority, 100, 10, tuple(sorted(cands)), saved, every=cands)
                mine.append(t)
                side.adm.arrive(t)
        elif op < 0.6:  # a bound request ends
            bound = [i for i, t in enumerate(tickets[0]) if t.state is State.BOUND]
            if bound:
                i = rng.choice(bound)
                for side, mine in zip(sides, tickets, strict=True):
                    side.end(mine[i])
        elif op < 0.8:  # an engine reports
            w = rng.choice(workers)
            running, waiting = rng.randrange(4), rng.choice([0, 0, 1, 3])
            for side in sides:
                side.adm.report(w, running, waiting)
        elif op < 0.9:  # a move the core does not make
            w, by = rng.choice(workers), rng.choice([1, 1, -1])
            for side in sides:
                side.move(w, by)
        else:
            dt = rng.choice([0.01, 0.5, 40.0])
            for side in sides:
                side.now += dt
        states = [[(t.state, t.worker) for t in mine] for mine in tickets]
        assert states[0] == states[1], f"step {step}"
        probe = Ticket("a", 0, 10, 1, tuple(workers), every=every)
        probe.state = State.QUEUED
        answers = [side.adm.allowed(probe, side.now) for side in sides]
        assert answers[0] == answers[1], f"step {step}"


def test_told_moves_admit_as_asking_every_room() -> None:
    for seed in range(40):
        _run(seed)


def test_a_full_pool_asks_only_the_workers_that_moved() -> None:
    """1,024 engines full (a fixed limit of 1, no headroom): a request ending frees one;
    the pump that follows binds the held ticket there, having asked the room of that
    worker (and the one it bound), not of all 1,024."""
    workers = [f"w{i}" for i in range(1024)]
    every = frozenset(workers)
    settings = AdmissionSettings(max_inflight=1, engine_queue=0, queue_timeout=1e9)
    side = Side(settings, tracked=True)
    first = [Ticket("", 0, 10, 1, tuple(workers), every=every) for _ in workers]
    for t in first:
        side.adm.arrive(t)
    assert all(t.state is State.BOUND for t in first)
    held = Ticket("", 0, 10, 1, tuple(workers), every=every)
    side.adm.arrive(held)
    assert held.state is State.QUEUED
    side.asked = 0
    side.end(first[700])
    assert held.state is State.BOUND and held.worker == first[700].worker
    assert side.asked <= 2
    # no room anywhere now: answered having asked only the worker it was bound to
    side.asked = 0
    probe = Ticket("", 0, 10, 1, tuple(workers), every=every)
    assert side.adm.allowed(probe, side.now) is None
    assert side.asked <= 1
    side.asked = 0
    assert side.adm.allowed(probe, side.now) is None
    assert side.asked == 0
