"""How many requests each engine takes before it queues, learnt from what it reports.

An engine that reports requests waiting may be full: the requests it runs at that
moment may be all it can run (``max_num_seqs``, or as many as its KV cache holds). Its
limit is the most it was seen running, with requests waiting, over the last ``WINDOW``
seconds (or without any waiting, above that). The most, because a request that arrived
during a step waits for the next one whatever room the engine has: on the simulator's
chat trace at 2x load the engines showed 1-3 waiting at 7-45 running, every 500 ms,
their KV caches a third full, and taking each report's running as the limit held at
the router what the engines had room for (TTFT p50 161 ms -> 3.9 s). Within a window,
because a limit set by long prompts in a full cache must come down when they go.

Waiting teaches a limit only when the engine's slots or its memory explain it
(``cause``; session 21, issues 31 and 35). vLLM also keeps requests waiting whenever a
step's token budget is spent (``max_num_batched_tokens``, 2,048 on its CPU build: its
scheduler admits waiting requests ``while token_budget > 0``, vllm/v1/core/sched/
scheduler.py in 0.32), with slots and KV cache free, and says neither setting in its
``/metrics``: with prompts of 500-1,800 tokens the router learnt limits of 3-4 on
bench/e2e.py's engines of 8 slots and held requests the next step would have started (11
and 20 a run, 71-88 ms of mean TTFT, session 20). So a report's waiting counts (less
what the engine defers for reasons of its own, vLLM's ``reason="deferred"``) when the
engine preempted, its KV cache is ``FULL`` or its free pages cannot hold the smallest
prompt sent to it (memory); or when it runs the most it ever ran (an engine of S slots
never runs more than S) and the prompt tokens it had to prefill since its last report,
started or not (the router knows them: its requests there without a first token, and
those whose first token came since), with a token for each running request, fit one
step's budget (``engine_batch_tokens``, ``BUDGET`` by default), so that no step can have
spent it (slots). Any other waiting is read as none: the engine's own queue takes the
next prompt at the next step. On bench/sweep.py's ``e2e-mooncake`` conversation slices
in the simulator (bench/e2e.py's engines: 2 of 8 slots, a 2,048-token budget, 256 pages
of 32 tokens; seeds 0-5), the rule until now held 85 requests (94 s in all; 193 and
336 s at the ``cpu-slow`` costs) and took TTFT mean / p50 / p99 from no admission's 790 /
706 / 2,207 ms to 879 / 776 / 2,718 (cpu-slow 1,564 / 1,498 / 3,837 -> 1,684 / 1,507 /
4,522); with this rule 2 (17 at cpu-slow), the KV caches 91-100 % full, and 804 / 712 /
2,207 (1,578 / 1,504 / 3,837). Running at its most alone was not enough: it learnt 7-8
there and held 10 (seed 1). On bench/e2e.py itself (real vLLM, conversation@1.5, 2
rounds) no limit was learnt and no request held in either run (session 20: 11 and 20
held, 7.1 and 8.8 s in all, limits 8 / 4 and 7 / 3). The price: an engine whose slots
are full while the prompts queued there also fill a step is read as compute, its limit
not learnt (the simulator's engines of 8 slots with 4,096 pages at 4 and 5 requests a
second: the rule until now learnt 8 and held 19 and 47 requests, for TTFT means of 632
and 1,023 ms against 636 and 1,019 ms held by none), so fair shares between tenants are
not kept on such an engine: ``engine_max_inflight`` fixes its limit.

More waiting than the router means to leave there (below), in two reports in a row,
says the engine runs fewer now (its KV cache filled): its limit comes down by an
eighth, or to what it runs if that is more. On the same trace at 3x load, running fell
from 117 to 56 with the cache full and 73 waiting behind a limit of 117 (TTFT p50 7.0 s;
2.1 s with the cut); cut on one report, not two, the 2x run's p90 went 2.8 -> 5.4 s.

An engine never seen with requests waiting in two reports in a row has no limit: the
router holds nothing for it, so traffic that never saturates an engine never waits at
the router. However many wait in one report, they may be a burst that arrived during one
long step (a prefill chunk takes ~0.5 s on the simulator's engines) and goes into the
next (so the simulator's engines reported until session 21; vLLM's do not: a request
that arrives during a step sits in its input queue until the next schedule, and counts
as waiting only if that leaves it there, ``sim.batch_engine``): on the simulator's chat
trace (bench/admission_sim.py, seed 5 at 3x load) an engine of 256 slots, its KV cache
7 % used, reported 5 running and 4 waiting once, and learning 5 from that one report (the
rule until session 19) held at the router what the engines could run while the limit
climbed by its headroom a report (5 -> 45 in 9.5 s, 69 held, no engine with any waiting
in 14 of the 19 reports meanwhile): the share of requests served within 2 s fell from no
admission's 0.585 to 0.130. With two reports (seeds 1-6, loads 1.5x, 2x and 3x): 0.615
there, admission's mean share 0.683 -> 0.723 (no admission 0.727) and its worst against
no admission -0.455 -> -0.078 (seed 6 at 3x; seed 2 at 2x lost most, 0.773 -> 0.649
against no admission's 0.640). Learning from the first report with any waiting was worse
still (seed 3 at 2x: TTFT p90 0.38 s without admission, 3.1 s with).

Without any headroom (``engine_queue`` 0 and a limit under ``PROBE``) an engine is never
offered more than its limit, so its limit could only come down: a request sent as a slot
frees reaches the engine during a step and is reported waiting until the next, twice in
a row now and then, and each time the limit lost one (bench/overload.py, 2 mock engines
of 4 slots: learnt limits ~2, goodput at 1x load 35 -> 13 requests/s). So an engine that
runs all it is given with nothing waiting is offered one more: additive increase, the
cut above the decrease, the limit hovering at the engine's own.

A worker is open while the router's in-flight requests on it are below its limit plus
``engine_queue`` or an eighth of the limit, whichever is more (requests allowed to wait
in the engine, so a slot freed there is filled without a round trip through the router;
and the limit can rise, since the engine is offered more than its limit).

Some of a full engine's slots (``reserve``, a share of its limit, at least one slot
left) are kept for entitled requests, those of a tenant under its fair share or urgent
(``router.admission.core``): a request of a tenant flooding the pool never takes them,
so the next request of a well-behaved tenant finds an idle slot instead of waiting for
one to free (on bench/overload.py's mock pool, slots free every ~28 ms at random: a
wait of up to ~130 ms at p99, three times the 44 ms TTFT of the tenant alone).

A first report with requests waiting, not yet confirmed by the next, sets a provisional
limit (what the engine ran then) that holds back only the requests of a tenant over its
fair share (``room`` with ``entitled`` False; ``router.admission.core``): a burst that the
next step takes costs them at most one report interval, while a flood's onset is held
from the first sign of it, not the second. The next report confirms it (waiting again)
or drops it (none waiting). A tenant alone is never over its share, so a pool with one
tenant never waits on a provisional limit (the simulator's chat trace above). On
bench/overload.py's mock pool (2 engines of 4 slots, the engines scraped every 0.25 s,
a flood at 2x capacity beside a steady tenant; session 20) the first report with waiting
came 0.37 s into the flood and the second confirmed the limit at 0.97 s: meanwhile the
flood had put 9-13 requests on each engine of 4 slots, the steady tenant's requests sent
then waited in the engines' queues behind them (0.2-0.5 s) and those sent later at the
router while that backlog drained (0.2-0.6 s), against 24 ms alone.

``max_inflight`` fixes every limit instead (engines that report no load).
"""

