"""How many requests each engine takes before it queues, learnt from what it reports.

An engine that reports requests waiting is full: the requests it runs at that moment
are as many as it can run (``max_num_seqs``, or as many as its KV cache holds). That
number is its limit. An engine that runs more than its limit without anyone waiting
shows the limit was low (its prompts got shorter, its cache emptied) and raises it. An
engine that never reported anyone waiting has no limit: the router holds nothing for
it, so traffic that never saturates an engine never waits at the router.

A worker is open while the router's in-flight requests on it are below its limit plus
``engine_queue`` (requests allowed to wait in the engine, so a slot freed there is
filled without a round trip through the router; with at least one the limit can also
rise, since the engine is offered more than its limit).

``max_inflight`` fixes every limit instead (engines that report no load).
"""

from __future__ import annotations

import math

# How much a new interval between two ends on a worker moves its average: about the
# last eight, enough to follow a load change within a second at mock-engine rates.
_ALPHA = 0.125


class Capacity:
    """Per-worker limits and the pace at which their slots free; plain and synchronous."""

    __slots__ = ("_freed_at", "_interval", "_limits", "engine_queue", "max_inflight")

    def __init__(self, engine_queue: int = 1, max_inflight: int | None = None) -> None:
        if engine_queue < 0 or (max_inflight is not None and max_inflight < 1):
            raise ValueError("engine_queue must be >= 0 and max_inflight >= 1")
        self.engine_queue = engine_queue
        self.max_inflight = max_inflight
        self._limits: dict[str, int] = {}
        self._freed_at: dict[str, float] = {}
        self._interval: dict[str, float] = {}  # seconds between two slots freeing

    def limit(self, worker: str) -> int | None:
        """Requests the worker runs before it queues (None: never seen full)."""
        return self.max_inflight if self.max_inflight is not None else self._limits.get(worker)

    def report(self, worker: str, running: int | None, waiting: int | None) -> bool:
        """An engine's load report; whether the worker's limit changed."""
        if running is None or waiting is None:
            return False
        old = self._limits.get(worker)
        if waiting > 0:
            new = max(1, running)
        elif old is not None and running > old:
            new = running
        else:
            return False
        self._limits[worker] = new
        return new != old

    def room(self, worker: str, inflight: int) -> int:
        """Requests the worker can take now (a large number without a limit)."""
        limit = self.limit(worker)
        if limit is None:
            return 1 << 30
        return limit + self.engine_queue - inflight

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
        for table in (self._limits, self._freed_at, self._interval):
            table.pop(worker, None)

    def snapshot(self, worker: str) -> dict[str, float | int | None]:
        interval = self._interval.get(worker)
        return {"limit": self.limit(worker), "free_every_s": interval}
