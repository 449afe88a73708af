"""Session affinity: consistent hashing with bounded load, keyed by the session key.

Each worker owns ``vnodes`` points on a 64-bit ring (xxh3 of ``"<worker>#<i>"``, so
every router replica and process builds the same ring). A session goes to the first
worker clockwise from the hash of its key that is healthy and not overloaded. Removing
a worker only moves the sessions it owned; the rest keep their worker and its cache.

Bounded load (Mirrokni, Thorup, Zadimoghaddam 2018): with ``n`` healthy workers and
``L`` requests in flight, a worker may take the request only if it stays within
``ceil(load_factor * (L + 1) / n)``; a hot session spills to the next worker on the
ring instead of piling onto one. The least-loaded worker always fits, so the walk ends.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Sequence

import xxhash

from .base import Decision, Policy, RouteRequest, WorkerView
from .baselines import LeastLoad
from .selection import healthy

_hash = xxhash.xxh3_64_intdigest


class SessionAffinity(Policy):
    """Consistent hashing with bounded load; requests without a session key go least-load."""

    name = "session_affinity"

    def __init__(
        self, rng: random.Random | None = None, *, load_factor: float = 1.25, vnodes: int = 160
    ) -> None:
        super().__init__(rng)
        if not load_factor >= 1.0:
            raise ValueError(f"session_affinity: load_factor must be >= 1, got {load_factor}")
        if vnodes < 1:
            raise ValueError(f"session_affinity: vnodes must be >= 1, got {vnodes}")
        self.load_factor = load_factor
        self.vnodes = vnodes
        self._members: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []
        self._fallback = LeastLoad(self.rng)

    def _sync_ring(self, workers: Sequence[WorkerView]) -> None:
        """Add newcomers to the ring; keep absent workers' points (skipped at lookup).

        The router leaves unusable workers out of the list, and retries exclude the
        failed one, so the list flaps; rebuilding only on a new id keeps lookups cheap.
        Points of long-gone workers are dropped once they outnumber the present ones.
        """
        members = self._members
        fresh = [w.worker_id for w in workers if w.worker_id not in members]
        if not fresh and len(members) <= 2 * len(workers):
            return
        if len(members) + len(fresh) > 2 * len(workers):
            members = frozenset(w.worker_id for w in workers)
        else:
            members = members.union(fresh)
        self._members = members
        ring = sorted(
            (_hash(f"{wid}#{i}".encode()), wid) for wid in members for i in range(self.vnodes)
        )
        self._points = [p for p, _ in ring]
        self._owners = [wid for _, wid in ring]

    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        cands = healthy(workers)
        key = request.session_key
        if key is None:
            decision = self._fallback.select(request, cands)
            decision.reason = "no session key: least load"
            return decision
        self._sync_ring(workers)
        by_id = {w.worker_id: w for w in cands}
        total = sum(w.inflight_requests for w in cands)
        cap = math.ceil(self.load_factor * (total + 1) / len(cands))
        points, owners = self._points, self._owners
        n = len(points)
        start = bisect_right(points, _hash(key.encode()))
        skipped: set[str] = set()
        for step in range(n):
            w = by_id.get(owners[(start + step) % n])
            if w is None:
                continue
            if w.inflight_requests < cap:
                scores: dict[str, dict[str, float]] = {
                    w.worker_id: {"inflight_requests": w.inflight_requests, "cap": cap}
                }
                reason = f"ring, spilled past {len(skipped)} overloaded" if skipped else "ring"
                return Decision(w.worker_id, scores=scores, reason=reason)
            skipped.add(w.worker_id)
        raise AssertionError("bounded load admits the least-loaded worker")  # pragma: no cover
