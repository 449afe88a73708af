"""PrefixIndex against a brute-force reference model, plus bounds and predictions."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index import TIERS, PrefixIndex, TierMatch
from index.backend import IMPLEMENTATIONS

# Every test runs against the Python index and the native one (when built).
pytestmark = pytest.mark.parametrize("Index", IMPLEMENTATIONS)

WORKERS = ["w0", "w1", "w2", "w3"]
# A small universe of chains: blocks are (chain, depth) so chains share prefixes.
CHAINS = [[10, 11, 12, 13, 14], [10, 11, 22, 23], [30, 31, 32], [10, 41]]


@dataclass
class Reference:
    held: dict[str, dict[str, set[int]]] = field(default_factory=dict)

    def store(self, w: str, hashes: list[int], tier: str) -> None:
        self.held.setdefault(w, {t: set() for t in TIERS})[tier].update(hashes)

    def remove(self, w: str, hashes: list[int], tier: str) -> None:
        if w in self.held:
            self.held[w][tier].difference_update(hashes)

    def clear(self, w: str) -> None:
        if w in self.held:
            self.held[w] = {t: set() for t in TIERS}

    def remove_worker(self, w: str) -> None:
        self.held.pop(w, None)

    def _shared(self) -> set[int]:
        return set().union(*(tiers["shared"] for tiers in self.held.values()))

    def depth(self, w: str, hashes: list[int], tiers: tuple[str, ...], shared: bool) -> int:
        have = set().union(*(self.held[w][t] for t in tiers))
        if shared:
            have |= self._shared()
        n = 0
        for h in hashes:
            if h not in have:
                break
            n += 1
        return n

    def match(self, hashes: list[int]) -> dict[str, int]:
        out = {w: self.depth(w, hashes, TIERS, True) for w in self.held}
        return {w: d for w, d in out.items() if d}

    def match_tiers(self, hashes: list[int]) -> dict[str, TierMatch]:
        out = {}
        for w, total in self.match(hashes).items():
            out[w] = TierMatch(
                self.depth(w, hashes, ("gpu",), False),
                self.depth(w, hashes, ("gpu", "cpu"), False),
                self.depth(w, hashes, ("gpu", "cpu", "disk"), False),
                total,
            )
        return out


def chain_slice(c: int, lo: int, hi: int) -> tuple[list[int], int | None]:
    """A piece of chain ``c`` and the parent of its first block."""
    lo, hi = min(lo, hi), max(lo, hi)
    chain = CHAINS[c]
    lo = min(lo, len(chain) - 1)
    return chain[lo : hi + 1], chain[lo - 1] if lo else None


slices = st.builds(
    chain_slice,
    st.integers(0, len(CHAINS) - 1),
    st.integers(0, 4),
    st.integers(0, 4),
)


def ops_on(workers: list[str]) -> st.SearchStrategy[tuple]:
    return st.one_of(
        st.tuples(st.just("store"), st.sampled_from(workers), slices, st.sampled_from(TIERS)),
        st.tuples(st.just("remove"), st.sampled_from(workers), slices, st.sampled_from(TIERS)),
        st.tuples(st.just("clear"), st.sampled_from(workers)),
        st.tuples(st.just("remove_worker"), st.sampled_from(workers)),
    )


ops = ops_on(WORKERS)
# More workers than one 64-bit mask holds (16 engines x 8 DP ranks = 128 index workers):
# the native index spreads them over groups of 64; these sit on both sides of the cuts.
MANY = [f"m{i}" for i in range(130)]
WIDE = ["m0", "m63", "m64", "m127", "m128", "m129"]


def apply(index: PrefixIndex, ref: Reference, steps: list[tuple]) -> None:
    for op, *args in steps:
        if op == "store":
            worker, (hashes, parent), tier = args
            index.store(worker, hashes, tier, parent=parent)
            ref.store(worker, hashes, tier)
        elif op == "remove":
            worker, (hashes, _), tier = args
            index.remove(worker, hashes, tier)
            ref.remove(worker, hashes, tier)
        else:
            getattr(index, op)(*args)
            getattr(ref, op)(*args)


@settings(max_examples=400, deadline=None)
@given(st.lists(ops, max_size=40), st.sampled_from([1, 24]))
def test_match_equals_reference(Index, steps: list[tuple], bisect_min: int) -> None:
    index, ref = Index(bisect_min_blocks=bisect_min), Reference()
    apply(index, ref, steps)
    for chain in CHAINS:
        for cut in range(len(chain) + 1):
            query = [*chain[:cut], 99]
            assert index.match(query) == ref.match(query), (steps, query)
            assert index.match_tiers(query) == ref.match_tiers(query), (steps, query)
    counts = index.stats().workers
    for w, tiers in ref.held.items():
        # Blocks with no holder left are dropped, so counts equal the reference sets.
        assert counts[w] == {t: len(s) for t, s in tiers.items()}


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(ops_on(WIDE), max_size=40), st.sampled_from([1, 24]))
def test_more_than_64_workers_match_equals_reference(
    Index, steps: list[tuple], bisect_min: int
) -> None:
    index, ref = Index(bisect_min_blocks=bisect_min), Reference()
    for w in MANY:
        index.add_worker(w)
        ref.held[w] = {t: set() for t in TIERS}  # shared blocks count for it too
    apply(index, ref, steps)
    for chain in CHAINS:
        for cut in range(len(chain) + 1):
            query = [*chain[:cut], 99]
            assert index.match(query) == ref.match(query), (steps, query)
            assert index.match_tiers(query) == ref.match_tiers(query), (steps, query)
    counts = index.stats().workers
    for w, tiers in ref.held.items():
        assert counts[w] == {t: len(s) for t, s in tiers.items()}


def test_hole_ends_the_match(Index) -> None:
    index = Index()
    index.store("a", [1, 2, 3, 4])
    index.remove("a", [2])
    assert index.match([1, 2, 3, 4]) == {"a": 1}


def test_lower_tiers_count_in_match_and_split_in_match_tiers(Index) -> None:
    index = Index()
    index.store("a", [1, 2])
    index.store("a", [3], "cpu")
    index.store("a", [4], "disk")
    index.store("pool", [5], "shared")
    assert index.match([1, 2, 3, 4, 5, 6]) == {"a": 5}
    tiers = index.match_tiers([1, 2, 3, 4, 5, 6])
    assert tiers["a"] == TierMatch(gpu=2, cpu=3, disk=4, total=5)


def test_memory_bound_drops_least_recently_matched(Index) -> None:
    index = Index(max_blocks=100)
    index.store("a", list(range(60)))
    index.match(list(range(10)))  # the first ten are now the most recently used
    index.store("b", list(range(1000, 1060)))
    assert len(index) <= 100
    assert index.dropped >= 20
    assert index.match(list(range(10))) == {"a": 10}
    assert sum(sum(c.values()) for c in index.stats().workers.values()) == len(index)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_predictions_expire_or_are_confirmed(Index) -> None:
    clock = Clock()
    index = Index(clock=clock)
    index.add_worker("a")
    index.predict("a", [1, 2, 3], ttl=2.0)
    assert index.match([1, 2, 3]) == {"a": 3}
    assert index.match([1, 2, 3], speculative=False) == {}
    assert index.match_tiers([1, 2, 3])["a"] == TierMatch(3, 3, 3, 3)
    index.store("a", [1, 2])  # the engine confirms two of them
    assert index.spec_confirmed == 2
    index.store("a", [1, 2], "cpu")  # a second tier is no second confirmation
    assert index.spec_confirmed == 2
    clock.now = 5.0
    assert index.match([1, 2, 3]) == {"a": 2}
    assert index.spec_expired == 1  # block 3 was never confirmed
    assert index.stats().speculative == 0


def test_re_prediction_extends_the_ttl(Index) -> None:
    clock = Clock()
    index = Index(clock=clock)
    index.predict("a", [1], ttl=1.0)
    clock.now = 0.5
    index.predict("a", [1], ttl=1.0)
    clock.now = 1.2
    assert index.match([1]) == {"a": 1}
    clock.now = 1.6
    assert index.match([1]) == {}


def test_removed_worker_slot_is_reused_cleanly(Index) -> None:
    index = Index()
    index.store("a", [1, 2])
    index.remove_worker("a")
    index.store("b", [7])
    assert index.match([1, 2]) == {}
    assert index.workers == ["b"]


# Long chains so bisection really bisects: a tree of chains with shared prefixes.
def long_chain(branch: int, length: int) -> list[int]:
    return [
        1000 * (i // 8 if branch else 0) + (branch if i >= 8 else 0) * 100 + i
        for i in range(length)
    ]


LONG = [long_chain(b, 64) for b in range(4)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "remove", "clear"]),
            st.sampled_from(WORKERS),
            st.integers(0, 3),
            st.integers(0, 63),
            st.integers(1, 64),
        ),
        max_size=30,
    )
)
def test_bisection_equals_linear_walk_with_holes(Index, steps: list[tuple]) -> None:
    fast, slow = Index(bisect_min_blocks=1), Index(bisect_min_blocks=10**9)
    ref = Reference()
    for op, worker, branch, start, length in steps:
        chain = LONG[branch]
        if op == "store":  # engines store chains from block 0
            for index in (fast, slow):
                index.store(worker, chain[:length])
            ref.store(worker, chain[:length], "gpu")
        elif op == "remove":
            piece = chain[start : start + length // 8 + 1]
            for index in (fast, slow):
                index.remove(worker, piece)
            ref.remove(worker, piece, "gpu")
        else:
            for index in (fast, slow):
                index.clear(worker)
            ref.clear(worker)
    for chain in LONG:
        for cut in (1, 7, 8, 9, 33, 64):
            expected = ref.match(chain[:cut])
            assert fast.match(chain[:cut]) == expected
            assert slow.match(chain[:cut]) == expected
            assert fast.match_tiers(chain[:cut]) == slow.match_tiers(chain[:cut])


def test_holes_are_counted_and_healed(Index) -> None:
    index = Index(bisect_min_blocks=1)
    chain = list(range(1, 41))
    index.store("a", chain)
    assert index.stats().workers_with_holes == 0
    index.remove("a", [5])
    assert index.stats().workers_with_holes == 1
    assert index.match(chain) == {"a": 4}
    index.store("a", [5], parent=4)
    assert index.stats().workers_with_holes == 0
    assert index.match(chain) == {"a": 40}
    index.remove("a", chain[::-1])  # leaf-first eviction never makes a hole
    assert index.stats().workers_with_holes == 0 and len(index) == 0


def test_memory_bound_evicts_leaves_first_and_makes_no_holes(Index) -> None:
    index = Index(max_blocks=50, bisect_min_blocks=1)
    index.store("a", list(range(1, 41)))
    index.match(list(range(1, 41)))
    index.store("b", list(range(100, 140)))
    assert len(index) <= 50
    assert index.stats().workers_with_holes == 0
    depth_a = index.match(list(range(1, 41))).get("a", 0)
    depth_b = index.match(list(range(100, 140))).get("b", 0)
    assert depth_a + depth_b == len(index)
