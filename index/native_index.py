"""``PrefixIndex`` backed by the native core (index/native/, built with the package).

Same interface and semantics as ``index.prefix_index.PrefixIndex`` (the property tests
run against both); the blocks live in C++ hash maps, about a tenth of the bytes per
(block, worker) pair, and the per-block work happens without Python objects. This
wrapper keeps what is cheap and Pythonic: worker names <-> slots, the clock, the result
types.

Workers come in groups of ``GROUP`` (64: a native core's masks are 64-bit words, the
fastest match there is); each group is its own core, made when its first worker comes,
so any number of workers fits (16 engines x 8 DP ranks = 128 index workers is two
groups). A match asks every group; a worker's batch touches only its own group's core,
under that core's lock, so a match still never sees half a batch. Two things are per
group: ``max_blocks`` bounds each group's core (evicting its own LRU leaves), and a block
several groups hold counts once per group in ``len()``/``stats().blocks``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

from index import _native
from index.prefix_index import TIERS, IndexStats, Tier, TierMatch

GROUP: int = _native.MAX_WORKERS
TIER_NUM: dict[Tier, int] = {name: pos for pos, name in enumerate(TIERS)}
_NONE = TierMatch(0, 0, 0, 0)
_NOBODY: frozenset[str] = frozenset()


class NativePrefixIndex:
    """Flat hash maps of 64-bit block key -> per-tier worker bitmasks, in C++.

    Each group's ``_native.Core`` also holds the event path's per-worker engine hash ->
    router hash maps and seq state; ``index.native_ingest`` configures the cores
    (``configure``) and drives them (``locate``).
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
        self.cores: list[_native.Core] = []
        self._setup: list[Callable[[_native.Core], None]] = []
        self._slot_of: dict[str, int] = {}
        self._at: dict[str, tuple[_native.Core, int]] = {}  # worker -> (core, its slot)
        self._names: list[str | None] = []
        self._free: list[int] = []
        self._slots_lock = threading.Lock()
        self._core(0)

    def _core(self, group: int) -> _native.Core:
        while len(self.cores) <= group:
            core = _native.Core(self.max_blocks or 0, self.bisect_min_blocks)
            for setup in self._setup:
                setup(core)
            self.cores.append(core)
        return self.cores[group]

    def configure(self, setup: Callable[[_native.Core], None]) -> None:
        """Run ``setup`` on every core, now and when a group is added."""
        self._setup.append(setup)
        for core in self.cores:
            setup(core)

    def locate(self, worker_id: str) -> tuple[_native.Core, int]:
        """The worker's core and its slot there (given on first sight)."""
        at = self._at.get(worker_id)
        if at is None:
            self.slot(worker_id)
            at = self._at[worker_id]
        return at

    def located(self, worker_id: str) -> tuple[_native.Core, int] | None:
        """``locate`` without giving a slot: None for a worker never seen."""
        return self._at.get(worker_id)

    # -- workers -----------------------------------------------------------------
    @property
    def workers(self) -> list[str]:
        return [n for n in self._names if n is not None]

    def named(self, group: int, mask: int) -> list[str]:
        """The workers of group ``group``'s slots set in ``mask`` (a core's slot mask)."""
        names, base = self._names, group * GROUP
        out: list[str] = []
        while mask:
            low = mask & -mask
            name = names[base + low.bit_length() - 1]
            if name is not None:
                out.append(name)
            mask ^= low
        return out

    def slot_of(self, worker_id: str) -> int | None:
        """The worker's slot, None when it has none yet."""
        return self._slot_of.get(worker_id)

    def slot(self, worker_id: str) -> int:
        """The worker's slot, given on first sight (the event path keys by slot).

        Locked: the ingest thread gives a slot to a worker on its first batch while the
        event loop may add the same worker (config, discovery, admin). Unlocked, both
        could pick a slot and the second overwrote the first, with the batch applied
        there: an applied batch lost, seen as test_attacks_nats timing out ~1 run in 6.
        """
        slot = self._slot_of.get(worker_id)
        if slot is not None:
            return slot
        with self._slots_lock:
            slot = self._slot_of.get(worker_id)
            if slot is not None:
                return slot
            if self._free:
                slot = self._free.pop()
                self._names[slot] = worker_id
            else:
                slot = len(self._names)
                self._core(slot // GROUP)
                self._names.append(worker_id)
            core = (self.cores[slot // GROUP], slot % GROUP)
            core[0].add_slot(core[1])
            self._at[worker_id] = core
            self._slot_of[worker_id] = slot  # last: the unlocked check above reads it
            return slot

    def add_worker(self, worker_id: str) -> None:
        self.slot(worker_id)

    def clear(self, worker_id: str) -> None:
        """Forget every block of ``worker_id`` (engine reset: AllBlocksCleared)."""
        at = self.located(worker_id)
        if at is not None:
            at[0].clear(at[1])

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker and its blocks; its slot is reused by the next newcomer."""
        with self._slots_lock:
            slot = self._slot_of.pop(worker_id, None)
            if slot is None:
                return
            del self._at[worker_id]
            self.cores[slot // GROUP].drop_slot(slot % GROUP)
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
        core, slot = self.locate(worker_id)
        core.store(slot, hashes, TIER_NUM[tier], parent)

    def remove(self, worker_id: str, hashes: Sequence[int], tier: Tier = "gpu") -> None:
        at = self.located(worker_id)
        if at is not None:
            at[0].remove(at[1], hashes, TIER_NUM[tier])

    def holds(self, worker_id: str, block: int, tier: Tier | None = None) -> bool:
        at = self.located(worker_id)
        if at is None:
            return False
        return at[0].holds(at[1], block, TIER_NUM[tier] if tier else -1)

    def predict(self, worker_id: str, hashes: Sequence[int], ttl: float) -> None:
        """Mark the chain ``hashes`` (from block 0) as probably on ``worker_id``."""
        core, slot = self.locate(worker_id)
        core.predict(slot, hashes, self._clock() + ttl)

    # -- matching ----------------------------------------------------------------
    def match(self, hashes: Sequence[int], *, speculative: bool = True) -> dict[str, int]:
        names = self._names
        now = self._clock() if speculative else 0.0
        if len(self.cores) == 1:
            return {names[s]: d for s, d in self.cores[0].match(hashes, speculative, now)}  # type: ignore[misc]
        shared = self._shared(hashes)
        out: dict[str, int] = {}
        for g, core in enumerate(self.cores):
            base = g * GROUP
            for s, d in core.match(hashes, speculative, now, shared):
                out[names[base + s]] = d  # type: ignore[index]
        return out

    def match_tiers(
        self, hashes: Sequence[int], *, speculative: bool = True
    ) -> dict[str, TierMatch]:
        names = self._names
        now = self._clock() if speculative else 0.0
        shared = self._shared(hashes) if len(self.cores) > 1 else None
        out: dict[str, TierMatch] = {}
        for g, core in enumerate(self.cores):
            base = g * GROUP
            for s, gpu, cpu, disk, total in core.match_tiers(hashes, speculative, now, shared):
                out[names[base + s]] = TierMatch(gpu, cpu, disk, total)  # type: ignore[index]
        return out

    def match_of(
        self, worker_id: str, hashes: Sequence[int], *, speculative: bool = True
    ) -> TierMatch:
        """``match_tiers``'s entry for one worker, from its own group's walk alone (a
        wide pool's other groups are not read)."""
        at = self._at.get(worker_id)
        if at is None or not hashes:
            return _NONE
        core, slot = at
        now = self._clock() if speculative else 0.0
        shared = self._shared(hashes) if len(self.cores) > 1 else None
        for s, gpu, cpu, disk, total in core.match_tiers(hashes, speculative, now, shared):
            if s == slot:
                return TierMatch(gpu, cpu, disk, total)
        return _NONE

    def pick(
        self,
        board: _native.LoadBoard,
        hashes: Sequence[int],
        k: int,
        cap: int,
        also: Sequence[int] = (),
    ) -> list[tuple[int, int, int, int, int]]:
        """``board``'s candidates that can win for ``hashes`` (``LoadBoard.pick``, every
        group's walk in one call): (slot, gpu, cpu, disk, total) each."""
        return board.pick(self.cores, hashes, True, self._clock(), k, cap, list(also))

    def out_of_sync(self) -> AbstractSet[str]:
        """The workers whose events are out of sync (``Core.out_of_sync``): every group
        asked in one native call (one a group cost ~4 us a request at 16 groups)."""
        found = _native.out_of_sync_groups(self.cores)
        if not found:
            return _NOBODY
        return {name for g, mask in found for name in self.named(g, mask)}

    @property
    def size(self) -> int:
        """Workers holding a slot."""
        return len(self._slot_of)

    def _shared(self, hashes: Sequence[int]) -> bytes | None:
        """Which of ``hashes`` any group holds in the shared tier (every worker can load
        those), for the other groups' walks; None when no group holds a shared block."""
        flags = [core.shared_at(hashes) for core in self.cores if core.shared_total()]
        if not flags:
            return None
        merged = int.from_bytes(flags[0], "little")
        for f in flags[1:]:
            merged |= int.from_bytes(f, "little")
        return merged.to_bytes(len(hashes), "little")

    # -- stats -------------------------------------------------------------------
    def _counters(self) -> tuple[int, int, int]:
        dropped = confirmed = expired = 0
        for core in self.cores:
            d, c, e = core.counters()
            dropped, confirmed, expired = dropped + d, confirmed + c, expired + e
        return dropped, confirmed, expired

    @property
    def dropped(self) -> int:
        return self._counters()[0]

    @property
    def spec_confirmed(self) -> int:
        return self._counters()[1]

    @property
    def spec_expired(self) -> int:
        return self._counters()[2]

    def memory_bytes(self) -> int:
        """Heap bytes of the index and the per-worker engine-hash maps."""
        return sum(sum(core.bytes()) for core in self.cores)

    def __len__(self) -> int:
        return sum(len(core) for core in self.cores)

    def stats(self) -> IndexStats:
        dropped, confirmed, expired = self._counters()
        workers = {
            name: dict(zip(TIERS, self.cores[slot // GROUP].counts(slot % GROUP), strict=True))
            for name, slot in self._slot_of.items()
        }
        return IndexStats(
            blocks=len(self),
            speculative=sum(core.speculative() for core in self.cores),
            workers=workers,
            dropped=dropped,
            spec_confirmed=confirmed,
            spec_expired=expired,
            workers_with_holes=sum(core.holey() for core in self.cores),
        )
