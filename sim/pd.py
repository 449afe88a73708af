"""The trace-replay simulator for disaggregated pools: prefill engines, decode engines and
the KV transfer between them, on the same clock, index, codec and policies as
``sim.simulator`` (the mixed pool's simulator, whose machinery this reuses).

Per request, ``policies.pd.choose`` (the router's code) picks the decode engine and, past
the local-prefill threshold, a prefill engine. Then, as vLLM's KV-connector flow does:

1. the prefill engine runs the prompt with ``max_tokens`` 1 (its queue, its prefix hits:
   the prefill side's hit rate);
2. the KV of the blocks the decode engine lacks crosses its link at
   ``EngineCosts.prefetch_gbps`` (one transfer at a time per decode engine: its NIC);
3. the blocks land in the decode engine's cache (its KV events say so, and the index
   learns the decode side's prefixes from them), and the decode engine admits the request:
   every full block is a hit, the tail is computed, then it decodes ``output_len`` tokens.

TTFT is the client's: arrival to the decode engine's first token (prefill queue + prefill
+ transfer + the decode engine's admission and first step). TPOT is the decode engine's
time per output token after the first. A rule is ``PREFILL+DECODE`` (policy names; the
decode side also takes ``decode_load``), or one of the named rules in ``PD_RULES``.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from index.backend import make_ingest
from index.hashing import BlockHasher, cacheable_blocks
from index.prefix_index import PrefixIndex
from policies import WorkerView, make_prefill_policy
from policies.base import NO_MATCH
from policies.cost_model import uncached_tokens
from policies.pd import DECODE_POLICIES, PdDecision, choose, make_decode_policy
from policies.registry import known_policies
from router.workers.load import RunningPrefills
from sim.batch_engine import BatchEngine
from sim.cache import PrefixCache
from sim.report import PolicyReport
from sim.request import SimRequest
from sim.simulator import SimConfig, Simulation
from sim.traces import Trace

# The rules compared in BENCHMARKS.md: this router's (cache-aware prefill, load-aware
# decode), the cache-blind baseline, SGLang's gateway in PD mode as its docs run it
# (``--prefill-policy cache_aware --decode-policy power_of_two``) and Dynamo's (its KV
# router on both sides: prefill router, then the KV-aware decode router).
PD_RULES: dict[str, str] = {
    "cache_router": "cache_aware+decode_load",
    "round_robin": "round_robin+round_robin",
    "sglang_pd": "sglang_cache_aware+power_of_two",
    "dynamo_pd": "dynamo_kv+dynamo_kv",
}


def parse_rule(rule: str) -> tuple[str, str]:
    """``(prefill policy, decode policy)`` of a rule; ValueError naming what is unknown."""
    spec = PD_RULES.get(rule, rule)
    prefill, plus, decode = spec.partition("+")
    if not plus or prefill not in known_policies() or decode not in DECODE_POLICIES:
        raise ValueError(
            f"PD rule {rule!r}: expected PREFILL+DECODE (prefill: {', '.join(known_policies())}; "
            f"decode: {', '.join(DECODE_POLICIES)}) or one of {', '.join(PD_RULES)}"
        )
    return prefill, decode


class PdSimulation(Simulation):
    """One PD rule over one trace: ``config.prefill_workers`` prefill engines and
    ``config.workers`` decode engines. ``run()`` once; it returns the rule's report."""

    def __init__(
        self,
        trace: Trace,
        rule: str,
        config: SimConfig,
        *,
        policy_params: dict[str, Any] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        if config.workers < 1 or config.prefill_workers < 1:
            raise ValueError("a PD pool needs >= 1 prefill and >= 1 decode engine")
        prefill, decode = parse_rule(rule)
        self.rule = rule
        self.trace = trace
        self.config = config
        self.costs = config.costs
        self.block_size = trace.block_size
        self.policy = make_prefill_policy(
            prefill, random.Random(config.seed), **(policy_params or {})
        )
        self.decode_policy = make_decode_policy(decode, random.Random(config.seed + 1))
        self.progress = progress
        self.now = 0.0
        self._heap = []
        self._tick = itertools.count()
        self.index = PrefixIndex(clock=lambda: self.now / 1000.0)
        self.ingest = make_ingest(self.index, BlockHasher(trace.block_size))
        n_p, n_d = config.prefill_workers, config.workers
        self.ids = [f"p{i}" for i in range(n_p)] + [f"d{i}" for i in range(n_d)]
        self.slot = {wid: i for i, wid in enumerate(self.ids)}
        self.prefill_slots = list(range(n_p))
        self.decode_slots = list(range(n_p, n_p + n_d))
        self.engines = [
            BatchEngine(
                wid,
                PrefixCache(
                    trace.block_size, config.l1_blocks, config.l2_blocks, seed=config.engine_seed
                ),
                self.costs,
                self,
                max_num_seqs=config.max_num_seqs,
            )
            for wid in self.ids
        ]
        for wid in self.ids:
            self.index.add_worker(wid)
        n = len(self.ids)
        self.inflight = [0] * n
        self.inflight_prefill = [0] * n
        self.prefills = {wid: RunningPrefills() for wid in self.ids}
        self.decode_streams = [0] * n
        self.routed = [0] * n
        self.reported: list[tuple[int, int, float]] = [(0, 0, 0.0)] * n
        self.link_free = [0.0] * n
        self.requests: list[SimRequest] = []
        self.route_us: list[float] = []
        self.done = 0
        self.num_rejected = 0
        self.counters: Counter[str] = Counter()
        if config.admission is not None:
            raise ValueError("admission is simulated for pools of mixed engines only")
        self.admission = None  # the mixed pool's hooks (sim.simulator) find it off
        # the prefill leg of each remote request: its SimRequest, and when the leg and
        # the transfer ended (per trace index)
        self.prefill_leg: dict[int, SimRequest] = {}
        self.client_of: dict[int, SimRequest] = {}  # id(prefill leg) -> the client request
        self.prefilled_ms: dict[int, float] = {}
        self.landed_ms: dict[int, float] = {}

    # -- router side --------------------------------------------------------------------
    def _side(self, slots: list[int], matches: dict[str, Any]) -> list[WorkerView]:
        in_sync = self.ingest.in_sync
        views = []
        for i in slots:
            wid = self.ids[i]
            running, waiting, usage = self.reported[i]
            views.append(
                WorkerView.of(
                    wid,
                    matches.get(wid, NO_MATCH),
                    in_sync=in_sync(wid),
                    inflight_requests=self.inflight[i],
                    inflight_prefill_tokens=self.inflight_prefill[i],
                    decode_streams=self.decode_streams[i],
                    engine_running=running,
                    engine_waiting=waiting,
                    kv_usage=usage,
                    running_prefill=self.prefills[wid].oldest(self.now),
                )
            )
        return views

    def _arrive(self, i: int) -> None:
        req = SimRequest.arrival(self.trace, i, self.block_size)
        route = req.route
        hashes = route.block_hashes
        self.requests.append(req)
        start = time.perf_counter()
        matches = self.index.match_tiers(hashes)
        prefill_views = self._side(self.prefill_slots, matches)
        decode_views = self._side(self.decode_slots, matches)
        pd = choose(
            route,
            prefill_views,
            decode_views,
            self.policy,
            self.decode_policy,
            self.config.local_prefill_tokens,
        )
        self.route_us.append((time.perf_counter() - start) * 1e6)
        d = self.slot[pd.decode.worker_id]
        req.worker = d
        self.routed[d] += 1
        best = max(v.match.total for v in (*prefill_views, *decode_views))
        req.best_hit_blocks = min(best, cacheable_blocks(req.input_len, self.block_size))
        if pd.prefill is None:
            self.counters["local_prefill"] += 1
            held = _held(decode_views, d, self)
            self._send_decode(req, uncached_tokens(req.input_len, held, self.block_size))
            return
        self._send_prefill(req, pd, prefill_views)

    def _send_prefill(self, req: SimRequest, pd: PdDecision, views: list[WorkerView]) -> None:
        assert pd.prefill is not None
        p = self.slot[pd.prefill.worker_id]
        leg = SimRequest(
            req.idx, req.arrival_ms, req.input_len, 1, req.tokens, req.engine_hashes, req.route
        )
        leg.worker = p
        leg.est_prefill = uncached_tokens(req.input_len, _held(views, p, self), self.block_size)
        self.prefill_leg[req.idx] = leg
        self.client_of[id(leg)] = req
        self.inflight[p] += 1
        self.inflight_prefill[p] += leg.est_prefill
        self.prefills[self.ids[p]].add(leg, leg.est_prefill, self.now)
        self.routed[p] += 1
        ttl = self.config.predict_ttl_ms / 1000.0
        if ttl > 0:  # the router's predict-on-route (``--predict-ttl-ms``), as sim.simulator
            self.index.predict(pd.prefill.worker_id, req.route.block_hashes, ttl)
        if pd.prefill.prefetch is not None:
            leg.hint_deadline_ms = pd.prefill.prefetch.deadline_ms
            self._prefetch(leg, pd.prefill.prefetch)
        self.engines[p].submit(leg, self.now)

    def _send_decode(self, req: SimRequest, prefill_tokens: int) -> None:
        d = req.worker
        req.est_prefill = prefill_tokens
        self.inflight[d] += 1
        self.inflight_prefill[d] += prefill_tokens
        if prefill_tokens > 0:
            self.prefills[self.ids[d]].add(req, prefill_tokens, self.now)
        self.engines[d].submit(req, self.now)

    # -- the transfer ---------------------------------------------------------------------
    def _transfer(self, req: SimRequest) -> None:
        """The prefill leg is done: the decode engine pulls the blocks it lacks."""
        self.prefilled_ms[req.idx] = self.now
        d = req.worker
        cache = self.engines[d].cache
        full = req.input_len // self.block_size
        hashes = req.engine_hashes[:full].tolist()
        held = sum(cache.lookup(hashes))
        blocks = max(0, full - held)
        self.counters["transfer_blocks"] += blocks
        begin = max(self.now, self.link_free[d])
        end = begin + self.costs.prefetch_ms(blocks * self.block_size)
        self.link_free[d] = end
        # the router sends the decode request at once; the engine waits for the blocks
        self.inflight[d] += 1
        self.at(end, self._landed, req, hashes)

    def _landed(self, req: SimRequest, hashes: list[int]) -> None:
        self.landed_ms[req.idx] = self.now
        engine = self.engines[req.worker]
        engine.cache.prefetch(req.tokens, block_hashes=hashes, max_blocks=len(hashes))
        engine.publish_now(self.now)
        self.inflight[req.worker] -= 1  # _send_decode counts it again
        self._send_decode(req, 0)

    # -- engine hooks ---------------------------------------------------------------------
    def first_token(self, req: SimRequest, now: float) -> None:
        req.first_token_ms = now
        w = req.worker
        self.inflight_prefill[w] -= req.est_prefill
        self.prefills[self.ids[w]].remove(req, now)
        self.decode_streams[w] += 1

    def finished(self, req: SimRequest, now: float) -> None:
        req.finish_ms = now
        w = req.worker
        self.inflight[w] -= 1
        self.decode_streams[w] -= 1
        client = self.client_of.pop(id(req), None)
        if client is not None:  # the prefill leg
            self.policy.on_finish(req.route, self.ids[w])
            self._transfer(client)
            return
        self._close(req)

    def rejected(self, req: SimRequest, now: float) -> None:
        w = req.worker
        self.inflight[w] -= 1
        self.inflight_prefill[w] -= req.est_prefill
        self.prefills[self.ids[w]].remove(req, now)
        client = self.client_of.pop(id(req), None)
        if client is not None:  # the prefill engine cannot hold it: decode prefills it
            self.policy.on_finish(req.route, self.ids[w])
            self.prefill_leg.pop(client.idx, None)
            self.counters["prefill_rejected"] += 1
            self._send_decode(client, uncached_tokens(client.input_len, 0, self.block_size))
            return
        req.finish_ms = now
        self.num_rejected += 1
        self._close(req)

    def _close(self, req: SimRequest) -> None:
        self.decode_policy.on_finish(req.route, self.ids[req.worker])
        req.tokens = None  # type: ignore[assignment]
        self.done += 1
        if self.progress is not None:
            self.progress(self.done)

    def report(self, wall_s: float) -> PolicyReport:
        return summarize_pd(self, wall_s)


def _held(views: list[WorkerView], slot: int, sim: PdSimulation) -> int:
    wid = sim.ids[slot]
    return next((v.match.total for v in views if v.worker_id == wid), 0)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarize_pd(sim: PdSimulation, wall_s: float) -> PolicyReport:
    """The rule's numbers: the prefill side's hit rate and TTFT, the decode side's TPOT."""
    bs = sim.block_size
    served = [r for r in sim.requests if r.first_token_ms >= 0]
    tokens_in = sum(r.input_len for r in served) or 1
    hit = 0
    queue, transfer, tpot = [], [], []
    for r in served:
        leg = sim.prefill_leg.get(r.idx)
        computed_on = leg if leg is not None else r
        hit += (computed_on.hit_gpu_blocks + computed_on.hit_host_blocks) * bs
        queue.append(computed_on.admit_ms - r.arrival_ms)
        if leg is not None:
            transfer.append(sim.landed_ms[r.idx] - sim.prefilled_ms[r.idx])
        if r.output_len > 1 and r.finish_ms >= r.first_token_ms:
            tpot.append((r.finish_ms - r.first_token_ms) / (r.output_len - 1))
    ttft = [r.first_token_ms - r.arrival_ms for r in served] or [0.0]
    start = min(r.arrival_ms for r in sim.requests)
    span_s = max(max(r.finish_ms for r in sim.requests) - start, 1e-9) / 1000.0
    prefill = [sim.engines[i] for i in sim.prefill_slots]
    decode = [sim.engines[i] for i in sim.decode_slots]

    def ratio(values: list[float]) -> float:
        mean = sum(values) / len(values)
        return max(values) / mean if mean else 1.0

    route = sim.route_us or [0.0]
    return {
        "policy": sim.rule,
        "prefill_policy": sim.policy.name,
        "decode_policy": sim.decode_policy.name,
        "requests": len(sim.requests),
        "rejected": sim.num_rejected,
        "hit_rate": hit / tokens_in,
        "hit_rate_best_worker": sum(r.best_hit_blocks for r in served) * bs / tokens_in,
        "ttft_mean_ms": float(np.mean(ttft)),
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p90_ms": _pct(ttft, 90),
        "ttft_p99_ms": _pct(ttft, 99),
        "tpot_mean_ms": float(np.mean(tpot)) if tpot else 0.0,
        "tpot_p50_ms": _pct(tpot, 50),
        "tpot_p90_ms": _pct(tpot, 90),
        "tpot_p99_ms": _pct(tpot, 99),
        "prefill_queue_mean_ms": float(np.mean(queue)) if queue else 0.0,
        "prefill_queue_p90_ms": _pct(queue, 90),
        "transfer_mean_ms": float(np.mean(transfer)) if transfer else 0.0,
        "transfer_blocks": sim.counters["transfer_blocks"],
        "local_prefill_share": sim.counters["local_prefill"] / len(sim.requests),
        "prefill_rejected": sim.counters["prefill_rejected"],
        "prefill_load_max_over_mean": ratio([e.prefill_tokens for e in prefill]),
        "decode_requests_max_over_mean": ratio([sim.routed[i] for i in sim.decode_slots]),
        "decode_busy_max": max(e.busy_ms for e in decode) / 1000.0 / span_s,
        "prefill_busy_max": max(e.busy_ms for e in prefill) / 1000.0 / span_s,
        "prefetch_hints": sim.counters["prefetch_hints"],
        "prefetch_blocks": sim.counters["prefetch_blocks"],  # landed where a hint sent them
        "throughput_rps": len(served) / span_s,
        "route_us_mean": float(np.mean(route)),
        "route_us_p99": _pct(route, 99),
        "sim_duration_s": span_s,
        "wall_s": wall_s,
    }
