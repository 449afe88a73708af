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

    __slots__ = ("_at", "_blocked", "_pos", "_slots", "_workers", "board", "cap", "index", "keep")

    def __init__(self, index: NativePrefixIndex, keep: int = KEEP, cap: int = TIE_CAP) -> None:
        self.index = index
        self.keep = keep
        self.cap = cap
        self.board = _native.LoadBoard()
        self._workers: list[Worker] = []
        self._at: dict[int, Target] = {}  # board slot (the index's) -> its target
        self._pos: dict[int, int] = {}  # board slot -> place in the candidate order
        self._slots: dict[str, list[int]] = {}  # worker or target name -> board slots
        self._blocked: set[int] = set()  # slots held back: unusable or excluded

    def bind(self, workers: list[Worker]) -> None:
        """Watch ``workers``' targets (done again when the candidate list changes)."""
        board, index = self.board, self.index
        for slot, (_, _, load) in self._at.items():
            board.drop(slot)
            board.block(slot, False)
            load.watch(None)
        self._at, self._pos, self._slots, self._blocked = {}, {}, {}, set()
        for w in workers:
            mine = self._slots.setdefault(w.id, [])
            for tid, load in w.candidates:
                slot = index.slot(tid)
                self._pos[slot] = len(self._at)
                self._at[slot] = (w, tid, load)
                self._slots[tid] = [slot]
                mine.append(slot)
                load.watch(board, slot)
        self._workers = list(workers)

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
        if workers != self._workers:
            self.bind(workers)
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
        also = [s for name in must for s in slots.get(name, ())]
        for _ in range(3):
            picked = self.index.pick(board, hashes, self.keep, self.cap, also)
            bad = [p[0] for p in picked if not at[p[0]][0].usable(now)]
            if not bad:
                break
            for slot in bad:  # a worker down or draining: held back until it is not
                board.block(slot, True)
                blocked.add(slot)
        else:
            return None
        pos = self._pos
        picked.sort(key=lambda p: pos[p[0]])
        return [(at[s], TierMatch(g, c, d, t)) for s, g, c, d, t in picked]
