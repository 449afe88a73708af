"""The bigram-keyed prefix index: which worker holds which block, in which tier.

Every block key is already a rolling hash of (parent hash, block tokens), so the radix
tree is one flat ``dict``: key -> entry. An entry holds one bitmask of worker slots per
tier, so a prefix match is one probe and one AND per block, and stops at the first
block no remaining candidate holds.

Engines cache prefixes, so a worker holding block ``i`` almost always holds ``0..i-1``;
the match still reports the exact *leading* run per worker (a hole ends it), because
that is what the engine can reuse.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

TIERS: tuple[str, ...] = ("gpu", "cpu", "disk", "shared")
_TIER_POS = {name: pos for pos, name in enumerate(TIERS, start=1)}
# Entry layout: [any_mask, gpu, cpu, disk, shared, last_used_tick]. any_mask is -1
# (every bit set) when the block sits in the shared pool: every worker can reach it.
_ANY, _GPU, _CPU, _DISK, _SHARED, _TICK = range(6)


@dataclass(frozen=True, slots=True)
class TierMatch:
    """Leading blocks a worker can reuse, by the cheapest tiers that cover them.

    Cumulative: ``gpu`` blocks are in GPU memory, ``cpu`` counts blocks in GPU or host
    memory, ``disk`` adds local disk, ``total`` adds the shared pool.
    """

    gpu: int
    cpu: int
    disk: int
    total: int


@dataclass(frozen=True, slots=True)
class IndexStats:
    blocks: int
    speculative: int
    workers: dict[str, dict[str, int]]
    dropped: int
    spec_confirmed: int
    spec_expired: int


class PrefixIndex:
    """Flat hash map of block key -> per-tier worker bitmasks.

    ``max_blocks`` bounds memory: past it, the least recently matched blocks are
    dropped (down to 90 % of the bound) and counted in ``dropped``.
    """

    def __init__(
        self, max_blocks: int | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_blocks = max_blocks
        self.dropped = 0
        self.spec_confirmed = 0
        self.spec_expired = 0
        self._clock = clock
        self._entries: dict[int, list[int]] = {}
        self._tick = 0
        self._slot_of: dict[str, int] = {}
        self._names: list[str | None] = []
        self._free: list[int] = []
        self._live = 0  # bitmask of live worker slots
        self._counts: list[list[int]] = []  # per slot: blocks per tier
        self._spec: dict[int, int] = {}  # block -> mask of predicted holders
        self._spec_expiry: dict[tuple[int, int], float] = {}
        self._spec_heap: list[tuple[float, int, int]] = []

    # -- workers -----------------------------------------------------------------
    @property
    def workers(self) -> list[str]:
        return [n for n in self._names if n is not None]

    def _slot(self, worker_id: str) -> int:
        slot = self._slot_of.get(worker_id)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
            self._names[slot] = worker_id
            self._counts[slot] = [0, 0, 0, 0]
        else:
            slot = len(self._names)
            self._names.append(worker_id)
            self._counts.append([0, 0, 0, 0])
        self._slot_of[worker_id] = slot
        self._live |= 1 << slot
        return slot

    def add_worker(self, worker_id: str) -> None:
        self._slot(worker_id)

    def clear(self, worker_id: str) -> None:
        """Forget every block of ``worker_id`` (engine reset: AllBlocksCleared)."""
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return
        keep = ~(1 << slot)
        dead = []
        for key, e in self._entries.items():
            e[_GPU] &= keep
            e[_CPU] &= keep
            e[_DISK] &= keep
            e[_SHARED] &= keep
            if not self._refresh(e):
                dead.append(key)
        for key in dead:
            del self._entries[key]
        for key in [k for k, m in self._spec.items() if m & ~keep]:
            self._drop_spec(key, slot)
        self._counts[slot] = [0, 0, 0, 0]

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker and its blocks; its slot is reused by the next newcomer."""
        if worker_id not in self._slot_of:
            return
        self.clear(worker_id)
        slot = self._slot_of.pop(worker_id)
        self._names[slot] = None
        self._live &= ~(1 << slot)
        self._free.append(slot)

    # -- events ------------------------------------------------------------------
    def store(self, worker_id: str, hashes: Iterable[int], tier: str = "gpu") -> None:
        """Record that ``worker_id`` holds ``hashes`` (a chain from block 0) in ``tier``."""
        pos = _TIER_POS[tier]
        slot = self._slot(worker_id)
        bit = 1 << slot
        entries = self._entries
        tick = self._tick
        added = 0
        confirm = self._spec
        for h in hashes:
            e = entries.get(h)
            if e is None:
                e = entries[h] = [0, 0, 0, 0, 0, tick]
            if not e[pos] & bit:
                e[pos] |= bit
                added += 1
                e[_ANY] = -1 if e[_SHARED] else e[_GPU] | e[_CPU] | e[_DISK]
            if confirm and confirm.get(h, 0) & bit:
                self._drop_spec(h, slot)
                self.spec_confirmed += 1
        self._counts[slot][pos - 1] += added
        if self.max_blocks is not None and len(entries) > self.max_blocks:
            self._evict(int(self.max_blocks * 0.9))

    def remove(self, worker_id: str, hashes: Iterable[int], tier: str = "gpu") -> None:
        """Record that ``worker_id`` no longer holds ``hashes`` in ``tier``."""
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return
        pos = _TIER_POS[tier]
        bit = 1 << slot
        entries = self._entries
        removed = 0
        for h in hashes:
            e = entries.get(h)
            if e is None or not e[pos] & bit:
                continue
            e[pos] &= ~bit
            removed += 1
            if not self._refresh(e):
                del entries[h]
        self._counts[slot][pos - 1] -= removed

    def holds(self, worker_id: str, block: int, tier: str | None = None) -> bool:
        """Whether ``worker_id`` holds ``block`` (in ``tier``, or in any of its tiers)."""
        slot = self._slot_of.get(worker_id)
        e = self._entries.get(block)
        if slot is None or e is None:
            return False
        mask = e[_TIER_POS[tier]] if tier else e[_GPU] | e[_CPU] | e[_DISK] | e[_SHARED]
        return bool(mask >> slot & 1)

    # -- predict-on-route ---------------------------------------------------------
    def predict(self, worker_id: str, hashes: Sequence[int], ttl: float) -> None:
        """Mark ``hashes`` as probably on ``worker_id`` for ``ttl`` seconds.

        A real BlockStored for the same block confirms the guess; otherwise it expires.
        """
        slot = self._slot(worker_id)
        bit = 1 << slot
        expiry = self._clock() + ttl
        spec = self._spec
        for h in hashes:
            spec[h] = spec.get(h, 0) | bit
            self._spec_expiry[(h, slot)] = expiry
            heapq.heappush(self._spec_heap, (expiry, h, slot))

    def _expire(self) -> None:
        heap = self._spec_heap
        if not heap:
            return
        now = self._clock()
        while heap and heap[0][0] <= now:
            expiry, h, slot = heapq.heappop(heap)
            if self._spec_expiry.get((h, slot)) == expiry:
                self._drop_spec(h, slot)
                self.spec_expired += 1

    def _drop_spec(self, h: int, slot: int) -> None:
        mask = self._spec.get(h, 0) & ~(1 << slot)
        if mask:
            self._spec[h] = mask
        else:
            self._spec.pop(h, None)
        self._spec_expiry.pop((h, slot), None)

    # -- matching ----------------------------------------------------------------
    def match(self, hashes: Sequence[int], *, speculative: bool = True) -> dict[str, int]:
        """Per worker, the number of leading blocks of ``hashes`` it holds in any tier.

        Workers that hold no leading block are left out.
        """
        if speculative and self._spec_heap:
            self._expire()
        spec = self._spec if speculative and self._spec else None
        entries = self._entries
        self._tick += 1
        tick = self._tick
        names = self._names
        active = self._live
        out: dict[str, int] = {}
        depth = 0
        for h in hashes:
            e = entries.get(h)
            if e is None:
                m = 0
            else:
                m = e[_ANY]
                e[_TICK] = tick
            if spec is not None:
                m |= spec.get(h, 0)
            nxt = active & m
            if nxt != active:
                if depth:
                    lost = active ^ nxt
                    while lost:
                        low = lost & -lost
                        out[names[low.bit_length() - 1]] = depth  # type: ignore[index]
                        lost ^= low
                active = nxt
                if not active:
                    return out
            depth += 1
        while active:
            low = active & -active
            out[names[low.bit_length() - 1]] = depth  # type: ignore[index]
            active ^= low
        return out

    def match_tiers(
        self, hashes: Sequence[int], *, speculative: bool = True
    ) -> dict[str, TierMatch]:
        """Per worker, leading blocks by tier (see ``TierMatch``); for the cost model.

        Speculative (predicted) blocks count as GPU hits: the request that caused the
        prediction is about to put them there.
        """
        if speculative and self._spec_heap:
            self._expire()
        spec = self._spec if speculative and self._spec else None
        entries = self._entries
        self._tick += 1
        tick = self._tick
        live = self._live
        a_gpu = a_cpu = a_disk = a_any = live
        d_gpu: dict[int, int] = {}
        d_cpu: dict[int, int] = {}
        d_disk: dict[int, int] = {}
        d_any: dict[int, int] = {}
        depth = 0
        for h in hashes:
            e = entries.get(h)
            s = spec.get(h, 0) if spec is not None else 0
            if e is None:
                m_gpu = m_cpu = m_disk = m_any = s
            else:
                e[_TICK] = tick
                m_gpu = e[_GPU] | s
                m_cpu = m_gpu | e[_CPU]
                m_disk = m_cpu | e[_DISK]
                m_any = e[_ANY] | s
            a_gpu = _narrow(a_gpu, m_gpu, depth, d_gpu)
            a_cpu = _narrow(a_cpu, m_cpu, depth, d_cpu)
            a_disk = _narrow(a_disk, m_disk, depth, d_disk)
            a_any = _narrow(a_any, m_any, depth, d_any)
            if not a_any:
                break
            depth += 1
        for active, record in ((a_gpu, d_gpu), (a_cpu, d_cpu), (a_disk, d_disk), (a_any, d_any)):
            _narrow(active, 0, depth, record)
        names = self._names
        return {
            names[slot]: TierMatch(  # type: ignore[misc]
                d_gpu.get(slot, 0), d_cpu.get(slot, 0), d_disk.get(slot, 0), total
            )
            for slot, total in d_any.items()
        }

    # -- memory ------------------------------------------------------------------
    def _refresh(self, e: list[int]) -> bool:
        """Recompute the any-tier mask; False when no worker holds the block any more."""
        e[_ANY] = -1 if e[_SHARED] else e[_GPU] | e[_CPU] | e[_DISK]
        return bool(e[_ANY])

    def _evict(self, target: int) -> None:
        entries = self._entries
        excess = len(entries) - target
        if excess <= 0:
            return
        victims = heapq.nsmallest(excess, entries.items(), key=lambda kv: kv[1][_TICK])
        counts = self._counts
        for key, e in victims:
            for pos in (_GPU, _CPU, _DISK, _SHARED):
                mask = e[pos]
                while mask:
                    low = mask & -mask
                    counts[low.bit_length() - 1][pos - 1] -= 1
                    mask ^= low
            del entries[key]
        self.dropped += len(victims)

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> IndexStats:
        workers = {
            name: dict(zip(TIERS, self._counts[slot], strict=True))
            for name, slot in self._slot_of.items()
        }
        return IndexStats(
            blocks=len(self._entries),
            speculative=len(self._spec),
            workers=workers,
            dropped=self.dropped,
            spec_confirmed=self.spec_confirmed,
            spec_expired=self.spec_expired,
        )


def _narrow(active: int, mask: int, depth: int, record: dict[int, int]) -> int:
    """AND ``mask`` into ``active``; slots that drop out stop at ``depth`` blocks."""
    nxt = active & mask
    if nxt != active and depth:
        lost = active ^ nxt
        while lost:
            low = lost & -lost
            record[low.bit_length() - 1] = depth
            lost ^= low
    return nxt
