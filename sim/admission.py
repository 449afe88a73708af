"""Admission at the router in the simulator: the router's own core (``router.admission``)
on the virtual clock, so every policy can be replayed with and without it.

A request that arrives is a ``Ticket`` for every routing target, with the prefill each
target's cache would save it (the index's match priced at ``EngineCosts``); the core
binds it at once, holds it, or sheds it. A held one is bound when a request ends or an
engine reports (the engines' running and waiting as last sampled, as the router reads
them), and routed then by the policy among the targets with room (late binding). Shed
requests count in the report's ``shed``; they have no TTFT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol, cast

from router.admission.core import Admission, AdmissionSettings, State, Ticket

if TYPE_CHECKING:
    from policies.base import WorkerView
    from policies.cost_model import EngineCosts
    from router.workers.load import RunningPrefills
    from sim.request import SimRequest


class Simulated(Protocol):
    """What admission reads of, and does to, the simulation (``sim.simulator``)."""

    now: float
    costs: EngineCosts
    block_size: int
    targets: list[str]
    target_engines: dict[str, list[int]]
    inflight: list[int]
    inflight_prefill: list[int]
    prefilled: list[int]
    kv_tokens: list[int]
    prefills: dict[str, RunningPrefills]
    reported: list[tuple[int, int, float]]
    reported_waiting: list[int]
    done: int
    progress: Callable[[int], None] | None

    def at(self, time_ms: float, fn: Callable[..., None], *args: object) -> None: ...
    def _views(self, hashes: list[int]) -> list[WorkerView]: ...
    def route(self, req: SimRequest, allowed: frozenset[str] | None = None) -> str: ...


class SimAdmission:
    def __init__(self, sim: Simulated, settings: AdmissionSettings) -> None:
        self.sim = sim
        if settings.engine_batch_tokens > 0:  # the engines' budget, as an operator knows it
            settings = replace(settings, engine_batch_tokens=sim.costs.max_batch_tokens)
        self.core = Admission(
            settings, self._inflight, self._bind, self._shed, lambda: sim.now / 1000.0
        )
        self.tickets: dict[int, Ticket] = {}  # by request index, until it ends
        self._prefilled: dict[str, int] = {}  # target -> its engines' prefilled then
        self.shed = 0

    def _inflight(self, target: str) -> int:
        sim = self.sim
        return sum(sim.inflight[k] for k in sim.target_engines[target])

    def arrive(self, req: SimRequest) -> None:
        sim = self.sim
        costs, bs = sim.costs, sim.block_size
        full = costs.prefill_ms(req.input_len)
        saved = {}
        for view in sim._views(req.route.block_hashes):
            hit = min(view.match.total * bs, req.input_len - 1)
            if hit > 0:
                saved[view.worker_id] = (full - costs.prefill_ms(req.input_len - hit, hit)) / 1e3
        ticket = Ticket("", 0, req.input_len, req.output_len, tuple(sim.targets), saved, req)
        self.tickets[req.idx] = ticket
        state = self.core.arrive(ticket)
        if state is State.SHED:
            self._shed(ticket)
        elif state is State.QUEUED:
            sim.at(ticket.deadline * 1000.0, self._expire, ticket)

    def _bind(self, ticket: Ticket, allowed: frozenset[str]) -> str:
        return self.sim.route(cast("SimRequest", ticket.payload), allowed)

    def _expire(self, ticket: Ticket) -> None:
        if self.core.expire(ticket) is not None:
            self._shed(ticket)

    def _shed(self, ticket: Ticket) -> None:
        req = cast("SimRequest", ticket.payload)
        sim = self.sim
        del self.tickets[req.idx]
        req.finish_ms = sim.now
        req.tokens = None  # type: ignore[assignment]  # free the prompt; metrics stay
        self.shed += 1
        sim.done += 1
        if sim.progress is not None:
            sim.progress(sim.done)

    def ended(self, req: SimRequest) -> None:
        """A routed request finished (or its engine refused it): its slot is free."""
        ticket = self.tickets.pop(req.idx, None)
        if ticket is not None:
            self.core.finish(ticket, req.output_len)

    def sample(self) -> None:
        """The engines' load as just sampled, per routing target (waiting as vLLM
        reports it, ``BatchEngine.reported_waiting``), with what tells why requests wait
        there: KV usage and size, and the prompt tokens each engine had to prefill since
        the last sample (sent there with no first token yet, or whose first token came
        since; the engines never preempt: each reserves its answer's pages when it
        admits a request)."""
        sim = self.sim
        for target, ks in sim.target_engines.items():
            prefilled = self._prefilled.get(target, 0)
            self._prefilled[target] = sum(sim.prefilled[k] for k in ks)
            reported = [sim.reported[k] for k in ks]
            running = sum(r[0] for r in reported)
            waiting = sum(sim.reported_waiting[k] for k in ks)
            self.core.report(
                target, running, waiting,
                kv_usage=max(r[2] for r in reported),
                kv_tokens=min(sim.kv_tokens[k] for k in ks),
                prefill=sum(sim.inflight_prefill[k] for k in ks)
                + self._prefilled[target] - prefilled,
                need=sim.prefills[target].smallest(),
            )  # fmt: skip