from __future__ import annotations

import math
from typing import Literal

# How much a new interval between two ends on a worker moves its average: about the
# last eight, enough to follow a load change within a second at mock-engine rates.
_ALPHA = 0.125
WINDOW = 30.0  # seconds a limit is remembered without being seen again
# A full engine is offered an eighth more than its limit (at least ``engine_queue``):
# an engine whose limit was learnt low runs them all, with none waiting, and raises it
# by as much at each report, instead of by ``engine_queue``.
PROBE = 8
# The engines' token budget of one step, when not told (``engine_batch_tokens``): vLLM's
# smallest default ``max_num_batched_tokens`` (its CPU build's and small GPUs' API
# server), SGLang's ``chunked_prefill_size`` on small GPUs. Set above an engine's real
# budget, some of its compute waiting reads as slots (the rule before session 21); below
# it, slot waiting past the setting's tokens reads as compute (no limit, nothing held).
BUDGET = 2048
# KV usage at which memory explains waiting whatever the prompts' sizes (the engine's KV
# capacity unknown): an engine this full admits a request only where its pages fit.
FULL = 0.9

Cause = Literal["slots", "memory", "compute"]


def cause(
    running: int,
    most: int,
    budget: int,
    kv_usage: float | None = None,
    kv_tokens: int | None = None,
    preempted: bool = False,
    prefill: int | None = None,
    need: int | None = None,
) -> Cause:
    """Why an engine running ``running`` (the ``most`` it was ever seen running) keeps
    requests waiting.

    ``memory``: it preempted since its last report, or its KV cache is ``FULL``, or its
    free pages hold fewer tokens than the smallest prompt sent to it without a first
    token (``need``; vLLM admits a request only with room for its whole prompt, so none
    of them can start). ``slots``: it
    runs the most it ever ran (an engine of S slots never runs more than S, so below
    that slots cannot be what it waits for), and the prompt tokens it had to compute
    (``prefill``: those not started and those started since its last report, uncached)
    with one token for each running request fit one step's ``budget``, so no step can
    have spent it. ``compute`` otherwise: a step's token budget was spent on prefill,
    and the next step takes the next prompt whatever the router holds."""
    if preempted:
        return "memory"
    if kv_usage is not None:
        if kv_usage >= FULL:
            return "memory"
        if kv_tokens and need and (1.0 - kv_usage) * kv_tokens < need:
            return "memory"
    if running < most:
        return "compute"
    if budget > 0 and prefill is not None and running + prefill >= budget:
        return "compute"
    return "slots"


