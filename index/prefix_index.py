"""The bigram-keyed prefix index: which worker holds which block, in which tier.

Every block key is already a rolling hash of (parent hash, block tokens), so the radix
tree is one flat ``dict``: key -> entry. An entry holds one bitmask of worker slots per
tier, so probing block ``i`` of a prompt is one dict lookup, with no walk from the root.

Engines cache prefixes: a worker that holds block ``i`` holds ``0..i-1`` too, unless it
evicted a middle block. The index keeps count of such holes per worker ("orphans":
blocks held whose parent is not). For a worker without orphans, "holds block i" is
monotone along a prompt, so its match depth is found by bisection over depth, a few
probes instead of one per block; workers with holes (and short prompts) take the exact
linear walk with early exit. Both report the exact *leading* run per worker, because
that is what the engine can reuse.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

# Where a block sits: an engine's GPU, its host memory, its disk, or a pool every worker
# reaches (e.g. LMCache / Mooncake store).
Tier = Literal["gpu", "cpu", "disk", "shared"]
TIERS: tuple[Tier, ...] = ("gpu", "cpu", "disk", "shared")
_TIER_POS = {name: pos for pos, name in enumerate(TIERS, start=1)}
# Entry layout: [any_mask, gpu, cpu, disk, shared, last_used_tick, parent_key]. any_mask
# is -1 (every bit set) when the block sits in the shared pool: every worker reaches it.
_ANY, _GPU, _CPU, _DISK, _SHARED, _TICK, _PARENT = range(7)
_SLOT_SHIFT = 64  # kid-count keys are (slot << 64) | block key; block keys are 64-bit


@dataclass(slots=True, unsafe_hash=True)
class TierMatch:
    """Leading blocks a worker can reuse, by the cheapest tiers that cover them.

    Cumulative: ``gpu`` blocks are in GPU memory, ``cpu`` counts blocks in GPU or host
    memory, ``disk`` adds local disk, ``total`` adds the shared pool.

    Read-only by its ``Final`` fields (mypy refuses an assignment), not by ``frozen``:
    a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``
    (a loop making 16: 9.2 us frozen, 2.7 plain), and every request makes one per
    matched worker (``match_tiers`` at 16 workers 10.1 -> 4.5 us, BENCHMARKS.md session
    13). A NamedTuple is as cheap to make but slower to read (90 against 49 ns for four
    fields, and ``select`` reads them per candidate), and orjson hands a tuple subclass
    to ``default`` where it writes a dataclass as an object. So it stays a dataclass:
    the admin API's JSON and ``dataclasses.asdict`` are as before, and it hashes by its
    fields as the frozen one did.
    """

    gpu: Final[int]
    cpu: Final[int]
    disk: Final[int]
    total: Final[int]


@dataclass(frozen=True, slots=True)
class IndexStats:
    blocks: int
    speculative: int
    workers: dict[str, dict[Tier, int]]
    dropped: int
    spec_confirmed: int
    spec_expired: int
    workers_with_holes: int


class PrefixIndex:
    """Flat hash map of 64-bit block key -> per-tier worker bitmasks.

    ``max_blocks`` bounds memory: past it, the least recently matched blocks (leaves
    first, so no holes are made) are dropped down to 90 % of the bound and counted in
    ``dropped``. Prompts shorter than ``bisect_min_blocks`` are matched linearly,
    where bisection saves nothing.
    """

    def __init__(
        self,
        max_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        bisect_min_blocks: int = 24,
    ) -> None:
        self.max_blocks = max_blocks
        self.bisect_min_blocks = bisect_min_blocks
        self.dropped = 0
        self.spec_confirmed = 0
        self.spec_expired = 0
        self._clock = clock
        self._entries: dict[int, list[Any]] = {}  # ints, but a root block's parent is None
        self._kids: dict[int, int] = {}  # (slot << 64 | key) -> children of key held by slot
        self._tick = 0
        self._slot_of: dict[str, int] = {}
        self._names: list[str | None] = []
        self._free: list[int] = []
        self._live = 0  # bitmask of live worker slots
        self._holey = 0  # bitmask of slots with orphans
        self._orphans: list[int] = []
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
        else:
            slot = len(self._names)
            self._names.append(worker_id)
            self._counts.append([0, 0, 0, 0])
            self._orphans.append(0)
        self._counts[slot] = [0, 0, 0, 0]
        self._orphans[slot] = 0
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
        bit = 1 << slot
        if not any(self._counts[slot]):  # holds nothing: no block to scan for (spam costs O(1))
            for key in [k for k, m in self._spec.items() if m & bit]:
                self._drop_spec(key, slot)
            self._set_orphans(slot, 0)
            return
        keep = ~bit
        dead = []
        for key, e in self._entries.items():
            if (e[_GPU] | e[_CPU] | e[_DISK] | e[_SHARED]) & bit:
                e[_GPU] &= keep
                e[_CPU] &= keep
                e[_DISK] &= keep
                e[_SHARED] &= keep
                if not self._refresh(e):
                    dead.append(key)
        for key in dead:
            del self._entries[key]
        low = slot << _SLOT_SHIFT
        high = (slot + 1) << _SLOT_SHIFT
        for k in [k for k in self._kids if low <= k < high]:
            del self._kids[k]
        for key in [k for k, m in self._spec.items() if m & bit]:
            self._drop_spec(key, slot)
        self._counts[slot] = [0, 0, 0, 0]
        self._set_orphans(slot, 0)

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
    def store(
        self,
        worker_id: str,
        hashes: Sequence[int],
        tier: Tier = "gpu",
        parent: int | None = None,
    ) -> None:
        """Record that ``worker_id`` holds the chain ``hashes`` in ``tier``.

        ``parent`` is the block before ``hashes[0]`` (None: ``hashes[0]`` is block 0).
        """
        pos = _TIER_POS[tier]
        slot = self._slot(worker_id)
        bit = 1 << slot
        base = slot << _SLOT_SHIFT
        entries = self._entries
        kids = self._kids
        spec = self._spec
        tick = self._tick
        added = 0
        orphans = 0
        # Only the first block's parent can be missing: each later one's parent is the
        # block stored just before it.
        parent_held = parent is None or self._held_by(parent, bit)
        for h in hashes:
            e = entries.get(h)
            if e is None:
                e = entries[h] = [0, 0, 0, 0, 0, tick, parent]
            elif e[pos] & bit:
                parent, parent_held = h, True
                continue
            held = (e[_GPU] | e[_CPU] | e[_DISK] | e[_SHARED]) & bit
            e[pos] |= bit
            added += 1
            e[_ANY] = -1 if e[_SHARED] else e[_GPU] | e[_CPU] | e[_DISK]
            if not held:
                # Its held children stop being orphans; it may be one itself.
                orphans -= kids.get(base | h, 0)
                p = e[_PARENT]
                if p is not None:
                    kids[base | p] = kids.get(base | p, 0) + 1
                    if not (parent_held if p == parent else self._held_by(p, bit)):
                        orphans += 1
                if spec and spec.get(h, 0) & bit:
                    self.spec_confirmed += 1
            parent, parent_held = h, True
        if orphans:
            self._set_orphans(slot, self._orphans[slot] + orphans)
        self._counts[slot][pos - 1] += added
        if self.max_blocks is not None and len(entries) > self.max_blocks:
            self._evict(int(self.max_blocks * 0.9))

    def remove(self, worker_id: str, hashes: Sequence[int], tier: Tier = "gpu") -> None:
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
            if not (e[_GPU] | e[_CPU] | e[_DISK] | e[_SHARED]) & bit:
                self._unhold(h, e, slot)
            if not self._refresh(e):
                del entries[h]
        self._counts[slot][pos - 1] -= removed

    def holds(self, worker_id: str, block: int, tier: Tier | None = None) -> bool:
        """Whether ``worker_id`` holds ``block`` (in ``tier``, or in any of its tiers)."""
        slot = self._slot_of.get(worker_id)
        e = self._entries.get(block)
        if slot is None or e is None:
            return False
        mask = e[_TIER_POS[tier]] if tier else e[_GPU] | e[_CPU] | e[_DISK] | e[_SHARED]
        return bool(mask >> slot & 1)

    # -- hole accounting -----------------------------------------------------------
    def _held_by(self, key: int | None, bit: int) -> bool:
        e = self._entries.get(key) if key is not None else None
        return e is not None and bool((e[_GPU] | e[_CPU] | e[_DISK] | e[_SHARED]) & bit)

    def _unhold(self, key: int, e: list[int], slot: int) -> None:
        """``slot`` no longer holds ``key`` in any tier: its held children become
        orphans, and it stops being one (the reverse of what ``store`` does)."""
        kids = self._kids
        base = slot << _SLOT_SHIFT
        delta = kids.get(base | key, 0)  # its held children become orphans
        p = e[_PARENT]
        if p is not None:
            k = base | p
            left = kids.get(k, 0) - 1
            if left > 0:
                kids[k] = left
            else:
                kids.pop(k, None)
            if not self._held_by(p, 1 << slot):
                delta -= 1
        if delta:
            self._set_orphans(slot, self._orphans[slot] + delta)

    def _set_orphans(self, slot: int, n: int) -> None:
        self._orphans[slot] = n
        if n:
            self._holey |= 1 << slot
        else:
            self._holey &= ~(1 << slot)

    # -- predict-on-route ---------------------------------------------------------
    def predict(self, worker_id: str, hashes: Sequence[int], ttl: float) -> None:
        """Mark the chain ``hashes`` (from block 0) as probably on ``worker_id``.

        The mark lasts ``ttl`` seconds; a real BlockStored in that time confirms it.
        Marks are per chain from block 0 and a block's mark lasts at least as long as
        its descendants', so predictions never make holes.
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
        now = self._clock()
        while heap and heap[0][0] <= now:
            expiry, h, slot = heapq.heappop(heap)
            if self._spec_expiry.get((h, slot)) == expiry:
                if not self._held_by(h, 1 << slot):
                    self.spec_expired += 1
                self._drop_spec(h, slot)

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
        names = self._names
        return {names[s]: d for s, d in self._depths(hashes, speculative).items()}  # type: ignore[misc]

    def match_tiers(
        self, hashes: Sequence[int], *, speculative: bool = True
    ) -> dict[str, TierMatch]:
        """Per worker, leading blocks by tier (see ``TierMatch``); for the cost model.

        Speculative (predicted) blocks count as GPU hits: the request that caused the
        prediction is about to put them there.
        """
        depths = self._depths(hashes, speculative)
        if not depths:
            return {}
        names = self._names
        out: dict[str, TierMatch] = {}
        split = 0  # slots whose hit may span tiers: only those need a per-tier walk
        limit = 0
        counts = self._counts
        shared = self._shared_blocks()
        for slot, d in depths.items():
            c = counts[slot]
            if not shared and not c[1] and not c[2]:
                out[names[slot]] = TierMatch(d, d, d, d)  # type: ignore[index]
            else:
                split |= 1 << slot
                limit = max(limit, d)
        if split:
            spec = self._spec if speculative and self._spec else None
            tiers = self._walk_tiers(hashes, split, limit, spec)
            for slot, (g, gc, gck) in tiers.items():
                out[names[slot]] = TierMatch(g, gc, gck, depths[slot])  # type: ignore[index]
        return out

    def _shared_blocks(self) -> int:
        return sum(c[3] for c in self._counts)

    def _depths(self, hashes: Sequence[int], speculative: bool) -> dict[int, int]:
        if speculative and self._spec_heap:
            self._expire()
        spec = self._spec if speculative and self._spec else None
        self._tick += 1
        out: dict[int, int] = {}
        live = self._live
        if len(hashes) < self.bisect_min_blocks or self._shared_blocks():
            self._walk(hashes, live, spec, out)
            return out
        fast = live & ~self._holey
        if fast:
            self._bisect(hashes, fast, spec, out)
        if live & self._holey:
            self._walk(hashes, live & self._holey, spec, out)
        return out

    def _walk(
        self, hashes: Sequence[int], active: int, spec: dict[int, int] | None, out: dict[int, int]
    ) -> None:
        """Exact leading runs for the slots in ``active``: one probe per block, early exit."""
        entries = self._entries
        tick = self._tick
        depth = 0
        # The probe is ``_bisect``'s ``holders`` written inline: a call per block would
        # cost this loop about a quarter more.
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
                    _record(active ^ nxt, depth, out)
                active = nxt
                if not active:
                    return
            depth += 1
        _record(active, depth, out)

    def _bisect(
        self, hashes: Sequence[int], active: int, spec: dict[int, int] | None, out: dict[int, int]
    ) -> None:
        """Leading runs for hole-free slots: gallop forward, then bisect.

        For these slots the holders of block i shrink as i grows. Probing blocks 0, 1,
        3, 7, ... finds a cold prompt in one probe and a depth d in O(log d); an
        interval whose ends have the same holders needs no probe inside it.
        """
        entries = self._entries
        tick = self._tick
        n = len(hashes)

        def holders(i: int, among: int) -> int:
            h = hashes[i]
            e = entries.get(h)
            if e is None:
                m = 0
            else:
                m = e[_ANY]
                e[_TICK] = tick
            if spec is not None:
                m |= spec.get(h, 0)
            return m & among

        pending: list[tuple[int, int, int, int]] = []  # (lo, hi, holders at lo, at hi)
        lo, at_lo, pos, step = -1, active, 0, 1
        while at_lo:
            if pos >= n:
                pending.append((lo, n, at_lo, 0))
                break
            m = holders(pos, at_lo)
            if m != at_lo:
                pending.append((lo, pos, at_lo, m))
            lo, at_lo, pos, step = pos, m, pos + step, step * 2
        while pending:
            lo, hi, at_lo, at_hi = pending.pop()
            if hi - lo == 1:
                if hi:
                    _record(at_lo & ~at_hi, hi, out)
                continue
            mid = (lo + hi) >> 1
            m = holders(mid, at_lo)
            if m != at_hi:
                pending.append((mid, hi, m, at_hi))
            if m != at_lo:
                pending.append((lo, mid, at_lo, m))

    def _walk_tiers(
        self, hashes: Sequence[int], active: int, limit: int, spec: dict[int, int] | None
    ) -> dict[int, tuple[int, int, int]]:
        """Per slot in ``active``: leading blocks in gpu, gpu+cpu, gpu+cpu+disk."""
        entries = self._entries
        a_gpu = a_cpu = a_disk = active
        d_gpu: dict[int, int] = {}
        d_cpu: dict[int, int] = {}
        d_disk: dict[int, int] = {}
        depth = 0
        for h in hashes[:limit]:
            e = entries.get(h)
            s = spec.get(h, 0) if spec is not None else 0
            if e is None and not s:
                break
            if e is None:
                m_gpu = m_cpu = m_disk = s
            else:
                m_gpu = e[_GPU] | s
                m_cpu = m_gpu | e[_CPU]
                m_disk = m_cpu | e[_DISK]
            if a_disk & m_disk != a_disk:
                if depth:
                    _record(a_disk & ~m_disk, depth, d_disk)
                a_disk &= m_disk
                if not a_disk:
                    break
            if a_cpu & m_cpu != a_cpu:
                if depth:
                    _record(a_cpu & ~m_cpu, depth, d_cpu)
                a_cpu &= m_cpu
            if a_gpu & m_gpu != a_gpu:
                if depth:
                    _record(a_gpu & ~m_gpu, depth, d_gpu)
                a_gpu &= m_gpu
            depth += 1
        for a, d in ((a_gpu, d_gpu), (a_cpu, d_cpu), (a_disk, d_disk)):
            if depth:
                _record(a, depth, d)
        return {
            slot: (d_gpu.get(slot, 0), d_cpu.get(slot, 0), d_disk.get(slot, 0))
            for slot in _slots(active)
        }

    # -- memory ------------------------------------------------------------------
    def _refresh(self, e: list[int]) -> bool:
        """Recompute the any-tier mask; False when no worker holds the block any more."""
        e[_ANY] = -1 if e[_SHARED] else e[_GPU] | e[_CPU] | e[_DISK]
        return bool(e[_GPU] | e[_CPU] | e[_DISK] | e[_SHARED])

    def _is_leaf(self, key: int, e: list[int]) -> bool:
        kids = self._kids
        holders = e[_GPU] | e[_CPU] | e[_DISK] | e[_SHARED]
        return not any((slot << _SLOT_SHIFT | key) in kids for slot in _slots(holders))

    def _evict(self, target: int) -> None:
        """Drop least recently matched blocks down to ``target``, leaves first: one scan
        for the leaves, then a heap by (tick, key) that a parent joins when its last
        held child goes. Each round used to rescan every block and take the leaves of
        that moment only, so a chain (one leaf) cost a scan per block: O(excess x N)."""
        entries = self._entries
        while len(entries) > target:
            heap = [(e[_TICK], k) for k, e in entries.items() if self._is_leaf(k, e)]
            leaves = bool(heap)
            if not leaves:  # every block has a held child: a cycle of crafted hashes
                heap = [(e[_TICK], k) for k, e in entries.items()]
            heapq.heapify(heap)
            taken = 0
            while len(entries) > target and heap:
                _, key = heapq.heappop(heap)
                e = entries.get(key)
                if e is None:
                    continue
                p = e[_PARENT]
                parent = None if p is None else entries.get(p)
                was_leaf = parent is None or self._is_leaf(p, parent)
                for pos in (_GPU, _CPU, _DISK, _SHARED):
                    for slot in _slots(e[pos]):
                        self._counts[slot][pos - 1] -= 1
                for slot in _slots(e[_GPU] | e[_CPU] | e[_DISK] | e[_SHARED]):
                    self._unhold(key, e, slot)
                del entries[key]
                taken += 1
                if (
                    leaves
                    and parent is not None
                    and not was_leaf
                    and p in entries
                    and self._is_leaf(p, parent)
                ):
                    heapq.heappush(heap, (parent[_TICK], p))
            self.dropped += taken

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
            workers_with_holes=self._holey.bit_count(),
        )


def _slots(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _record(mask: int, depth: int, out: dict[int, int]) -> None:
    while mask:
        low = mask & -mask
        out[low.bit_length() - 1] = depth
        mask ^= low
