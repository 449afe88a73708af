"""Discrete-event replay of a trace through the real index, codec and policies.

N ``BatchEngine``s run on one virtual clock (milliseconds, a heap of timed callbacks).
What the router side does is the code users run:

- engines' KV events are msgpack-encoded with ``index.codec.encode`` and applied by
  ``EventIngest.apply`` to a ``PrefixIndex`` after ``event_lag_ms``;
- each arrival builds ``WorkerView``s as the router does (``match_tiers`` from the index;
  in-flight requests and prefill tokens counted by the router and released at first
  token; the engines' running / waiting / KV usage as last sampled every
  ``load_interval_ms``) and asks the policy from ``policies.make_policy``;
- a decision's prefetch hint is translated to the source engine's hashes with
  ``EventIngest.engine_hashes`` and executed as a transfer of the blocks the target
  lacks (what the policy budgets) over the target's link at ``EngineCosts.prefetch_gbps``,
  landing in the target's host tier (GPU without one).

``SimConfig.costs`` are the engines' timings (``worker_costs`` per engine: a mixed
pool); the policies estimate with their own (``EngineCosts()`` unless given), so
engines faster or slower than a policy assumes are one flag away (``cache-router
replay --engine-costs``).
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from index.backend import make_ingest
from index.codec import Event, EventBatch, encode
from index.groups import clip_matches, parse_groups
from index.hashing import BlockHasher, cacheable_blocks
from index.ingest import SeqStatus
from index.prefix_index import PrefixIndex
from policies import EngineCosts, PrefetchHint, WorkerView, make_policy
from policies.base import NO_MATCH, expected_hit_blocks
from policies.cost_model import uncached_tokens
from router.admission.core import AdmissionSettings
from router.workers.dp import target_id
from router.workers.load import RunningPrefills
from sim.admission import SimAdmission
from sim.batch_engine import BatchEngine
from sim.cache import PrefixCache
from sim.report import PolicyReport, summarize
from sim.request import SimRequest
from sim.traces import Trace


@dataclass(frozen=True, slots=True)
class SimConfig:
    workers: int = 8
    l1_blocks: int = 16384  # GPU pages per engine (Dynamo's mocker default)
    l2_blocks: int = 0  # host pages per engine (0: no host tier)
    max_num_seqs: int = 256
    event_lag_ms: float = 10.0  # engine -> agent -> NATS -> router
    load_interval_ms: float = 500.0  # engine load reports
    predict_ttl_ms: float = 0.0  # predict-on-route TTL; 0 disables it
    engine_seed: int = 0
    seed: int = 0
    costs: EngineCosts = field(default_factory=EngineCosts)
    # a disaggregated pool (sim.pd): this many prefill engines, ``workers`` decode engines
    prefill_workers: int = 0
    local_prefill_tokens: int = 0  # the decode engine prefills itself below this
    # engines with data-parallel ranks, each its own cache; ``dp_aware`` False: a router
    # that merges the ranks in its index and lets the engine's balancer pick one
    dp_size: int = 1
    dp_aware: bool = True
    # a hybrid model's KV-cache groups (index.groups syntax; group 0 full attention), each
    # extra group ``group_blocks`` pages (0: l1_blocks); ``groups_aware`` False: a router
    # that drops the other groups' events (matching full attention alone)
    kv_groups: str = ""
    group_blocks: int = 0
    groups_aware: bool = True
    # engine i runs on worker_costs[i] where given (a mixed pool), else on ``costs``
    worker_costs: tuple[EngineCosts, ...] = ()
    # admission at the router (router.admission, sim.admission): requests wait at the
    # router while the engines are full; None: each is routed as it arrives
    admission: AdmissionSettings | None = None


class Simulation:
    """One policy over one trace. ``run()`` once; it returns the policy's report."""

    def __init__(
        self,
        trace: Trace,
        policy: str,
        config: SimConfig,
        *,
        policy_params: dict[str, Any] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        if config.workers < 1:
            raise ValueError("workers must be >= 1")
        self.trace = trace
        self.config = config
        self.costs = config.costs
        self.block_size = trace.block_size
        self.policy = make_policy(policy, random.Random(config.seed), **(policy_params or {}))
        self.progress = progress
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[object, ...]]] = []
        self._tick = itertools.count()
        self.index = PrefixIndex(clock=lambda: self.now / 1000.0)
        self.ingest = make_ingest(self.index, BlockHasher(trace.block_size))
        groups = parse_groups(config.kv_groups)
        if groups and groups[0].kind != "full":
            raise ValueError("kv_groups: group 0 of the simulated engines is full attention")
        if not 1 <= config.dp_size <= 64:
            raise ValueError("dp_size must be in [1, 64]")
        dp = config.dp_size
        # one engine per (worker, rank); ``targets``: what the router routes to
        self.ids = [
            target_id(f"w{i}", r if dp > 1 else None)
            for i in range(config.workers)
            for r in range(dp)
        ]
        n = len(self.ids)
        self.slot = {wid: i for i, wid in enumerate(self.ids)}
        self.engines = [
            BatchEngine(
                wid,
                PrefixCache(
                    trace.block_size,
                    config.l1_blocks,
                    config.l2_blocks,
                    seed=config.engine_seed,
                    groups=groups[1:],
                    group_blocks=config.group_blocks,
                ),
                config.worker_costs[i] if i < len(config.worker_costs) else self.costs,
                self,
                max_num_seqs=config.max_num_seqs,
            )
            for i, wid in enumerate(self.ids)
        ]
        self.targets = self.ids
        if dp > 1 and not config.dp_aware:
            self.targets = [f"w{i}" for i in range(config.workers)]
            for k, engine in enumerate(self.engines):
                engine.source, engine.dp_rank = self.targets[k // dp], k % dp
        self.target_engines = {
            t: [k for k, e in enumerate(self.engines) if e.source == t] for t in self.targets
        }
        self.strip_groups = bool(groups) and not config.groups_aware
        for t in self.targets:
            self.index.add_worker(t)
        # per routing target, as the router keeps them per worker (a DP worker whose
        # ranks it cannot tell apart has one queue of flights in the router's eyes)
        self.prefills = {t: RunningPrefills() for t in self.targets}
        # each engine's KV cache in tokens (vLLM's ``cache_config_info``, to admission)
        self.kv_tokens = [e.cache.gpu_blocks * e.cache.block_size for e in self.engines]
        # The router's own load counts per worker.
        self.inflight = [0] * n
        self.inflight_prefill = [0] * n
        self.prefilled = [0] * n  # prompt tokens whose first token came, so far
        self.decode_streams = [0] * n
        self.routed = [0] * n
        # Engine-reported load as last sampled: (running, waiting, kv usage).
        self.reported: list[tuple[int, int, float]] = [(0, 0, 0.0)] * n
        self.reported_waiting = [0] * n
        self.link_free = [0.0] * n  # when each target's prefetch link is next idle
        self.requests: list[SimRequest] = []
        self.route_us: list[float] = []
        self.done = 0
        self.num_rejected = 0
        self.counters: Counter[str] = Counter()
        if config.admission is not None and config.prefill_workers:
            raise ValueError("admission is simulated for pools of mixed engines only")
        self.admission: SimAdmission | None = None
        if config.admission is not None:
            self.admission = SimAdmission(self, config.admission)

    @property
    def num_shed(self) -> int:
        """Requests admission at the router turned away (none without it)."""
        return 0 if self.admission is None else self.admission.shed

    # -- clock ------------------------------------------------------------------------
    def at(self, time_ms: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._heap, (time_ms, next(self._tick), fn, args))

    def run(self) -> PolicyReport:
        wall = time.perf_counter()
        for i, tr in enumerate(self.trace.requests):
            self.at(tr.arrival_ms, self._arrive, i)
        self.at(0.0, self._sample)
        heap = self._heap
        pop = heapq.heappop
        while heap:
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
        if self.done != len(self.trace.requests):
            raise RuntimeError(f"{self.done} of {len(self.trace.requests)} requests finished")
        return self.report(time.perf_counter() - wall)

    def report(self, wall_s: float) -> PolicyReport:
        return summarize(self, wall_s)

    # -- router side --------------------------------------------------------------------
    def _views(self, hashes: list[int]) -> list[WorkerView]:
        """One view per routing target, as ``router.routing.decide.Router.views`` builds them."""
        matches = self.index.match_tiers(hashes)
        groups = self.ingest.group_specs()
        if groups is not None and matches:
            matches = clip_matches(matches, hashes, groups, self.index.holds, self.block_size)
        in_sync = self.ingest.in_sync
        views = []
        for t in self.targets:
            ks = self.target_engines[t]
            reported = [self.reported[k] for k in ks]
            views.append(
                WorkerView.of(
                    t,
                    matches.get(t, NO_MATCH),
                    in_sync=in_sync(t),
                    inflight_requests=sum(self.inflight[k] for k in ks),
                    inflight_prefill_tokens=sum(self.inflight_prefill[k] for k in ks),
                    decode_streams=sum(self.decode_streams[k] for k in ks),
                    engine_running=sum(r[0] for r in reported),
                    engine_waiting=sum(r[1] for r in reported),
                    kv_usage=max(r[2] for r in reported),
                    running_prefill=self.prefills[t].oldest(self.now),
                    capacity_blocks=sum(
                        self.engines[k].cache.gpu_blocks + self.engines[k].cache.host_blocks
                        for k in ks
                    ),
                )
            )
        return views

    def _engine_for(self, target: str) -> int:
        """The engine a target's request runs on: its own, or the least loaded rank of a
        worker whose ranks the router cannot tell apart (vLLM's internal balancer)."""
        ks = self.target_engines[target]
        if len(ks) == 1:
            return ks[0]
        return min(ks, key=lambda k: (self.engines[k].running + self.engines[k].num_waiting, k))

    def _arrive(self, i: int) -> None:
        req = SimRequest.arrival(self.trace, i, self.block_size)
        self.requests.append(req)
        if self.admission is not None:
            self.admission.arrive(req)  # routed now, later (``route``) or shed
        else:
            self.route(req)

    def route(self, req: SimRequest, allowed: frozenset[str] | None = None) -> str:
        """Route and submit ``req`` among the targets ``allowed`` (None: all); its target."""
        route = req.route
        hashes = route.block_hashes
        start = time.perf_counter()
        views = self._views(hashes)
        if allowed is not None:
            views = [v for v in views if v.worker_id in allowed]
        decision = self.policy.select(route, views)
        self.route_us.append((time.perf_counter() - start) * 1e6)
        w = self._engine_for(decision.worker_id)
        req.worker = w
        chosen = next(v for v in views if v.worker_id == decision.worker_id)
        req.est_prefill = uncached_tokens(
            req.input_len, expected_hit_blocks(decision, chosen), self.block_size
        )
        cacheable = cacheable_blocks(req.input_len, self.block_size)
        req.promised_blocks = min(chosen.match.total, cacheable)
        req.best_hit_blocks = min(max(v.match.total for v in views), cacheable)
        self.inflight[w] += 1
        self.inflight_prefill[w] += req.est_prefill
        if req.est_prefill > 0:
            self.prefills[decision.worker_id].add(req, req.est_prefill, self.now)
        self.routed[w] += 1
        if self.config.predict_ttl_ms > 0:
            self.index.predict(decision.worker_id, hashes, self.config.predict_ttl_ms / 1000.0)
        if decision.prefetch is not None:
            req.hint_deadline_ms = decision.prefetch.deadline_ms
            self._prefetch(req, decision.prefetch)
        self.engines[w].submit(req, self.now)
        return decision.worker_id

    def _sample(self) -> None:
        self.reported = [(e.running, e.num_waiting, e.cache.usage) for e in self.engines]
        # admission reads waiting as vLLM reports it (the policies' views keep the count
        # they were tuned on, arrivals during a step included)
        self.reported_waiting = [e.reported_waiting for e in self.engines]
        if self.admission is not None:
            self.admission.sample()
        if self.done < len(self.trace.requests):
            self.at(self.now + self.config.load_interval_ms, self._sample)

    # -- prefetch -----------------------------------------------------------------------
    def _prefetch(self, req: SimRequest, hint: PrefetchHint) -> None:
        self.counters["prefetch_hints"] += 1
        if hint.source_worker is None or hint.source_worker not in self.slot:
            self.counters["prefetch_no_source"] += 1  # no shared pool in this simulation
            return
        source = self.engines[self.slot[hint.source_worker]]
        wanted = req.route.block_hashes[: hint.blocks]
        # the simulated engines hash to ints (sim/cache.py), never to bytes
        hashes = cast("list[int]", self.ingest.engine_hashes(hint.source_worker, wanted))
        gpu, host = source.cache.lookup(hashes)
        n = gpu + host
        if n == 0:
            self.counters["prefetch_source_lost"] += 1
            return
        t = self.slot[hint.target_worker]
        # Only what the target lacks crosses the link, as the policy budgets it.
        have = sum(self.engines[t].cache.lookup(hashes[:n]))
        if have >= n:
            self.counters["prefetch_already_held"] += 1
            return
        begin = max(self.now, self.link_free[t])
        end = begin + self.costs.prefetch_ms((n - have) * self.block_size)
        self.link_free[t] = end
        self.counters["prefetch_blocks_sent"] += n - have
        self.at(end, self._prefetch_done, t, req, req.tokens, hashes[:n])

    def _prefetch_done(
        self, t: int, req: SimRequest, tokens: array[int], hashes: list[int]
    ) -> None:
        engine = self.engines[t]
        placed = engine.cache.prefetch(tokens, block_hashes=hashes, max_blocks=len(hashes))
        self.counters["prefetch_blocks"] += placed
        if req.admit_ms >= 0:
            self.counters["prefetch_late"] += 1
        engine.publish_now(self.now)

    # -- engine hooks ---------------------------------------------------------------------
    def first_token(self, req: SimRequest, now: float) -> None:
        req.first_token_ms = now
        w = req.worker
        self.inflight_prefill[w] -= req.est_prefill
        self.prefilled[w] += req.est_prefill
        self.prefills[self.engines[w].source].remove(req, now)
        self.decode_streams[w] += 1
        self.policy.on_first_token(req.route, self.engines[w].source, now - req.arrival_ms)

    def finished(self, req: SimRequest, now: float) -> None:
        req.finish_ms = now
        w = req.worker
        self.inflight[w] -= 1
        self.decode_streams[w] -= 1
        self._close(req)

    def rejected(self, req: SimRequest, now: float) -> None:
        req.finish_ms = now
        w = req.worker
        self.inflight[w] -= 1
        self.inflight_prefill[w] -= req.est_prefill
        self.prefills[self.engines[w].source].remove(req, now)
        self.num_rejected += 1
        self._close(req)

    def _close(self, req: SimRequest) -> None:
        self.policy.on_finish(req.route, self.engines[req.worker].source)
        if self.admission is not None:
            self.admission.ended(req)
        req.tokens = None  # type: ignore[assignment]  # free the prompt; metrics stay
        self.done += 1
        if self.progress is not None:
            self.progress(self.done)

    def publish(self, engine: BatchEngine, events: list[Event], now: float) -> None:
        if getattr(self, "strip_groups", False):  # a router blind to the other groups
            events = [e for e in events if not getattr(e, "group_idx", None)]
        payload = encode(EventBatch(ts=now / 1000.0, events=events))
        seq = engine.seq
        engine.seq += 1
        self.counters["event_batches"] += 1
        lag = now + self.config.event_lag_ms
        self.at(lag, self._deliver, engine.source, seq, payload, engine.dp_rank)

    def _deliver(
        self, worker_id: str, seq: int, payload: bytes, dp_rank: int | None = None
    ) -> None:
        result = self.ingest.apply(worker_id, seq, payload, dp_rank=dp_rank)
        if result.status is not SeqStatus.OK:
            self.counters[f"ingest_{result.status.value}"] += 1
        for name, count in result.errors.items():
            self.counters[f"ingest_error_{name}"] += count
