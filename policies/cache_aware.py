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

Ties (within ``tie_ms``) are broken at random, never by list order.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from index.prefix_index import TierMatch

from .base import NO_MATCH, Decision, Policy, PrefetchHint, RouteRequest, WorkerView
from .cost_model import (
    EngineCosts,
    decode_seqs,
    load_time_ms,
    prefill_time_ms,
    queue_wait_ms,
)
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
        costs = self.costs
        bs = request.block_size
        ntok = request.num_tokens
        nblocks = len(request.block_hashes)
        matches: list[TierMatch] = []
        ttfts: list[float] = []
        scores: dict[str, dict[str, float]] = {}
        src: WorkerView | None = None
        src_local = 0
        src_queue = 0.0
        for w in cands:
            m = w.match if w.in_sync else NO_MATCH
            if m.total > nblocks:  # a view built for another request: never trust more
                m = NO_MATCH
            decode = decode_seqs(w)
            queue = queue_wait_ms(costs, w, ntok)
            prefill = prefill_time_ms(costs, ntok, m.total, bs, decode)
            load = load_time_ms(costs, m, bs)
            ttft = queue + prefill + load
            matches.append(m)
            ttfts.append(ttft)
            scores[w.worker_id] = {
                "ttft_ms": ttft,
                "queue_ms": queue,
                "prefill_ms": prefill,
                "load_ms": load,
                "hit_blocks": m.total,
                "prefetch_blocks": 0,
            }
            if m.disk > src_local or (m.disk == src_local and src and queue < src_queue):
                src, src_local, src_queue = w, m.disk, queue

        options: dict[int, tuple[str | None, int, str]] | None = None
        if self.prefetch:
            src_id = src.worker_id if src is not None else None
            for i, w in enumerate(cands):
                score = scores[w.worker_id]
                option = self._prefetch_option(request, w, matches[i], score, src_id, src_local)
                if option is not None:
                    if options is None:
                        options = {}
                    options[i] = option
                    ttfts[i] = score["ttft_ms"]

        i = argmin_random(ttfts, self.rng, self.tie_ms)
        chosen = cands[i].worker_id
        option = options.get(i) if options else None
        if option is None:
            return Decision(chosen, scores=scores, reason=f"min ttft {ttfts[i]:.1f} ms")
        source, blocks, tier = option
        queue = scores[chosen]["queue_ms"]
        hint = PrefetchHint(source, chosen, blocks, tier, deadline_ms=queue)
        return Decision(chosen, hint, scores, f"min ttft {ttfts[i]:.1f} ms with {tier} prefetch")

    def _prefetch_option(
        self,
        request: RouteRequest,
        w: WorkerView,
        m: TierMatch,
        score: dict[str, float],
        src_id: str | None,
        src_local: int,
    ) -> tuple[str | None, int, str] | None:
        """(source, blocks, tier) if pulling blocks into ``w`` during its queue wait helps.

        Updates ``score`` in place to the with-prefetch estimate when that is lower.
        """
        queue = score["queue_ms"]
        if queue <= 0:
            return None
        costs = self.costs
        bs = request.block_size
        local = m.disk
        if src_id is not None and src_id != w.worker_id and src_local > m.total:
            # pull [local, src_local) from the source's host memory over the network
            moved = src_local - local
            if costs.prefetch_ms(moved * bs) > queue:
                return None
            hit, tier, source = src_local, "cpu", src_id
        elif m.total > local:
            # blocks w reaches only in the shared pool: load them while w is busy anyway
            moved = m.total - local
            if costs.load_ms("shared", moved * bs) > queue:
                return None
            hit, tier, source = m.total, "shared", src_id if src_local else None
        else:
            return None
        prefill = prefill_time_ms(costs, request.num_tokens, hit, bs, decode_seqs(w))
        # w's own lower tiers as before; the moved blocks land in its host memory
        load = load_time_ms(costs, TierMatch(m.gpu, m.cpu, m.disk, m.disk), bs)
        load += costs.load_ms("cpu", moved * bs)
        ttft = queue + prefill + load
        if ttft >= score["ttft_ms"]:
            return None
        score.update(ttft_ms=ttft, prefill_ms=prefill, load_ms=load, hit_blocks=hit)
        score["prefetch_blocks"] = moved
        return source, hit, tier