class Capacity:
    """Per-worker limits and the pace at which their slots free; plain and synchronous."""

    __slots__ = (
        "_first", "_freed_at", "_interval", "_limits", "_most", "_over", "_preemptions",
        "_queued", "_running", "budget", "engine_queue", "max_inflight", "reserve",
    )  # fmt: skip
    # worker -> (the limit, the window's start, the most seen running in this window)

    def __init__(
        self,
        engine_queue: int = 1,
        max_inflight: int | None = None,
        reserve: float = 0.0,
        budget: int = BUDGET,
    ) -> None:
        if engine_queue < 0 or (max_inflight is not None and max_inflight < 1):
            raise ValueError("engine_queue must be >= 0 and max_inflight >= 1")
        if not 0.0 <= reserve < 1.0:
            raise ValueError("reserve must be in [0, 1)")
        if budget < 0:
            raise ValueError("budget must be >= 0")
        self.engine_queue = engine_queue
        self.reserve = reserve
        self.max_inflight = max_inflight
        # the engines' token budget of one step (0: waiting is never read as compute)
        self.budget = budget
        self._most: dict[str, int] = {}  # worker -> the most it was ever seen running
        self._preemptions: dict[str, float] = {}  # worker -> its last preemption count
        self._limits: dict[str, tuple[int, float, int]] = {}
        self._freed_at: dict[str, float] = {}
        self._interval: dict[str, float] = {}  # seconds between two slots freeing
        self._over: set[str] = set()  # workers whose last report had too many waiting
        self._queued: set[str] = set()  # workers whose last report had any waiting
        # worker -> the provisional limit of a first report with waiting, not confirmed yet
        self._first: dict[str, int] = {}
        self._running: dict[str, int] = {}  # worker -> running in its last report

    @property
    def limited(self) -> bool:
        """Whether any worker has a limit, provisional or not (none: nothing is ever
        held)."""
        return self.max_inflight is not None or bool(self._limits) or bool(self._first)

    def first(self, worker: str) -> int | None:
        """The worker's provisional limit (None: none, or its limit is confirmed)."""
        return self._first.get(worker)

    def slots(self, worker: str) -> int | None:
        """What the worker is known to run at most: its limit, provisional or not, else
        the most it ran in its last report (None: never reported)."""
        limit = self.limit(worker)
        if limit is not None:
            return limit
        first = self._first.get(worker)
        if first is not None:
            return first
        return self._running.get(worker) or None

    def limit(self, worker: str) -> int | None:
        """Requests the worker runs before it queues (None: never seen full)."""
        if self.max_inflight is not None:
            return self.max_inflight
        found = self._limits.get(worker)
        return None if found is None else found[0]

    def report(
        self,
        worker: str,
        running: int | None,
        waiting: int | None,
        now: float,
        *,
        deferred: int | None = None,
        kv_usage: float | None = None,
        kv_tokens: int | None = None,
        preemptions: float | None = None,
        prefill: int | None = None,
        need: int | None = None,
    ) -> bool:
        """An engine's load report at ``now``; whether the worker's limit changed (not
        counting its provisional one, ``first``).

        Besides running and waiting, what tells why requests wait (each None: unknown):
        ``deferred``, of the waiting, those the engine holds back for reasons of their
        own (vLLM's ``reason="deferred"``); its KV cache's ``kv_usage`` (0-1) and size
        in tokens (``kv_tokens``); its ``preemptions`` so far (a counter); the uncached
        prompt tokens it had to prefill since its last report or still has to
        (``prefill``: of the requests sent to it, those with no first token yet and
        those whose first token came since); and of the requests with no first token,
        the smallest prompt (``need``). Waiting that neither slots nor memory explain
        (``cause``) says nothing about the engine's slots, and is read as none."""
        if running is None or waiting is None:
            return False
        waiting = max(0, waiting - (deferred or 0))
        most = self._most[worker] = max(self._most.get(worker, 0), running)
        last = self._preemptions.get(worker)
        preempted = preemptions is not None and last is not None and preemptions > last
        if preemptions is not None:
            self._preemptions[worker] = preemptions
        if waiting > 0 and self.max_inflight is None:
            why = cause(running, most, self.budget, kv_usage, kv_tokens, preempted, prefill, need)
            if why == "compute":
                waiting = 0
        self._running[worker] = running
        self._first.pop(worker, None)
        found = self._limits.get(worker)
        old = None if found is None else found[0]
        if found is not None and now - found[1] >= WINDOW:
            # a new window: the last one's peak is the limit, none if it was never full
            found = None if found[2] == 0 else (found[2], now, 0)
        if found is None:
            # any waiting twice in a row: no burst between two steps
            if waiting > 0 and worker in self._queued:
                found = (max(1, running), now, max(1, running))
        else:
            limit, since, peak = found
            over = waiting > self.headroom(limit)
            if over and worker in self._over:  # more waiting than meant, twice: it holds fewer
                lower = max(1, running, limit - max(1, limit // PROBE))
                found = (lower, since, lower)
            else:
                if waiting > 0 or running >= limit:  # full, or as busy as when it was
                    peak = max(peak, running, 1)
                if waiting == 0 and running >= limit and self.headroom(limit) == 0:
                    # all it was given runs, nothing waits, and nothing more is offered:
                    # offer one more (below)
                    peak = max(peak, running + 1)
                found = (max(limit, peak), since, peak)
            (self._over.add if over else self._over.discard)(worker)
        (self._queued.add if waiting > 0 else self._queued.discard)(worker)
        if found is None:
            self._limits.pop(worker, None)
            if waiting > 0 and self.max_inflight is None:  # once: provisional (``first``)
                self._first[worker] = max(1, running)
            return old is not None
        self._limits[worker] = found
        return found[0] != old

    def room(self, worker: str, inflight: int, entitled: bool = True) -> int:
        """Requests the worker can take now (a large number without a limit): all its
        slots and its headroom for an ``entitled`` request, else its slots but the
        reserved ones (``reserved``; with no reserve, its headroom too). A request not
        ``entitled`` is held at a provisional limit too (``first``), and, while some
        engine has a limit, at what an engine without one ran in its last report."""
        limit = self.limit(worker)
        if limit is None and not entitled and self.limited:
            # some engine is full: one that never reported waiting takes a tenant over
            # its share up to what it ran, not past it (the flood held off a full engine
            # went to the other: 20 in flight on 4 slots, session 20)
            limit = self.slots(worker)
        if limit is None:
            return 1 << 30
        if entitled or self.reserve <= 0:
            return limit + self.headroom(limit) - inflight
        return limit - self.reserved(limit) - inflight

    def reserved(self, limit: int) -> int:
        """Slots of a full engine of ``limit`` kept for entitled requests (at least one
        left for the others)."""
        return 0 if self.reserve <= 0 else min(limit - 1, math.ceil(limit * self.reserve))

    def headroom(self, limit: int) -> int:
        """Requests a full engine of ``limit`` may hold waiting."""
        return max(self.engine_queue, limit // PROBE)

    def freed(self, worker: str, now: float) -> None:
        """A request on ``worker`` ended: its slot is free."""
        last = self._freed_at.get(worker)
        self._freed_at[worker] = now
        if last is not None:
            gap = now - last
            old = self._interval.get(worker)
            self._interval[worker] = gap if old is None else old + _ALPHA * (gap - old)

    def free_in(self, worker: str) -> float:
        """Seconds until a slot on ``worker`` is expected to free (inf: unknown)."""
        return self._interval.get(worker, math.inf)

    def forget(self, worker: str) -> None:
        """The worker left the pool."""
        for table in (
            self._limits, self._freed_at, self._interval, self._first, self._running,
            self._most, self._preemptions,
        ):  # fmt: skip
            table.pop(worker, None)
        self._over.discard(worker)
        self._queued.discard(worker)

    def snapshot(self, worker: str) -> dict[str, float | int | None]:
        interval = self._interval.get(worker)
        return {"limit": self.limit(worker), "free_every_s": interval}
