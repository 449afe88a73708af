"""An example cache-router policy: the longest cached prefix, then the fewest in flight.

Deliberately small: it shows the whole interface (``name``, the keyword-only parameters
``policy_params`` can set, ``select`` returning a ``Decision`` with its reason and scores)
and leaves out what the built-in ``cache_aware`` weighs (prefill queues, host-tier load
time, prefetch hints).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import Decision, NoWorkerError, Policy, RouteRequest, WorkerView

__all__ = ["LongestPrefix"]


class LongestPrefix(Policy):
    """The healthy worker with the longest cached prefix; ties to the least loaded."""

    name = "longest_prefix"

    def __init__(self, rng: random.Random | None = None, *, max_inflight: int = 64) -> None:
        super().__init__(rng)
        self.max_inflight = max_inflight

    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            raise NoWorkerError("no healthy worker")
        # a worker past max_inflight is passed over while another has room
        roomy = [w for w in healthy if w.inflight_requests < self.max_inflight] or healthy
        best = max(roomy, key=lambda w: (w.match.total, -w.inflight_requests))
        scores: dict[str, dict[str, float]] = {
            w.worker_id: {"hit_blocks": w.match.total, "inflight": w.inflight_requests}
            for w in healthy
        }
        reason = f"longest_prefix: {best.match.total} of {len(request.block_hashes)} blocks cached"
        return Decision(best.worker_id, scores=scores, reason=reason)
