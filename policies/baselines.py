"""Cache-blind baselines: what a router does when it ignores the KV cache entirely.

They exist for A/B comparison: any cache-aware policy must beat them on hit rate
without losing to them on balance.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .base import Decision, Policy, RouteRequest, WorkerView
from .selection import argmin_random, healthy, load_key


class RoundRobin(Policy):
    """Each request goes to the next healthy worker in turn."""

    name = "round_robin"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._next = 0

    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        cands = healthy(workers)
        i = self._next % len(cands)
        self._next = i + 1
        return Decision(cands[i].worker_id, reason="round robin")


class RandomPolicy(Policy):
    """A uniformly random healthy worker."""

    name = "random"

    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        cands = healthy(workers)
        return Decision(cands[self.rng.randrange(len(cands))].worker_id, reason="random")


def _load_scores(views: Sequence[WorkerView]) -> dict[str, dict[str, float]]:
    return {
        w.worker_id: {
            "inflight_requests": w.inflight_requests,
            "inflight_prefill_tokens": w.inflight_prefill_tokens,
        }
        for w in views
    }


class LeastLoad(Policy):
    """The healthy worker with the fewest in-flight requests (then prefill tokens)."""

    name = "least_load"

    def prunable(self, request: RouteRequest) -> bool:
        return True  # the load board orders by ``load_key``: the winner is always kept

    def weighs_hits(self, request: RouteRequest) -> bool:
        return False  # its choice is the load alone: no candidate's match is looked up

    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        cands = healthy(workers)
        i = argmin_random([load_key(w) for w in cands], self.rng)
        return Decision(cands[i].worker_id, scores=_load_scores(cands), reason="least load")


class PowerOfTwo(Policy):
    """Two random healthy workers; the less loaded one wins (ties at random)."""

    name = "power_of_two"

    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        cands = healthy(workers)
        if len(cands) == 1:
            return Decision(cands[0].worker_id, reason="only candidate")
        a, b = self.rng.sample(cands, 2)
        ka, kb = load_key(a), load_key(b)
        # a tie is a fair coin, not the sample order
        pick = (a if ka < kb else b) if ka != kb else (a if self.rng.random() < 0.5 else b)
        return Decision(pick.worker_id, scores=_load_scores((a, b)), reason="power of two")
