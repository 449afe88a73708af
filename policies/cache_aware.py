"""``cache_aware``: send each request where its estimated time to first token is lowest.

Per healthy worker, in prefill-token time (``cost_model``; the simulator's engines run on
the same constants)::

    ttft = queue wait (prompt tokens ahead of it, and their attention; the engine's
           reported queue; decode steps of the requests in flight there)
         + prefill of the uncached tokens + load time of the hits below GPU
    cost = ttft + the pool's charge for recomputing what the best holder has

Affinity and balance are one trade-off in one unit: a hit saves its tokens' prefill, a
queue costs its tokens' prefill. The recompute charge (``recompute_weight``, raised by the
holder's share of the prompt, ``recompute_share``) is the pool's side: a copy is computed
once more and evicts other prefixes. For a session's request (sessions long: its later
turns follow it) it fades with the best holder's queue beyond the pool's mean (``fade``)
and is gone once that excess reaches the prefill the hit saves:
while the holder is no busier than the pool, a copy only costs the pool; once it is the
bottleneck, a hit is worth its saved prefill against the extra queueing delay and no
more. Without the fade, at weight ``8 * (1 + 4 * share)``, ~37 for a chat session
whose context is 90 % of its prompt, a session left its holder only once that queue
was ~37x what its hit saved, and on chat with turns 0.1-1 s apart sessions piled up
behind it (issue 31; the numbers are in ``docs/history/cache_aware.md``).

What the index shows is corrected by what the router knows: a prompt routed and not
finished holds its prefix on its worker, whatever its key (``in_flight``: the index
learns of it only once computed); a prompt that holds what an earlier one added is that
conversation's next turn, whatever its key (``_lookup``: aiperf's one-message turns get a
new derived key each); a worker out of sync has no hit;
a leading block in nearly every client's prompt (BOS, a chat template's header) is held
by every worker, so it breaks no tie (``_common``, issue 35). New sessions start only
where their load stays bounded (``session_load``, ``live_sessions``; from the first
continued session, before any has ended: ``young_bound``), spared by what barring a holder
costs (``replica_slack``), and where the cache can keep the live sessions' histories to
their ends (``fit_cache``, ``WorkerView.capacity_blocks``); cold prefixes may be placed
as SGLang does (``place_slack_ms``). A prefetch hint moves a prefix to a queued worker
only where the transfer lands before admission and pays after its risk and the memory it
takes (``prefetch_fraction``, ``landing_rate``, ``copy_weight``). Ties (``tie_ms``) break at
random. Why each part exists, what it measured and the commit that set each default:
``docs/history/cache_aware.md``.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

from index.hashing import cacheable_blocks
from index.prefix_index import TierMatch

from .base import (
    MAX_ENGINE_COUNT,
    NO_MATCH,
    Decision,
    HintTier,
    Policy,
    PrefetchHint,
    RouteRequest,
    WorkerView,
    prefix_depth,
)
from .cost_model import (
    EngineCosts,
    admit_wait_ms,
    computed_tokens,
    estimate_ttft_prefetched,
    prefetch_fits,
    uncached_tokens,
)
from .selection import argmin_random, healthy

_T = TypeVar("_T")
# what the prompts routed before tell of a request (``CacheAware._lookup``): per worker
# the blocks arriving there, the session it continues, the leading blocks seen before
_Lookup = tuple[dict[str, int] | None, str | None, int]
_MAX_TRACKED = 65_536  # requests (and hinted sessions) remembered at most
# Prompts remembered to find a turn's predecessor by (``_lookup``; ~12 hashes each): at
# 1,000 requests/s, 16 s of them, longer than the think times of chat and agents
_PROMPTS = 16_384
_GPU_COPY_FACTOR = 2.0  # issue 13's collapse: GPU-landed copies evicted other sessions
_KV_ROOM = 0.9  # a target fuller than this has no pages to spare for a copy
_LANDING_PRIOR = 0.8  # optimistic: a hint that never goes out teaches nothing
_LANDING_ALPHA = 0.05  # ~20 hints of memory
_INF = float("inf")
_SPEED_ALPHA = 0.02  # ~50 first tokens of memory per worker
_SPEED_MIN_SAMPLES = 16  # before that, trust ``costs``
_SPEED_RANGE = (0.25, 4.0)
# A worker's own factor counts only beyond this ratio to the pool's: per-worker ratios
# of 0.95-1.11 (noise, equal engines) cost 5 hit points on the Mooncake synthetic trace
# when applied; engines 3x slower than their peers measure 1.9x the pool's ratio.
_SPEED_DEADBAND = 1.3
_WINDOW = 512  # routed requests over which a worker's share of sessions' traffic counts
# Requests per session (over the window) from which a first placement is worth bounding:
# Mooncake's derived sessions average 1.1-1.3 (a bound only costs hits there: -0.2 pt on
# the synthetic trace), chat 6.7, agent 22.
_BOUND_TURNS = 2.0
# A session is live while its last request is fewer than this many mean gaps (decisions
# between a session's requests) ago; agent steps' gaps spread 0.5-5 s (1.8x their mean).
_LIVE_GAPS = 3.0
_GAP_ALPHA = 0.02
# A leading block in the prompts of this share of the last ``_COMMON_WINDOW`` clients
# (sessions, else requests), once ``_COMMON_MIN`` were seen, is common: BOS and the chat
# template's header are in every prompt, and every worker holds them after its first
# request, so holding them is no affinity (issue 35: 40 of 40 requests on one engine at
# 1 request/s). Only the first ``_COMMON_DEPTH`` blocks are counted (per-request cost).
_COMMON_WINDOW = 64
_COMMON_MIN = 8
_COMMON_SHARE = 0.9
_COMMON_DEPTH = 32


class CacheAware(Policy):
    """Minimum estimated TTFT (plus the pool's recompute cost), with prefetch hints."""

    name = "cache_aware"
    prefill_params = {
        "recompute_weight": 6.0,
        "recompute_share": 4.0,
        "place_slack_ms": 500.0,
        "replica_slack": False,
        "running_discount": True,
        # unmeasured on a prefill pool (issue 15's tables are unfaded): kept as it was
        "fade": False,
        # with the unfaded charge, a burst of new sessions stayed behind the first holder
        # of their system prompt in flight (``tests/test_pd_sim.py``, ``_lookup``)
        "shared_in_flight": False,
    }

    def __init__(
        self,
        rng: random.Random | None = None,
        *,
        costs: EngineCosts | Mapping[str, Any] | None = None,
        prefetch: bool = True,
        prefetch_fraction: float = 0.5,
        recompute_weight: float = 8.0,
        recompute_share: float = 4.0,
        copy_weight: float = 0.5,
        session_load: float = 1.25,
        live_sessions: bool = True,
        learn_speed: bool = False,
        in_flight: bool = True,
        shared_in_flight: bool = True,
        tie_ms: float = 0.25,
        place_slack_ms: float | None = None,
        replica_slack: bool = True,
        running_discount: bool = False,
        fade: bool = True,
        common: bool = True,
        live_whole: bool = True,
        ended_turns: bool = True,
        fit_cache: bool = True,
        young_bound: bool = True,
        cadence: bool = False,
        fit_cost: bool = False,
    ) -> None:
        super().__init__(rng)
        if not 0 < prefetch_fraction <= 1:
            raise ValueError(
                f"cache_aware: prefetch_fraction must be in (0, 1], got {prefetch_fraction}"
            )
        if not recompute_weight >= 0:
            raise ValueError(f"cache_aware: recompute_weight must be >= 0, got {recompute_weight}")
        if not 0 <= recompute_share <= 64:
            raise ValueError(
                f"cache_aware: recompute_share must be in [0, 64], got {recompute_share}"
            )
        if not tie_ms >= 0:
            raise ValueError(f"cache_aware: tie_ms must be >= 0, got {tie_ms}")
        if not copy_weight >= 0:
            raise ValueError(f"cache_aware: copy_weight must be >= 0, got {copy_weight}")
        if place_slack_ms is not None and not place_slack_ms >= 0:
            raise ValueError(f"cache_aware: place_slack_ms must be >= 0, got {place_slack_ms}")
        if not session_load >= 1:
            raise ValueError(f"cache_aware: session_load must be >= 1, got {session_load}")
        self.costs = EngineCosts.from_config(costs)
        self.prefetch = bool(prefetch)
        self.prefetch_fraction = prefetch_fraction
        self.recompute_weight = recompute_weight
        self.recompute_share = recompute_share
        self.copy_weight = copy_weight
        self.session_load = session_load
        self.live_sessions = bool(live_sessions)
        self.learn_speed = bool(learn_speed)
        self.in_flight = bool(in_flight)
        self.shared_in_flight = bool(shared_in_flight)
        self.tie_ms = tie_ms
        self.place_slack_ms = place_slack_ms
        self.replica_slack = bool(replica_slack)
        self.running_discount = bool(running_discount)
        self.fade = bool(fade)
        self.common = bool(common)
        self.live_whole = bool(live_whole)
        self.ended_turns = bool(ended_turns)
        self.fit_cache = bool(fit_cache)
        self.young_bound = bool(young_bound)
        self.cadence = bool(cadence)
        self.fit_cost = bool(fit_cost)
        self._cadence: OrderedDict[str, int] = OrderedDict()  # session -> its last gap
        self._ended = False  # a session was seen to end (``_young``)
        # Blocks each worker computed for the requests this policy routed (new content in
        # its cache): a cold prefix goes where the least was placed (``_place``).
        self._placed: OrderedDict[str, float] = OrderedDict()
        # Context tokens of the requests this policy routed and that are not finished, per
        # worker: decode attention reads their KV every step (``decode_ms_per_kv_token``).
        self._active: dict[str, int] = {}
        # request id -> (worker, context tokens, estimated TTFT ms)
        self._routed: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        # Attention time of the prefill routed per worker and not past its first token, and
        # per request: (worker, ms). The queue's prompts pay it over their own contexts.
        self._queued_attn: dict[str, float] = {}
        self._queued: OrderedDict[str, tuple[str, float]] = OrderedDict()
        # worker -> [observed TTFT moving sum, estimated moving sum, samples]; the factor
        self._observed: dict[str, list[float]] = {}
        self.speed: dict[str, float] = {}
        # Workers seen holding blocks in host memory: a prefetch has a tier to land in.
        self._host_tier: set[str] = set()
        # Hints by session: (target, blocks); the session's next request shows if it landed.
        self._hinted: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self.landing_rate = _LANDING_PRIOR
        # The last _WINDOW routing decisions and their count per worker; sessions seen.
        self._recent: deque[tuple[str, bool]] = deque()
        self._recent_count: dict[str, int] = {}
        self._recent_new = 0  # first requests of sessions among them
        # session -> (worker of its last request, decision number, its prompt tokens, the
        # tokens of them its first request shared with earlier prompts), most recent last
        self._sessions: OrderedDict[str, tuple[str | None, int, int, int]] = OrderedDict()
        self._growth: float | None = None  # prompt tokens a session's request adds, mean
        # this decision's live sessions per worker, their sum, their own tokens per worker
        self._live: tuple[dict[str, int], int, dict[str, int]] | None = None
        self._decisions = 0
        self._gap: float | None = None  # decisions between a session's requests, moving mean
        # The last _PROMPTS prompts routed, found by anchors (``_anchor_positions``): block
        # hash -> the latest request anchored there; request id -> (its anchors' hashes,
        # its blocks, the session a prompt that builds on it continues, its first block
        # that no earlier prompt nor cache had, -1: none)
        self._latest: dict[int, str] = {}
        self._prompts: OrderedDict[str, tuple[list[int], int, str, int]] = OrderedDict()
        # Those not finished: request id -> (worker, blocks); session -> its last prompt;
        # with ``shared_in_flight``, block hash -> {worker: requests} and those anchored
        # there, in routing order
        self._pending: dict[str, tuple[str, Sequence[int]]] = {}
        self._last: OrderedDict[str, str] = OrderedDict()
        self._anchors: dict[int, dict[str, int]] = {}
        self._anchored: dict[int, dict[str, None]] = {}
        self._session: str | None = None  # the request's session (``_lookup``)
        self._known = 0  # leading blocks of the request an earlier prompt had (``_lookup``)
        # ``must_see``'s lookup, kept for the ``select`` of the same request that follows
        self._looked: tuple[RouteRequest, _Lookup] | None = None
        # The leading blocks of the last _COMMON_WINDOW clients' prompts, and how many of
        # them each block hash leads (``_common_depth``)
        self._leads: OrderedDict[str, list[int]] = OrderedDict()
        self._lead_count: dict[int, int] = {}

    def prunable(self, request: RouteRequest) -> bool:
        # pool-wide terms read every worker: the fade's mean queue and the session bound
        # (a long-session pool's session requests), placement's blocks placed per worker
        return self.place_slack_ms is None and not (request.session_key and self._long_sessions())

    def must_see(self, request: RouteRequest) -> Collection[str]:
        # where its prefix is arriving (prompts in flight, ``_lookup``; no index holds it
        # yet, so the pruner would not keep those workers) and its session's hinted target
        arriving = None
        if self._latest:
            found = self._lookup(request)
            self._looked = (request, found)
            arriving = found[0]
        named = [w for w, d in arriving.items() if d > 0] if arriving else []
        hint = self._hinted.get(request.session_key) if request.session_key else None
        return [*named, hint[0]] if hint else named

    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        cands = healthy(workers)
        looked, self._looked = self._looked, None
        if looked is not None and looked[0] is request:
            found = looked[1]
        else:
            found = self._lookup(request) if self._latest else (None, None, 0)
        arriving, session, self._known = found
        continues = session is not None  # it builds on an earlier prompt: not a first turn
        self._session = session = session or request.session_key
        if self._hinted and session is not None:
            self._learn_landing(session, cands)
        est = self._estimate(request, cands, arriving)
        per_block = self._charge_recompute(request, est)
        barred = self._barred(session, cands, request.num_tokens, continues)
        if barred and self.replica_slack:
            self._spare_holders(barred, cands, est.matches, request.block_size)
        if barred is not None and self.fit_cache and self._long_sessions():
            self._bar_full(barred, cands, request, est)
        if barred:
            for i in barred:
                est.ranked[i] = _INF
        options = self._prefetch_pass(request, cands, est, per_block, barred)
        i = self._choose(request, cands, est)
        return self._commit(request, cands, est, i, barred is not None, options)

    def _estimate(
        self,
        request: RouteRequest,
        cands: Sequence[WorkerView],
        arriving: Mapping[str, int] | None,
    ) -> _Estimates:
        """Each candidate's estimated time to first token (``cost_model.estimate_ttft``,
        inlined: this loop is the router's per-request overhead), with the blocks the
        requests in flight there compute (``arriving``, ``_lookup``) and the common prefix
        (``_common``) counted as held."""
        c = self.costs
        ppt = c.prefill_ms_per_token
        attn = c.attn_ms_per_token_ctx
        step = c.decode_ms_per_step
        kv_rate = c.decode_ms_per_kv_token
        inv_budget = 1.0 / c.max_batch_tokens
        bs = request.block_size
        cpu_r = c.cpu_ms_per_token * bs
        disk_r = c.disk_ms_per_token * bs
        shared_r = c.shared_ms_per_token * bs
        ntok = request.num_tokens
        nblocks = len(request.block_hashes)
        cacheable = cacheable_blocks(ntok, bs)
        active = self._active
        queued_attn = self._queued_attn
        speed = self.speed
        discount = self.running_discount
        common = self._common(request.block_hashes, cands) if self._leads else 0
        est = _Estimates(cacheable)
        matches, queues, ahead, ranked, scores = (
            est.matches, est.queues, est.ahead, est.ranked, est.scores
        )  # fmt: skip
        best_hit = src_local = 0
        src_id: str | None = None
        src_queue = 0.0
        maybe_prefetch = False
        for w in cands:
            m = w.match if w.in_sync else NO_MATCH
            total = m.total
            if total > nblocks:  # a view built for another request: never trust more
                m, total = NO_MATCH, 0
            stored = m.disk  # a prefetch's source has these; arriving ones it has not yet
            own = arriving.get(w.worker_id, 0) if arriving else 0
            if own > total and w.in_sync:
                # a request routed there and not finished computes these blocks before us
                m = TierMatch(max(m.gpu, own), max(m.cpu, own), max(m.disk, own), own)
                total = own
            if m.cpu > m.gpu:
                self._host_tier.add(w.worker_id)
            held = total  # what the engine serves: the common prefix below only ranks
            if common > total and w.in_sync:
                # every worker holds the common prefix after its first request: no affinity
                m = TierMatch(max(m.gpu, common), max(m.cpu, common), max(m.disk, common), common)
                total = common
            dec = w.decode_streams
            pending = w.inflight_requests - dec
            if pending < 0:
                pending = 0
            running = w.engine_running
            if running is not None and running - pending > dec:
                dec = min(running, MAX_ENGINE_COUNT) - pending
            per_step = step + dec * ppt + active.get(w.worker_id, 0) * kv_rate
            f = speed.get(w.worker_id, 1.0) if speed else 1.0
            qt: float = w.inflight_prefill_tokens
            waiting: float | None = w.engine_waiting
            if waiting is not None and waiting > pending:
                waiting = min(waiting, MAX_ENGINE_COUNT)  # a forged 1e308 must not overflow
                qt += (waiting - pending) * (qt / pending if pending and qt else ntok)
            if discount and w.running_prefill_tokens:  # the oldest prompt is partly done
                qt -= computed_tokens(c, w, f)
            ahead.append(qt)
            if qt > 0:
                n_steps = qt * inv_budget
                queue = (
                    qt * ppt
                    + queued_attn.get(w.worker_id, 0.0)
                    + (n_steps if n_steps > 1.0 else 1.0) * per_step
                )
            else:
                queue = 0.0
            left = ntok - (total if total < cacheable else cacheable) * bs
            if left < 1:
                left = 1
            n_steps = left * inv_budget
            prefill = (
                left * (ppt + attn * (ntok - left + 0.5 * left))
                + (n_steps if n_steps > 1.0 else 1.0) * per_step
            )
            if f != 1.0:
                queue *= f
                prefill *= f
            local = m.disk
            load = (m.cpu - m.gpu) * cpu_r + (local - m.cpu) * disk_r + (total - local) * shared_r
            ttft = queue + prefill + load
            matches.append(m)
            queues.append(queue)
            ranked.append(ttft)
            scores[w.worker_id] = {
                "ttft_ms": ttft,
                "queue_ms": queue,
                "prefill_ms": prefill,
                "load_ms": load,
                "hit_blocks": held,
                "prefetch_blocks": 0,
                "recompute_ms": 0.0,
                "prefetch_risk_ms": 0.0,
            }
            if total > best_hit:
                best_hit = total
            if queue > 0 and total > local:
                maybe_prefetch = True
            if stored > src_local or (stored == src_local and src_id and queue < src_queue):
                src_id, src_local, src_queue = w.worker_id, stored, queue
        est.best_hit, est.maybe_prefetch = best_hit, maybe_prefetch
        est.src_id, est.src_local, est.src_queue = src_id, src_local, src_queue
        return est

    def _charge_recompute(self, request: RouteRequest, est: _Estimates) -> float:
        """Add to each worker the pool's cost of recomputing what the best holder has
        beyond it; the charge per block (0: none).

        The weight grows with the holder's share of the prompt (issue 15) and, with
        ``fade``, shrinks with the holder's queue beyond the pool's mean (issue 31): by
        ``1 - excess / saving``, gone once the excess reaches the prefill the hit saves.
        The mean, not the shortest queue: a pool queued evenly keeps its hits, which are
        its capacity; only a holder busier than the pool is a bottleneck to leave. Only
        for a session's request where sessions are long (``_long_sessions``): its later
        turns follow it, so leaving moves their load too; a request that comes alone
        (Mooncake's derived sessions, 1.1-1.3 requests) relieves the holder of nothing
        after it, and its copy is the pool's cost alone."""
        best_hit, cacheable = est.best_hit, est.cacheable
        if not best_hit:
            return 0.0
        bs = request.block_size
        ppt = self.costs.prefill_ms_per_token
        share = min(best_hit, cacheable) / cacheable if cacheable else 0.0
        per_block = self.recompute_weight * (1.0 + self.recompute_share * share) * bs * ppt
        matches, queues = est.matches, est.queues
        if per_block and self.fade and self._session and self._long_sessions():
            saving = min(best_hit, cacheable) * bs * ppt
            held = min(q for q, m in zip(queues, matches, strict=True) if m.total == best_hit)
            excess = held - sum(queues) / len(queues)
            if excess >= saving:
                per_block = 0.0
            elif excess > 0:
                per_block *= 1.0 - excess / saving
        if per_block:
            for i, (score, m) in enumerate(zip(est.scores.values(), matches, strict=True)):
                if m.total < best_hit:
                    extra = (best_hit - m.total) * per_block
                    est.ranked[i] += extra
                    score["recompute_ms"] = extra
        return per_block

    def _prefetch_pass(
        self,
        request: RouteRequest,
        cands: Sequence[WorkerView],
        est: _Estimates,
        per_block: float,
        barred: set[int] | None,
    ) -> dict[int, tuple[str | None, int, HintTier, float]] | None:
        """Re-rank the workers that pay with a prefetch hint; their hints by index."""
        if not self.prefetch or not (est.src_local or est.maybe_prefetch):
            return None
        options: dict[int, tuple[str | None, int, HintTier, float]] | None = None
        ranked, queues = est.ranked, est.queues
        # a worker whose queue alone exceeds the best cost cannot win with a prefetch
        bound = min(ranked) + self.tie_ms
        for i, w in enumerate(cands):
            if queues[i] <= 0 or queues[i] > bound:  # admission comes no later than that
                continue
            if est.ahead[i] <= self.costs.max_batch_tokens:
                # admitted at its next step (``admit_wait_ms`` 0): no prefetch can land
                # first, ``_prefetch_option`` would say None. Skipped for speed alone:
                # ~0.55 us a loaded candidate (BENCHMARKS.md session 13)
                continue
            if barred and i in barred:
                continue
            score = est.scores[w.worker_id]
            option = self._prefetch_option(
                request, w, est.matches[i], score, est.src_id, est.src_local, est.best_hit,
                per_block,
            )  # fmt: skip
            if option is not None:
                if options is None:
                    options = {}
                options[i] = option
                # it relies on a hint landing: on a near-tie the worker that needs none wins
                ranked[i] = (
                    score["ttft_ms"] + score["recompute_ms"] + score["prefetch_risk_ms"]
                    + self.tie_ms
                )  # fmt: skip
        return options

    def _choose(self, request: RouteRequest, cands: Sequence[WorkerView], est: _Estimates) -> int:
        """The lowest cost within ``tie_ms``, or a cold prefix placed (``_place``)."""
        placing = self.place_slack_ms is not None
        if not placing:
            return argmin_random(est.ranked, self.rng, self.tie_ms)
        self._meet(cands)
        session = self._session
        if est.best_hit * 2 <= est.cacheable and not (session and self._long_sessions()):
            i = self._place(cands, est.ranked)
        else:
            i = argmin_random(est.ranked, self.rng, self.tie_ms)
        self._placed[cands[i].worker_id] += max(0, est.cacheable - est.matches[i].total)
        return i

    def _commit(
        self,
        request: RouteRequest,
        cands: Sequence[WorkerView],
        est: _Estimates,
        i: int,
        bounded: bool,
        options: dict[int, tuple[str | None, int, HintTier, float]] | None,
    ) -> Decision:
        """Record the choice (its load, its session, the common prefix) and decide."""
        chosen = cands[i].worker_id
        score = est.scores[chosen]
        ntok, bs, session = request.num_tokens, request.block_size, self._session
        self._track(request.request_id, chosen, ntok, score["ttft_ms"])
        left = uncached_tokens(ntok, int(score["hit_blocks"]), bs)
        attn = self.costs.attn_ms_per_token_ctx
        self._queue_attn(request.request_id, chosen, attn * left * (ntok - left + 0.5 * left))
        known = max(self._known, est.best_hit)  # what an earlier prompt or a cache had
        self._remember(request.request_id, chosen, request.block_hashes, session, known)
        self._count_recent(chosen, bounded)
        if session is not None:
            prev = self._sessions.get(session)
            base = prev[3] if prev is not None and prev[0] is not None else known * bs
            if self.cadence and prev is not None and prev[0] is not None:
                _put(self._cadence, session, self._decisions - prev[1])
            self._sessions[session] = (chosen, self._decisions, ntok, min(base, ntok))
        if self.common:
            self._lead(session or request.request_id, request.block_hashes)
        reason = f"min cost: ttft {score['ttft_ms']:.1f} ms"
        option = options.get(i) if options else None
        if option is None:
            return Decision(chosen, scores=est.scores, reason=reason)
        source, blocks, tier, admit = option
        if session is not None:
            _put(self._hinted, session, (chosen, blocks))
        hint = PrefetchHint(source, chosen, blocks, tier, deadline_ms=admit)
        return Decision(chosen, hint, est.scores, f"{reason} with {tier} prefetch")

    def _common(self, hashes: Sequence[int], cands: Sequence[WorkerView]) -> int:
        """Leading blocks of ``hashes`` in the prompts of ``_COMMON_SHARE`` of the last
        clients (at least ``_COMMON_MIN`` seen): a prefix every worker gets, not affinity.
        Counted from the least any in-sync candidate holds: below it, all hold them."""
        n = len(self._leads)
        if n < _COMMON_MIN or not self.common:
            return 0
        end = min(len(hashes), _COMMON_DEPTH)
        d = min(min((w.match.total for w in cands if w.in_sync), default=0), end)
        need = _COMMON_SHARE * n
        count = self._lead_count
        while d < end and count.get(hashes[d], 0) >= need:
            d += 1
        return d

    def _lead(self, client: str, hashes: Sequence[int]) -> None:
        """Count ``client``'s leading blocks (its last prompt's) in the window."""
        leads, count = self._leads, self._lead_count
        new = list(hashes[:_COMMON_DEPTH])
        old = leads.pop(client, None)
        if old == new:  # a session's next turn: its context grew after these blocks
            leads[client] = new
            return
        if old is not None:
            _uncount(count, old)
        leads[client] = new
        for h in new:
            count[h] = count.get(h, 0) + 1
        if len(leads) > _COMMON_WINDOW:
            _, gone = leads.popitem(last=False)
            _uncount(count, gone)

    @property
    def sends_hints(self) -> bool:
        return self.prefetch

    def active_tokens(self, worker_id: str) -> int:
        """Context tokens of the requests routed to ``worker_id`` and not finished."""
        return self._active.get(worker_id, 0)

    def queued_attn_ms(self, worker_id: str) -> float:
        """Attention time of the prefill routed to ``worker_id`` and not past its first
        token: what the queue there costs beyond its tokens' linear rate."""
        return self._queued_attn.get(worker_id, 0.0)

    def on_finish(self, request: RouteRequest, worker_id: str) -> None:
        self._unqueue(request.request_id)
        routed = self._routed.pop(request.request_id, None)
        if routed is not None:
            self._release(routed[0], routed[1])
        self._land(request.request_id)

    def on_first_token(self, request: RouteRequest, worker_id: str, ttft_ms: float) -> None:
        """Learn the worker's speed: observed against estimated time to first token."""
        self._unqueue(request.request_id)
        routed = self._routed.get(request.request_id)
        if not self.learn_speed or routed is None or routed[0] != worker_id:
            return
        if not 0 <= ttft_ms < _INF:
            return
        est = routed[2] / self.speed.get(worker_id, 1.0)  # what ``costs`` alone said
        obs = self._observed.get(worker_id)
        if obs is None:
            obs = self._observed[worker_id] = [0.0, 0.0, 0.0]
        a = _SPEED_ALPHA
        obs[0] += a * (ttft_ms - obs[0])
        obs[1] += a * (est - obs[1])
        obs[2] += 1
        if obs[2] < _SPEED_MIN_SAMPLES or obs[1] <= 0:
            return
        ready = [o for o in self._observed.values() if o[2] >= _SPEED_MIN_SAMPLES and o[1] > 0]
        pool = sum(o[0] for o in ready) / sum(o[1] for o in ready)
        lo, hi = _SPEED_RANGE
        for wid, o in self._observed.items():
            if o[2] < _SPEED_MIN_SAMPLES or o[1] <= 0:
                continue
            own = (o[0] / o[1]) / pool
            if 1.0 / _SPEED_DEADBAND < own < _SPEED_DEADBAND:
                own = 1.0  # noise: a holder charged 10 % more loses its sessions
            self.speed[wid] = min(max(pool * own, lo), hi)

    def _track(self, request_id: str, worker_id: str, tokens: int, est_ms: float) -> None:
        """Count the request's context on its worker until ``on_finish``."""
        old = self._routed.pop(request_id, None)
        if old is not None:  # the same id routed again (a retry): count it once
            self._release(old[0], old[1])
        self._routed[request_id] = (worker_id, tokens, est_ms)
        self._active[worker_id] = self._active.get(worker_id, 0) + tokens
        if len(self._routed) > _MAX_TRACKED:  # finishes never reported: forget the oldest
            _, lost = self._routed.popitem(last=False)
            self._release(lost[0], lost[1])

    def _queue_attn(self, request_id: str, worker_id: str, ms: float) -> None:
        self._unqueue(request_id)  # the same id routed again (a retry): count it once
        self._queued[request_id] = (worker_id, ms)
        self._queued_attn[worker_id] = self._queued_attn.get(worker_id, 0.0) + ms
        if len(self._queued) > _MAX_TRACKED:  # first tokens never reported: forget the oldest
            self._unqueue(next(iter(self._queued)))

    def _unqueue(self, request_id: str) -> None:
        queued = self._queued.pop(request_id, None)
        if queued is None:
            return
        worker_id, ms = queued
        left = self._queued_attn.get(worker_id, 0.0) - ms
        if left > 1e-9 and worker_id in self._queued_attn:
            self._queued_attn[worker_id] = left
        else:  # float sums drift: none left means none
            self._queued_attn.pop(worker_id, None)

    def _lookup(self, request: RouteRequest) -> _Lookup:
        """What the prompts routed before tell of ``request``: the session of the latest
        prompt it builds on, whatever key each came with; per worker (with ``in_flight``)
        the leading blocks that a prompt routed there and not finished computes (or holds):
        the one ``request`` builds on, its session's last by key, and with
        ``shared_in_flight`` every other; and the most blocks it shares with one of them.

        ``request`` builds on a prompt ``A`` when it holds ``A``'s first novel block (the
        first that no earlier prompt nor any cache had when ``A`` was routed: what ``A``
        added) or ``A``'s last block: a conversation's next turn. A new session that
        shares a system prompt with ``A`` shares none of what ``A`` added.

        Block hashes chain: sharing block ``i`` means sharing every block before it. So
        the powers of two are probed in order until one misses (what shares ``2k`` blocks
        shares ``k``): each worker is credited the deepest it holds, at least half of
        what it shares. Then the blocks up to the next power, from the top, for a novel
        or a last block; the prompts named above, and the latest in flight anchored at
        the deepest power, are read exactly (binary search over their hashes).
        ``O(log n)`` lookups, and at most the deepest power's blocks.

        ``shared_in_flight`` is off on a prefill pool (``prefill_params``), whose charge
        does not fade: there a burst of new sessions queued behind the first holder of
        their system prompt in flight, before any copy existed (``tests/test_pd_sim.py``'s
        hint scenario: hit 0.844 -> 0.832, TTFT p90 432 -> 533 ms; without it 0.851 /
        412). On a mixed pool it pays (``bench/sweep.py``'s agent x2 16 engines, seed 1:
        TTFT p90 850 ms without it, 784 with it and before)."""
        hashes = request.block_hashes
        latest, anchors = self._latest, self._anchors
        n = len(hashes)
        depth: dict[str, int] | None = {} if self.in_flight else None
        p = 1
        while p <= n:
            h = hashes[p - 1]
            if h not in latest:
                break
            if anchors and depth is not None:
                for w in anchors.get(h, ()):
                    depth[w] = p
            p <<= 1
        low = p >> 1
        if not low:
            return depth, None, 0
        prompts = self._prompts
        known = low
        base: str | None = None  # the latest prompt that ``request`` builds on
        for i in range(min(n, p - 1) - 1, low - 2, -1):  # p - 1 was probed, and missed
            rid = latest.get(hashes[i])
            if rid is not None:
                _, blocks, _, novel = prompts[rid]
                if blocks == i + 1 or novel == i:  # its last or its first novel block
                    base, known = rid, i + 1
                    break
        if base is None:
            rid = latest[hashes[low - 1]]
            if 0 <= prompts[rid][3] < low:  # shares low blocks with it, past its novel one
                base = rid
        if depth is not None:
            key = request.session_key
            deepest = self._anchored.get(hashes[low - 1]) if anchors else None
            for rid in (
                base,
                self._last.get(key) if key is not None else None,
                next(reversed(deepest)) if deepest else None,
            ):
                pending = self._pending.get(rid) if rid is not None else None
                if pending is not None:
                    worker, d = pending[0], _shared(pending[1], hashes)
                    if d > depth.get(worker, 0):
                        depth[worker] = d
                    known = max(known, d)
        return depth, prompts[base][2] if base is not None else None, known

    def _remember(
        self,
        request_id: str,
        worker_id: str,
        hashes: Sequence[int],
        session: str | None,
        known: int,
    ) -> None:
        """Anchor a routed prompt, its first ``known`` blocks seen before: a later one that
        builds on it continues its session (``session``, else this request's), and until
        it finishes it counts as arriving on its worker: the engine computes it there
        first, in queue order, and keeps it while it decodes, but its events reach the
        index only once it is computed."""
        self._land(request_id)  # the same id routed again (a retry): where it went last
        old = self._prompts.pop(request_id, None)
        if old is not None:
            self._forget(request_id, old[0])
        if not hashes:
            return
        n = len(hashes)
        positions = _anchor_positions(n)
        # a prompt that shares nothing seen: its first block may open a shared prefix
        # (a system prompt's first use), so nothing of it counts as its own
        novel = known if 0 < known < n else -1
        if novel >= 0 and novel not in positions:
            positions.append(novel)
        keys = [hashes[i] for i in positions]
        latest = self._latest
        for h in keys:
            latest[h] = request_id
        self._prompts[request_id] = (keys, n, session or request_id, novel)
        if len(self._prompts) > _PROMPTS:
            rid = next(iter(self._prompts))
            self._land(rid)
            self._forget(rid, self._prompts.pop(rid)[0])
        if not self.in_flight:
            return
        self._pending[request_id] = (worker_id, hashes)
        if session is not None:
            _put(self._last, session, request_id)
        if not self.shared_in_flight:
            return
        anchors, anchored = self._anchors, self._anchored
        for h in keys:
            holders = anchors.get(h)
            if holders is None:
                anchors[h] = {worker_id: 1}
                anchored[h] = {request_id: None}
            else:
                holders[worker_id] = holders.get(worker_id, 0) + 1
                anchored[h][request_id] = None

    def _forget(self, request_id: str, keys: list[int]) -> None:
        latest = self._latest
        for h in keys:
            if latest.get(h) == request_id:
                del latest[h]

    def _land(self, request_id: str) -> None:
        """The request finished: from now on the index alone tells where its blocks are."""
        pending = self._pending.pop(request_id, None)
        if pending is None or not self.shared_in_flight:
            return
        worker_id = pending[0]
        anchors, anchored = self._anchors, self._anchored
        for h in self._prompts[request_id][0]:
            holders = anchors[h]
            left = holders[worker_id] - 1
            if left:
                holders[worker_id] = left
            else:
                del holders[worker_id]
                if not holders:
                    del anchors[h], anchored[h]
                    continue
            del anchored[h][request_id]

    def _release(self, worker_id: str, tokens: int) -> None:
        left = self._active.get(worker_id, 0) - tokens
        if left > 0:
            self._active[worker_id] = left
        else:
            self._active.pop(worker_id, None)

    def _place(self, cands: Sequence[WorkerView], ranked: Sequence[float]) -> int:
        """A cold request (no worker holds half of it): among the workers within
        ``tie_ms + place_slack_ms`` of the best cost, the one that computed the fewest
        blocks so far, as SGLang's router sends a request under its ``cache_threshold`` to
        the tenant with the smallest tree."""
        lo = min(ranked) + self.tie_ms + (self.place_slack_ms or 0.0)
        ties = [i for i, v in enumerate(ranked) if v <= lo]
        keys = [self._placed[cands[i].worker_id] for i in ties]
        least = min(keys)
        best = [t for t, k in zip(ties, keys, strict=True) if k == least]
        return best[0] if len(best) == 1 else best[self.rng.randrange(len(best))]

    def _meet(self, cands: Sequence[WorkerView]) -> None:
        """Count a worker seen for the first time as having computed the least any other
        has (a joining engine is no emptier than the emptiest one's share of new work)."""
        placed = self._placed
        new = [w.worker_id for w in cands if w.worker_id not in placed]
        if new:
            known = [placed[w.worker_id] for w in cands if w.worker_id in placed]
            floor = min(known, default=0.0)
            for wid in new:
                _put(placed, wid, floor)

    def _barred(
        self, session: str | None, cands: Sequence[WorkerView], tokens: int, continues: bool
    ) -> set[int] | None:
        """For a session's first request, the workers it may not start on; else None.
        A request that ``continues`` an earlier prompt is never a first one, although its
        session was not seen (a keyless prompt's continuation names the prompt's id).

        Bounded load as consistent hashing does it: with ``m`` recent decisions and
        ``n`` workers, a worker may take one more while it stays within
        ``ceil(session_load * (m + 1) / n)``; the least loaded one always fits. Only
        where sessions average ``_BOUND_TURNS`` requests or more: a first placement
        then decides where the later ones go. With ``live_sessions`` the same bound on
        the sessions live per worker (``_live_sessions``): what will keep sending turns.
        """
        if session is None:
            return None
        self._decisions += 1
        n = self._decisions
        seen = self._sessions
        last = seen.get(session)
        if last is not None:
            seen.move_to_end(session)
            gap = n - last[1]
            self._gap = gap if self._gap is None else self._gap + _GAP_ALPHA * (gap - self._gap)
            grow = max(tokens - last[2], 0)
            g = self._growth
            self._growth = grow if g is None else g + _GAP_ALPHA * (grow - g)
            return None
        seen[session] = (None, n, tokens, 0)
        if len(seen) > _MAX_TRACKED:
            seen.popitem(last=False)
        if continues:
            return None
        self._live = None
        if not self._long_sessions():
            return set()  # a new session, but sessions are too short to bind
        barred = {i for i, w in enumerate(cands) if not self._fits(w.worker_id, len(cands), 0.0)}
        return barred if len(barred) < len(cands) else set()

    def _fits(self, worker_id: str, workers: int, extra: float) -> bool:
        """Whether ``worker_id`` may take a new session under the bound, its factor
        ``session_load + extra``: recent decisions, and live sessions with ``live_sessions``."""
        c = self.session_load + extra
        m = len(self._recent)
        if self._recent_count.get(worker_id, 0) + 1 > math.ceil(c * (m + 1) / workers):
            return False
        if not self.live_sessions or self._gap is None:
            return True
        live, total, _ = self._live_now(self._gap)
        if not self.live_whole:
            return live.get(worker_id, 0) + 1 <= math.ceil(c * (total + 1) / workers)
        # whole sessions: the fair share rounded up, then the factor. Rounded after the
        # factor, a handful of live sessions let one worker take all but one of them
        # (2 workers: 3 of 4, ceil(1.25 * 4 / 2); 4 of 5), as on bench/e2e.py's agent trace
        return live.get(worker_id, 0) + 1 <= c * math.ceil((total + 1) / workers)

    def _spare_holders(
        self,
        barred: set[int],
        cands: Sequence[WorkerView],
        matches: Sequence[TierMatch],
        block_size: int,
    ) -> None:
        """Lift the bound from a barred worker by what barring it costs: a new session
        that starts elsewhere recomputes the worker's lead (the prefix it holds beyond
        every worker the session may start on) as a second copy. Its factor grows by that
        lead over the session's expected later prompt tokens (requests per session less
        one, times the mean growth per request), so a prefix worth much of a session's
        work is not copied for balance. Agent sessions (22 requests, 2.6K tokens each) add
        ~0.07 to the factor for a 4K-token tool prompt; chat (6.7 turns, 1.5K each) ~0.6
        for a 5K-token system prompt.

        Requests per session are counted over the sessions that *ended* in the window
        (``_turns``), not over those that started: a live session has sent only part of
        its requests, and counting it as whole made a young pool's sessions look short
        (bench/e2e.py's 100-request agent slices: ~5 where they run 10-20), their later
        prompts small and every lead large, so the holder of a 6-block tool prompt was
        spared and took 5 of 6 sessions on one of two engines, whose cache then held
        half their histories."""
        g = self._growth
        if not g:
            return
        later = (self._turns() - 1.0) * g
        if later <= 0:
            return
        free = max((m.total for i, m in enumerate(matches) if i not in barred), default=0)
        for i in list(barred):
            lead = matches[i].total - free
            if lead > 0 and self._fits(cands[i].worker_id, len(cands), lead * block_size / later):
                barred.discard(i)

    def _turns(self) -> float:
        """Requests per session over the window: its requests over the sessions that
        ended in it (last request before the live horizon, ``_LIVE_GAPS`` mean gaps), the
        mean duration estimated from durations partly observed (a live session's requests
        count, only its end is not seen yet). None ended yet: the window's requests all
        belong to sessions still running, as if to one. With ``ended_turns`` off, over the
        sessions that started in it (plus one)."""
        recent = len(self._recent)
        if not self.ended_turns or self._gap is None:
            return recent / (self._recent_new + 1)
        n = self._decisions
        start, live = n - recent, n - _LIVE_GAPS * self._gap
        ended = 0
        for _, at, _, _ in reversed(self._sessions.values()):
            if at < start:
                break
            if at < live:
                ended += 1
        return recent / max(ended, 1)

    def _live_now(self, gap: float) -> tuple[dict[str, int], int, dict[str, int]]:
        """This decision's live sessions (``_live_sessions``), computed once."""
        if self._live is None:
            live, own = self._live_sessions(self._decisions - _LIVE_GAPS * gap)
            self._live = (live, sum(live.values()), own)
        return self._live

    def _live_sessions(self, since: float) -> tuple[dict[str, int], dict[str, int]]:
        """Sessions per worker whose last request came after decision ``since``: the ones
        still sending turns there; and the tokens of their last prompts that are their
        own (not what their first request shared with earlier prompts: a system or tool
        prompt is held once, whatever the sessions on it)."""
        live: dict[str, int] = {}
        own: dict[str, int] = {}
        for worker, at, tokens, base in reversed(self._sessions.values()):
            if at < since:
                break
            if worker is not None:
                live[worker] = live.get(worker, 0) + 1
                own[worker] = own.get(worker, 0) + tokens - base
        return live, own

    def _live_by_cadence(self, gap: float) -> tuple[dict[str, int], dict[str, int]]:
        """Live sessions per worker and their own tokens, each session live for
        ``_LIVE_GAPS`` of its own last gap or of the mean, the longer (``cadence``): the
        mean is the fast sessions', and a slower one still running is not gone from the
        cache it needs. Over the window's decisions."""
        n = self._decisions
        start = n - len(self._recent)
        cadence = self._cadence
        live: dict[str, int] = {}
        own: dict[str, int] = {}
        for session, (worker, at, tokens, base) in reversed(self._sessions.items()):
            if at < start:
                break
            if worker is None:
                continue
            own_gap = cadence.get(session, 0)
            if at >= n - _LIVE_GAPS * (own_gap if own_gap > gap else gap):
                live[worker] = live.get(worker, 0) + 1
                own[worker] = own.get(worker, 0) + tokens - base
        return live, own

    def _bar_full(
        self,
        barred: set[int],
        cands: Sequence[WorkerView],
        request: RouteRequest,
        est: _Estimates,
    ) -> None:
        """Bar, for a new session, the workers whose cache cannot keep it beside the live
        sessions' histories there (``fit_cache``): a history evicted between two turns is
        computed again, and a cache holding more live histories than it has pages for
        evicts one on every turn (bench/e2e.py's slices: two engines of 8,192 tokens,
        agent histories of 2-3.5K; four live on one engine thrashed it). A worker fits while
        its live sessions' own tokens (not the prefix their first request shared) and the
        new session's, each grown by a whole session's growth (requests per session less
        one, times the mean growth per request: an upper bound, a live session is partly
        through), stay within its capacity (``WorkerView.capacity_blocks``: GPU and host
        memory, a history demoted to the host is loaded back, not computed; unknown: it
        fits). The session bound's choice is kept where it leaves a worker that fits; else
        the workers that fit; where none does, the ones least full after it (the pool
        cannot keep every history: spread the evictions)."""
        if self._gap is None:
            return
        bs = request.block_size
        known = min(max(self._known, est.best_hit), est.cacheable)
        new = max(request.num_tokens - known * bs, 0)
        if self.cadence:
            live, own = self._live_by_cadence(self._gap)
        else:
            live, _, own = self._live_now(self._gap)
        # every live history grows to its end, the new one too: the growth per request
        # times the requests a session runs (over the window, ``_turns``) less one
        g = (self._growth or 0.0) * max(self._turns() - 1.0, 1.0)
        if self.fit_cost:
            # no bar: each worker is charged the prefill of what the session makes its
            # cache evict beyond what it evicts anyway (equal where every cache overflows)
            ppt = self.costs.prefill_ms_per_token
            scores = list(est.scores.values())
            for i, w in enumerate(cands):
                cap = w.capacity_blocks
                if cap is None or cap <= 0:
                    continue
                wid = w.worker_id
                before = own.get(wid, 0) + g * live.get(wid, 0) - cap * bs
                after = before + new + g
                over = max(after, 0.0) - max(before, 0.0)
                if over > 0:
                    est.ranked[i] += over * ppt
                    scores[i]["recompute_ms"] += over * ppt
            return
        fill: list[float] = []
        for w in cands:
            cap = w.capacity_blocks
            if cap is None or cap <= 0:
                fill.append(0.0)
            else:
                wid = w.worker_id
                need = own.get(wid, 0) + new + g * (live.get(wid, 0) + 1)
                fill.append(need / (cap * bs))
        n = len(cands)
        fits = {i for i in range(n) if fill[i] <= 1.0}
        allowed = fits - barred
        if allowed:
            barred.update(i for i in range(n) if i not in allowed)
            return
        if not fits:
            lo = min(fill)
            fits = {i for i in range(n) if fill[i] <= lo}
        barred.clear()
        barred.update(i for i in range(n) if i not in fits)

    def _long_sessions(self) -> bool:
        """Sessions average ``_BOUND_TURNS`` requests or more over the window: a first
        placement decides where the later turns queue."""
        if len(self._recent) >= _BOUND_TURNS * (self._recent_new + 1):
            return True
        return self.young_bound and self._young()

    def _young(self) -> bool:
        """A session continued and none was seen to end yet (``young_bound``): sessions
        run more than one request, how many is unknown, and the window's count says
        little (its first requests are first turns). Until one ends they are bounded as
        long ones: unbounded, the first sessions of bench/e2e.py's agent slices all
        started where the tool prompt was, and three live agent histories on one engine of
        8,192 tokens evicted each other for the rest of the run. None continued: the
        window's count decides (sessions of one request, Mooncake's). Read off the least
        recently active session (``_sessions`` order)."""
        if self._ended:
            return False
        g = self._gap
        if g is None or not self._sessions:
            return False
        at = next(iter(self._sessions.values()))[1]
        if at < self._decisions - _LIVE_GAPS * g:
            self._ended = True
            return False
        return True

    def _count_recent(self, worker_id: str, new_session: bool) -> None:
        recent, counts = self._recent, self._recent_count
        recent.append((worker_id, new_session))
        counts[worker_id] = counts.get(worker_id, 0) + 1
        self._recent_new += new_session
        if len(recent) > _WINDOW:
            old, was_new = recent.popleft()
            self._recent_new -= was_new
            left = counts[old] - 1
            if left:
                counts[old] = left
            else:
                del counts[old]

    def _learn_landing(self, session: str, cands: Sequence[WorkerView]) -> None:
        """Did the session's last hint land? Its target holds the blocks now, or not."""
        hinted = self._hinted.pop(session, None)
        if hinted is None:
            return
        target, blocks = hinted
        for w in cands:
            if w.worker_id == target:
                landed = 1.0 if w.in_sync and w.match.total >= blocks else 0.0
                self.landing_rate += _LANDING_ALPHA * (landed - self.landing_rate)
                return

    def _prefetch_option(
        self,
        request: RouteRequest,
        w: WorkerView,
        m: TierMatch,
        score: dict[str, float],
        src_id: str | None,
        src_local: int,
        best_hit: int,
        per_block: float,
    ) -> tuple[str | None, int, HintTier, float] | None:
        """(source, blocks, tier, deadline) if pulling blocks into ``w`` while it waits pays.

        It pays when the expected cost is lower: the hint lands with the learned
        ``landing_rate`` (else ``w`` computes what it would have), and the copy is charged
        ``copy_weight`` of the moved blocks' prefill, the memory it takes from others.
        A peer's blocks go to ``w``'s host memory, or to its GPU memory (charged twice)
        when none was seen in the index; ``w`` needs room (``kv_usage`` below ``_KV_ROOM``).
        Updates ``score`` in place to the with-prefetch estimate when it is chosen.
        """
        costs = self.costs
        bs = request.block_size
        local = m.disk
        source: str | None
        tier: HintTier
        if src_id is not None and src_id != w.worker_id and src_local > m.total:
            # pull [local, src_local) from the source's host memory over the network
            moved, hit, tier, source = src_local - local, src_local, "cpu", src_id
        elif m.total > local:
            # blocks w reaches only in the shared pool: load them while w is busy anyway
            moved, hit, tier = m.total - local, m.total, "shared"
            source = src_id if src_local else None
        else:
            return None
        usage = w.kv_usage
        if usage is not None and not usage < _KV_ROOM:  # NaN counts as full
            return None
        f = self.speed.get(w.worker_id, 1.0)
        done = computed_tokens(costs, w, f) if self.running_discount else 0.0
        admit = f * admit_wait_ms(costs, w, request.num_tokens, done)
        if not prefetch_fits(costs, moved * bs, admit * self.prefetch_fraction, tier):
            return None
        queue, prefill, load = estimate_ttft_prefetched(
            costs,
            w,
            m,
            request.num_tokens,
            bs,
            hit,
            moved,
            self.active_tokens(w.worker_id),
            self.queued_attn_ms(w.worker_id),
            done,
        )
        queue, prefill = f * queue, f * prefill
        ttft = queue + prefill + load
        recompute = (best_hit - hit) * per_block if hit < best_hit else 0.0
        rate = self.landing_rate
        base = score["ttft_ms"] + score["recompute_ms"]
        # a hint that does not land leaves the plain estimate; the copy always costs memory
        risk = (1.0 - rate) * max(base - ttft - recompute, 0.0)
        if tier == "cpu":  # a second copy; a shared-pool load is what admission would do
            copy = self.copy_weight * moved * bs * costs.prefill_ms_per_token
            # with no host memory seen, it lands in GPU memory, evicting the hottest tier
            risk += copy if w.worker_id in self._host_tier else _GPU_COPY_FACTOR * copy
        if ttft + recompute + risk >= base:
            return None
        score.update(ttft_ms=ttft, prefill_ms=prefill, load_ms=load, hit_blocks=hit)
        score.update(prefetch_blocks=moved, recompute_ms=recompute, prefetch_risk_ms=risk)
        return source, hit, tier, admit


class _Estimates:
    """One decision's numbers per candidate, in candidate order."""

    __slots__ = (
        "ahead",
        "best_hit",
        "cacheable",
        "matches",
        "maybe_prefetch",
        "queues",
        "ranked",
        "scores",
        "src_id",
        "src_local",
        "src_queue",
    )  # fmt: skip

    def __init__(self, cacheable: int) -> None:
        self.cacheable = cacheable  # blocks of the prompt the engine may serve from cache
        self.matches: list[TierMatch] = []
        self.queues: list[float] = []  # estimated wait before its prefill starts, ms
        self.ahead: list[float] = []  # prompt tokens queued before it (``queue_tokens``)
        self.ranked: list[float] = []  # the cost compared: ttft, then the charges
        self.scores: dict[str, dict[str, float]] = {}  # by worker: the numbers behind it
        self.best_hit = 0
        # the worker holding the most leading blocks locally: a prefetch's source
        self.src_id: str | None = None
        self.src_local = 0
        self.src_queue = 0.0
        self.maybe_prefetch = False  # some queued worker reaches blocks in the shared pool


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks two prompts share (chained hashes: a binary search)."""
    return prefix_depth(min(len(a), len(b)), lambda i: a[i] == b[i])


def _anchor_positions(n: int) -> list[int]:
    """The blocks of an ``n``-block prompt kept to find it by: ``2**k - 1`` and the last,
    ``O(log n)`` of them (``CacheAware._arriving``)."""
    out = []
    p = 1
    while p <= n:
        out.append(p - 1)
        p <<= 1
    if n and out[-1] != n - 1:
        out.append(n - 1)
    return out


def _uncount(count: dict[int, int], hashes: list[int]) -> None:
    for h in hashes:
        left = count[h] - 1
        if left:
            count[h] = left
        else:
            del count[h]


def _put(table: OrderedDict[str, _T], key: str, value: _T) -> None:
    table.pop(key, None)
    table[key] = value
    if len(table) > _MAX_TRACKED:
        table.popitem(last=False)
