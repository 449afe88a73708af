"""A wide pool's decision among the few candidates that can win (issue 34 item 5).

Every candidate costs the decision a view and a policy estimate, ~2.3 us a target in
Python (BENCHMARKS.md, the decide step): at 1,024 targets (128 nodes x 8 DP ranks) the
decision took 4.8 ms a request with ``cache_aware`` against 148 us at 16 (33x; 231 us
pruned, 1.6x; ``bench/scale.py --only targets``, 8K-32K-token prompts). Past
``PRUNE_ABOVE`` targets the policy sees only the candidates that can win, chosen natively
(``index/native/candidates.hpp``): the index walk gives each holder's hit per tier; per
class of equal hits, and among the targets holding nothing, a board of load keys
(in-flight requests and their prefill tokens, pushed by ``WorkerLoad`` on every move,
O(1)) keeps the ``KEEP`` least loaded in each of two orders (requests, then tokens: what
``least_load`` orders by; tokens, then requests: the queue a prefill waits behind) and
the whole tie class at the k-th key (up to ``TIE_CAP`` more, else a uniform sample of it).
What the policy must see (``Policy.must_see``: a session's request in flight there, a
hinted target) and every target out of sync are kept whatever their load.

A policy that weighs no hit (``Policy.weighs_hits`` false: ``least_load``) needs no walk
at all: ``Pruner.least`` keeps the pool's least loaded from the board's min trees
(``LoadBoard.least``, O((k + cap) log n): the same k least per order and tie at the k-th
key as among the targets holding nothing above), their views show no match, and
``Router.decide`` looks up the chosen target's alone (``NativePrefixIndex.match_of``, one
group's walk): the hit the router counts for the request is the one every candidate's
views show. Admission's prefix holders (``Gate._saved``) read the kept candidates too
(``Router.views(pruned=True)``): every hit class keeps a member, so the best saving is
every candidate's, and the holder (the first best) is whenever the kept set holds it.

What a pick costs at 1,024 targets (16 index groups). The walk takes each group in turn,
but probes first where the groups before it found their holders' ends (a prefix held in
many groups ends at the same block in each: three probes a group, not a gallop and
bisect's ~16); the holders are grouped by class without sorting them all; the board hands
out the kept slots in candidate order (``LoadBoard.place``, set in ``bind``), so nothing
is sorted here; every group's out-of-sync mask comes in one call
(``NativePrefixIndex.out_of_sync``).

When the decision is the unpruned one. A policy opts in per request (``Policy.prunable``;
plugins and ``sglang_cache_aware`` never do) where each candidate's cost depends only on
its own view and the policy's state; the one pool-wide term a pruned policy reads, the
least hit over the candidates (``cache_aware``'s common prefix), is kept since every class
keeps a member. So whenever the kept set holds the unpruned winner and its whole tie class
(ties break at random over the tie class in candidate order, which the kept set keeps),
the decision, the kept candidates' scores and the policy's state after it are the
unpruned ones: tests/test_prune.py checks this against the unpruned decision on random
pools, loads and holdings for ``least_load``, ``dynamo_kv``, ``cache_aware`` and
``sglang_cache_aware``.

When it can miss. The board orders by those two keys; a policy whose cost weighs load
otherwise (``cache_aware``'s decode streams and engine-reported queue, ``dynamo_kv``'s
active blocks) may rank a member of a class the board cut below the kept ones: the pruned
set then lacks the winner and the policy picks the best kept candidate (a power-of-k
choice among each class's least loaded, never an unusable target; 2 of 288 decisions for
``cache_aware`` in the test, 0 for the others). A tie class larger than ``TIE_CAP`` past
the k is sampled: the choice is a uniform member of it, as unpruned, but another draw.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from index.backend import NATIVE
from index.prefix_index import TierMatch

if NATIVE:
    from index import _native

if TYPE_CHECKING:
    from index.native_index import NativePrefixIndex
    from router.workers.load import WorkerLoad
    from router.workers.registry import Worker

# a native core built before the board (a stale build) routes as before
AVAILABLE = NATIVE and hasattr(_native, "LoadBoard")
PRUNE_ABOVE = 64  # candidates: up to here every one is seen (16 workers: 48 us a decision)
KEEP = 4  # least loaded kept per hit class (and non-holders), in each of two orders
TIE_CAP = 32  # a tie class at the k-th key is kept whole up to this many more

Target = tuple["Worker", str, "WorkerLoad"]


class Pruner:
    """One pool's load board and the map from the index's slots to its targets."""

    __slots__ = ("_at", "_blocked", "_slots", "_workers", "board", "cap", "index", "keep")

    def __init__(self, index: NativePrefixIndex, keep: int = KEEP, cap: int = TIE_CAP) -> None:
        self.index = index
        self.keep = keep
        self.cap = cap
        self.board = _native.LoadBoard()
        self._workers: list[Worker] = []
        self._at: dict[int, Target] = {}  # board slot (the index's) -> its target
        self._slots: dict[str, list[int]] = {}  # worker or target name -> board slots
        self._blocked: set[int] = set()  # slots held back: unusable or excluded

    def bind(self, workers: list[Worker]) -> None:
        """Watch ``workers``' targets (done again when the candidate list changes)."""
        board, index = self.board, self.index
        for slot, (_, _, load) in self._at.items():
            board.drop(slot)
            board.block(slot, False)
            load.watch(None)
        self._at, self._slots, self._blocked = {}, {}, set()
        for w in workers:
            mine = self._slots.setdefault(w.id, [])
            for tid, load in w.candidates:
                slot = index.slot(tid)
                board.place(slot, len(self._at))  # it hands out slots in this order
                self._at[slot] = (w, tid, load)
                self._slots[tid] = [slot]
                mine.append(slot)
                load.watch(board, slot)
        self._workers = list(workers)

    def _ready(
        self, workers: list[Worker], exclude: Collection[str], now: float, must: Collection[str]
    ) -> list[int]:
        """The board made current for this request (what is excluded or unusable held
        back, what is usable again let back); the slots the policy must see."""
        # the registry hands the same list while its membership holds (``for_model``):
        # only a new list is compared, element by element
        if workers is not self._workers and workers != self._workers:
            self.bind(workers)
        self._workers = workers
        board, at, blocked, slots = self.board, self._at, self._blocked, self._slots
        for slot in list(blocked):  # held back before: back once usable and not excluded
            w, tid, _ = at[slot]
            if w.usable(now) and w.id not in exclude and tid not in exclude:
                board.block(slot, False)
                blocked.discard(slot)
        for name in exclude:
            for slot in slots.get(name, ()):
                if slot not in blocked:
                    board.block(slot, True)
                    blocked.add(slot)
        return [s for name in must for s in slots.get(name, ())]

    def _hold_back(self, bad: Sequence[int]) -> None:
        """Picked slots whose worker is down or draining: held back until it is not (the
        caller picks again)."""
        for slot in bad:
            self.board.block(slot, True)
            self._blocked.add(slot)

    def pick(
        self,
        workers: list[Worker],
        hashes: Sequence[int],
        exclude: Collection[str],
        now: float,
        must: Collection[str] = (),
    ) -> list[tuple[Target, TierMatch]] | None:
        """The candidates that can win, with their hits, in candidate order; None when
        too many are unusable to say (the caller sees every one)."""
        also = self._ready(workers, exclude, now, must)
        at = self._at
        for _ in range(3):
            picked = self.index.pick(self.board, hashes, self.keep, self.cap, also)
            out: list[tuple[Target, TierMatch]] = []
            bad = []
            for s, g, c, d, t in picked:  # one pass: each kept one's target, usable
                target = at[s]
                if target[0].usable(now):
                    out.append((target, TierMatch(g, c, d, t)))
                else:
                    bad.append(s)
            if not bad:
                return out
            self._hold_back(bad)
        return None

    def least(
        self,
        workers: list[Worker],
        exclude: Collection[str],
        now: float,
        must: Collection[str] = (),
    ) -> list[Target] | None:
        """For a policy that does not weigh hits (``Policy.weighs_hits``): the pool's least
        loaded, as ``pick`` keeps among the targets holding nothing, without walking the
        index: O(log n) on the board's min trees (``LoadBoard.least``). In candidate
        order; None when too many are unusable to say."""
        also = self._ready(workers, exclude, now, must)
        board, at = self.board, self._at
        for _ in range(3):
            picked = board.least(self.keep, self.cap, also)
            bad = [s for s in picked if not at[s][0].usable(now)]
            if not bad:
                break
            self._hold_back(bad)
        else:
            return None
        return [at[s] for s in picked]
