"""``PrefixIndex`` backed by the native core (index/native/, built with the package).

Same interface and semantics as ``index.prefix_index.PrefixIndex`` (the property tests
run against both); the blocks live in C++ hash maps, about a tenth of the bytes per
(block, worker) pair, and the per-block work happens without Python objects. This
wrapper keeps what is cheap and Pythonic: worker names <-> slots, the clock, the result
types. At most 64 workers (``MAX_WORKERS``) per index: the masks are 64-bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from index import _native
from index.prefix_index import TIERS, IndexStats, Tier, TierMatch

MAX_WORKERS: int = _native.MAX_WORKERS
TIER_NUM: dict[Tier, int] = {name: pos for pos, name in enumerate(TIERS)}


class NativePrefixIndex:
    """Flat hash map of 64-bit block key -> per-tier worker bitmasks, in C++.

    ``core`` also holds the event path's per-worker engine hash -> router hash maps;
    ``index.ingest.EventIngest`` configures it with its hasher and drives it.
    """

    def __init__(
        self,
        max_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        bisect_min_blocks: int = 24,
    ) -> None:
        self.max_blocks = max_blocks
        self.bisect_min_blocks = bisect_min_blocks
        self._clock = clock
        self.core = _native.Core(max_blocks or 0, bisect_min_blocks)
        self._slot_of: dict[str, int] = {}
        self._names: list[str | None] = []
        self._free: list[int] = []

    # -- workers -----------------------------------------------------------------
    @property
    def workers(self) -> list[str]:
        return [n for n in self._names if n is not None]

    def slot_of(self, worker_id: str) -> int | None:
        """The worker's slot, None when it has none yet."""
        return self._slot_of.get(worker_id)

    def slot(self, worker_id: str) -> int:
        """The worker's slot, given on first sight (the event path keys by slot)."""
        slot = self._slot_of.get(worker_id)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
            self._names[slot] = worker_id
        else:
            slot = len(self._names)
            if slot >= MAX_WORKERS:
                raise ValueError(f"the native index holds at most {MAX_WORKERS} workers")
            self._names.append(worker_id)
        self._slot_of[worker_id] = slot
        self.core.add_slot(slot)
        return slot

    def add_worker(self, worker_id: str) -> None:
        self.slot(worker_id)

    def clear(self, worker_id: str) -> None:
        """Forget every block of ``worker_id`` (engine reset: AllBlocksCleared)."""
        slot = self._slot_of.get(worker_id)
        if slot is not None:
            self.core.clear(slot)

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker and its blocks; its slot is reused by the next newcomer."""
        slot = self._slot_of.pop(worker_id, None)
        if slot is None:
            return
        self.core.drop_slot(slot)
        self._names[slot] = None
        self._free.append(slot)

    # -- events ------------------------------------------------------------------
    def store(
        self,
        worker_id: str,
        hashes: Sequence[int],
        tier: Tier = "gpu",
        parent: int | None = None,
    ) -> None:
        """Record that ``worker_id`` holds the chain ``hashes`` in ``tier``."""
        self.core.store(self.slot(worker_id), hashes, TIER_NUM[tier], parent)

    def remove(self, worker_id: str, hashes: Sequence[int], tier: Tier = "gpu") -> None:
        slot = self._slot_of.get(worker_id)
        if slot is not None:
            self.core.remove(slot, hashes, TIER_NUM[tier])

    def holds(self, worker_id: str, block: int, tier: Tier | None = None) -> bool:
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return False
        return self.core.holds(slot, block, TIER_NUM[tier] if tier else -1)

    def predict(self, worker_id: str, hashes: Sequence[int], ttl: float) -> None:
        """Mark the chain ``hashes`` (from block 0) as probably on ``worker_id``."""
        self.core.predict(self.slot(worker_id), hashes, self._clock() + ttl)

    # -- matching ----------------------------------------------------------------
    def match(self, hashes: Sequence[int], *, speculative: bool = True) -> dict[str, int]:
        names = self._names
        now = self._clock() if speculative else 0.0
        return {names[s]: d for s, d in self.core.match(hashes, speculative, now)}  # type: ignore[misc]

    def match_tiers(
        self, hashes: Sequence[int], *, speculative: bool = True
    ) -> dict[str, TierMatch]:
        names = self._names
        now = self._clock() if speculative else 0.0
        return {
            names[s]: TierMatch(g, c, k, t)  # type: ignore[misc]
            for s, g, c, k, t in self.core.match_tiers(hashes, speculative, now)
        }

    # -- stats -------------------------------------------------------------------
    @property
    def dropped(self) -> int:
        return self.core.counters()[0]

    @property
    def spec_confirmed(self) -> int:
        return self.core.counters()[1]

    @property
    def spec_expired(self) -> int:
        return self.core.counters()[2]

    def memory_bytes(self) -> int:
        """Heap bytes of the index and the per-worker engine-hash maps."""
        return sum(self.core.bytes())

    def __len__(self) -> int:
        return len(self.core)

    def stats(self) -> IndexStats:
        dropped, confirmed, expired = self.core.counters()
        workers = {
            name: dict(zip(TIERS, self.core.counts(slot), strict=True))
            for name, slot in self._slot_of.items()
        }
        return IndexStats(
            blocks=len(self.core),
            speculative=self.core.speculative(),
            workers=workers,
            dropped=dropped,
            spec_confirmed=confirmed,
            spec_expired=expired,
            workers_with_holes=self.core.holey(),
        )
