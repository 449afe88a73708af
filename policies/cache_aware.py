"""``cache_aware``: send each request where its estimated time to first token is lowest.

Per healthy worker::

    ttft = queue wait (prompt tokens ahead of it, incl. the engine's reported queue)
         + prefill of the uncached tokens (hits in any tier are not recomputed)
         + load time of the hits below GPU (host, disk, shared pool)

Affinity and balance are one trade-off in one unit: a hit saves its tokens' prefill, a
queue costs its tokens' prefill, so a worker holding the prefix wins while its queue is
shorter than what it saves and loses once it is not. A prefix that every request shares
(a system prompt in block 0) saves the same on whichever worker holds it and is repaid
by the first queued request, so it cannot pull the pool onto one worker.

Prefetch: when a worker ``S`` holds more leading blocks locally than the target can
reach, and the transfer from ``S`` fits inside the target's queue wait, the target is
estimated as if it held them (loaded from its host memory) and, if chosen, the decision
carries a ``PrefetchHint`` (tier "cpu", source ``S``). Blocks the target can reach only
in the shared pool are hinted the same way (tier "shared") so the load overlaps the wait.
A worker whose index is out of sync is estimated with no hit at all: a stale match
promises a saving the engine may not deliver.

Ties (within ``tie_ms``) are broken at random, never by list order. An estimate that
relies on a prefetch must win by more than ``tie_ms``: the hint may be dropped.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from index.prefix_index import TierMatch

from .base import NO_MATCH, Decision, Policy, PrefetchHint, RouteRequest, WorkerView
from .cost_model import EngineCosts, admit_wait_ms, estimate_ttft_prefetched, prefetch_fits
from .selection import argmin_random, healthy


class CacheAware(Policy):
    """Minimum estimated TTFT per worker, with prefetch hints (see module doc)."""

    name = "cache_aware"

    def __init__(
        self,
        rng: random.Random | None = None,
        *,
        costs: EngineCosts | Mapping[str, Any] | None = None,
        prefetch: bool = True,
        tie_ms: float = 0.25,
    ) -> None:
        super().__init__(rng)
        if not tie_ms >= 0:
            raise ValueError(f"cache_aware: tie_ms must be >= 0, got {tie_ms}")
        self.costs = EngineCosts.from_config(costs)
        self.prefetch = bool(prefetch)
        self.tie_ms = tie_ms

    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        cands = healthy(workers)
        c = self.costs
        ppt = c.prefill_ms_per_token
        attn = c.attn_ms_per_token_ctx
        step = c.decode_ms_per_step
        inv_budget = 1.0 / c.max_batch_tokens
        bs = request.block_size
        cpu_r = c.cpu_ms_per_token * bs
        disk_r = c.disk_ms_per_token * bs
        shared_r = c.shared_ms_per_token * bs
        ntok = request.num_tokens
        nblocks = len(request.block_hashes)
        matches: list[TierMatch] = []
        queues: list[float] = []
        ttfts: list[float] = []
        scores: dict[str, dict[str, float]] = {}
        src_id: str | None = None
        src_local = 0
        src_queue = 0.0
        maybe_prefetch = False
        # cost_model.estimate_ttft, inlined: this loop is the router's per-request overhead
        for w in cands:
            m = w.match if w.in_sync else NO_MATCH
            total = m.total
            if total > nblocks:  # a view built for another request: never trust more
                m, total = NO_MATCH, 0
            dec = w.decode_streams
            pending = w.inflight_requests - dec
            if pending < 0:
                pending = 0
            running = w.engine_running
            if running is not None and running - pending > dec:
                dec = running - pending
            per_step = step + dec * ppt
            qt = w.inflight_prefill_tokens
            waiting = w.engine_waiting
            if waiting is not None and waiting > pending:
                qt += (waiting - pending) * (qt / pending if pending and qt else ntok)
            if qt > 0:
                n_steps = qt * inv_budget
                queue = qt * ppt + (n_steps if n_steps > 1.0 else 1.0) * per_step
            else:
                queue = 0.0
            left = ntok - total * bs
            if left < 1:
                left = 1
            n_steps = left * inv_budget
            prefill = (
                left * (ppt + attn * (ntok - left + 0.5 * left))
                + (n_steps if n_steps > 1.0 else 1.0) * per_step
            )
            local = m.disk
            load = (m.cpu - m.gpu) * cpu_r + (local - m.cpu) * disk_r + (total - local) * shared_r
            ttft = queue + prefill + load
            matches.append(m)
            queues.append(queue)
            ttfts.append(ttft)
            scores[w.worker_id] = {
                "ttft_ms": ttft,
                "queue_ms": queue,
                "prefill_ms": prefill,
                "load_ms": load,
                "hit_blocks": total,
                "prefetch_blocks": 0,
            }
            if queue > 0 and total > local:
                maybe_prefetch = True
            if local > src_local or (local == src_local and src_id and queue < src_queue):
                src_id, src_local, src_queue = w.worker_id, local, queue

        options: dict[int, tuple[str | None, int, str, float]] | None = None
        if self.prefetch and (src_local or maybe_prefetch):
            # a worker whose queue alone exceeds the best estimate cannot win with a prefetch
            bound = min(ttfts) + self.tie_ms
            for i, w in enumerate(cands):
                if queues[i] <= 0 or queues[i] > bound:  # admission comes no later than that
                    continue
                score = scores[w.worker_id]
                option = self._prefetch_option(request, w, matches[i], score, src_id, src_local)
                if option is not None:
                    if options is None:
                        options = {}
                    options[i] = option
                    # it relies on a hint landing: on a near-tie the worker that needs none wins
                    ttfts[i] = score["ttft_ms"] + self.tie_ms

        i = argmin_random(ttfts, self.rng, self.tie_ms)
        chosen = cands[i].worker_id
        option = options.get(i) if options else None
        if option is None:
            return Decision(chosen, scores=scores, reason=f"min ttft {ttfts[i]:.1f} ms")
        source, blocks, tier, admit = option
        hint = PrefetchHint(source, chosen, blocks, tier, deadline_ms=admit)
        ttft = scores[chosen]["ttft_ms"]
        return Decision(chosen, hint, scores, f"min ttft {ttft:.1f} ms with {tier} prefetch")

    def _prefetch_option(
        self,
        request: RouteRequest,
        w: WorkerView,
        m: TierMatch,
        score: dict[str, float],
        src_id: str | None,
        src_local: int,
    ) -> tuple[str | None, int, str, float] | None:
        """(source, blocks, tier, deadline) if pulling blocks into ``w`` while it waits helps.

        Updates ``score`` in place to the with-prefetch estimate when that is lower.
        """
        costs = self.costs
        bs = request.block_size
        local = m.disk
        if src_id is not None and src_id != w.worker_id and src_local > m.total:
            # pull [local, src_local) from the source's host memory over the network
            moved, hit, tier, source = src_local - local, src_local, "cpu", src_id
        elif m.total > local:
            # blocks w reaches only in the shared pool: load them while w is busy anyway
            moved, hit, tier = m.total - local, m.total, "shared"
            source = src_id if src_local else None
        else:
            return None
        admit = admit_wait_ms(costs, w, request.num_tokens)
        if not prefetch_fits(costs, moved * bs, admit, tier):
            return None
        queue, prefill, load = estimate_ttft_prefetched(
            costs, w, m, request.num_tokens, bs, hit, moved
        )
        ttft = queue + prefill + load
        if ttft >= score["ttft_ms"]:
            return None
        score.update(ttft_ms=ttft, prefill_ms=prefill, load_ms=load, hit_blocks=hit)
        score["prefetch_blocks"] = moved
        return source, hit, tier, admit
