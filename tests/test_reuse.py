"""index.reuse against a plain LRU cache: the stack-distance curve is every cache size at once."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.reuse import (
    NUM_BUCKETS,
    ReuseCurve,
    StackDistance,
    bucket_of,
    bucket_range,
    doublings,
    saturation,
)

BS = 4


class LruReference:
    """One LRU cache of ``capacity`` blocks, as an engine uses it (the obvious way).

    A request's hit is its leading run of cached blocks, found before it touches
    anything, capped one token short of the prompt; then its blocks are used tail
    first (a finished request frees its tail first), evicting the least recent.
    """

    def __init__(self, capacity: int, block_size: int = BS) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.hit_tokens = 0
        self.tokens = 0

    def request(self, hashes: list[int], num_tokens: int) -> None:
        cap = min(len(hashes), (num_tokens - 1) // self.block_size)
        n = 0
        while n < cap and hashes[n] in self.lru:
            n += 1
        self.hit_tokens += n * self.block_size
        self.tokens += num_tokens
        for h in reversed(hashes):
            self.lru[h] = None
            self.lru.move_to_end(h)
            if len(self.lru) > self.capacity:
                self.lru.popitem(last=False)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.tokens


def chained(path: list[int]) -> list[int]:
    """Prefix-chained 64-bit block hashes of a path of block contents."""
    out, parent = [], 0x5EED
    for block in path:
        parent = hash((parent, block)) & ((1 << 64) - 1)
        out.append(parent)
    return out


# A stream of requests: each extends a random earlier prompt's prefix by fresh blocks,
# the way conversations, shared system prompts and agent loops grow.
requests_st = st.lists(
    st.tuples(
        st.integers(0, 1000),  # which earlier prompt to extend (modulo how many there are)
        st.integers(0, 12),  # how many of its blocks to keep
        st.integers(0, 6),  # fresh blocks appended
        st.integers(0, BS - 1),  # tokens in the trailing partial block
    ),
    min_size=1,
    max_size=60,
)


def build(spec: list[tuple[int, int, int, int]]) -> list[tuple[list[int], int]]:
    prompts: list[list[int]] = [[]]
    fresh = 0
    out = []
    for pick, keep, add, tail in spec:
        base = prompts[pick % len(prompts)][:keep]
        path = base + list(range(fresh, fresh + add))
        fresh += add
        prompts.append(path)
        num_tokens = len(path) * BS + tail
        if num_tokens == 0:
            num_tokens = 1
        out.append((chained(path), num_tokens))
    return out


@settings(max_examples=200, deadline=None)
@given(requests_st, st.lists(st.integers(1, 63), min_size=1, max_size=6))
def test_exact_curve_is_every_lru_size(spec, capacities):
    """Below 64 blocks the histogram is exact: the curve equals each LRU's hit rate."""
    stream = build(spec)
    sd = StackDistance(max_tracked=10_000)
    refs = [LruReference(c) for c in capacities]
    for hashes, n in stream:
        sd.observe(hashes, n, BS)
        for ref in refs:
            ref.request(hashes, n)
    got = sd.curve.hit_rates(capacities)
    for ref, rate in zip(refs, got, strict=True):
        assert rate == pytest.approx(ref.hit_rate, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(requests_st, st.integers(1, 40))
def test_horizon_keeps_the_curve_exact_up_to_it(spec, horizon):
    """Dropping blocks deeper than the horizon changes nothing at or below it."""
    stream = build(spec)
    sd = StackDistance(max_tracked=10_000, horizon=horizon)
    refs = [LruReference(c) for c in range(1, horizon + 1)]
    for hashes, n in stream:
        sd.observe(hashes, n, BS)
        assert sd.tracked <= horizon + 1
        for ref in refs:
            ref.request(hashes, n)
    got = sd.curve.hit_rates(range(1, horizon + 1))
    assert got == pytest.approx([r.hit_rate for r in refs], abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(requests_st, st.integers(1, 30))
def test_fixed_size_never_tracks_more(spec, max_tracked):
    sd = StackDistance(max_tracked=max_tracked)
    rate = sd.rate
    for hashes, n in build(spec):
        sd.observe(hashes, n, BS)
        assert sd.tracked <= max_tracked
        assert sd.rate <= rate  # the threshold only drops
        rate = sd.rate
    rates = sd.curve.hit_rates(doublings(1, 1 << 20))
    assert all(0.0 <= r <= 1.0 for r in rates)
    assert rates == sorted(rates)  # more cache never hits less


def conversations(seed: int, sessions: int, turns: int, system: int = 8) -> list[tuple[list, int]]:
    """Sessions sharing a system prompt, each turn extending its history, interleaved."""
    rng = random.Random(seed)
    history = {s: list(range(system)) for s in range(sessions)}
    fresh = system
    out = []
    for _turn in range(turns):
        order = list(range(sessions))
        rng.shuffle(order)
        for s in order:
            add = rng.randint(1, 6)
            history[s] += range(fresh, fresh + add)
            fresh += add
            out.append((chained(history[s]), len(history[s]) * BS + rng.randint(0, BS - 1)))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_curve_tracks_every_lru_size(seed):
    """SHARDS at a fixed size, with the hot set: within 2 points of each LRU from 256 up.

    150 sessions x 12 turns, 55k block uses, 6k distinct blocks, 2,000 tracked (rate
    about 0.3); over 20 seeds the worst error was 1.6 points.
    """
    stream = conversations(seed, sessions=150, turns=12)
    sampled = StackDistance(max_tracked=2000, hot_blocks=256)
    for hashes, n in stream:
        sampled.observe(hashes, n, BS)
    assert sampled.rate < 0.5  # it did sample
    assert sampled.tracked <= 2000
    caps = doublings(256, 1 << 15)
    ref = {c: LruReference(c) for c in caps}
    for hashes, n in stream:
        for r in ref.values():
            r.request(hashes, n)
    for c, rate in zip(caps, sampled.curve.hit_rates(caps), strict=True):
        assert rate == pytest.approx(ref[c].hit_rate, abs=0.02), c


def test_exact_curve_between_bucket_edges():
    """Above 64 blocks the buckets are 3 % wide: the read is interpolated, within a point."""
    stream = conversations(7, sessions=60, turns=8)
    exact = StackDistance(max_tracked=1 << 20)
    for hashes, n in stream:
        exact.observe(hashes, n, BS)
    caps = [100, 333, 1000, 1500, 2222, 3000]
    ref = {c: LruReference(c) for c in caps}
    for hashes, n in stream:
        for r in ref.values():
            r.request(hashes, n)
    for c, rate in zip(caps, exact.curve.hit_rates(caps), strict=True):
        assert rate == pytest.approx(ref[c].hit_rate, abs=0.01), c


@settings(max_examples=100, deadline=None)
@given(requests_st, st.integers(2, 30))
def test_hot_set_is_exact_from_its_size(spec, hot):
    """Unsampled, the hot set changes nothing at capacities of ``hot_blocks`` and more."""
    stream = build(spec)
    sd = StackDistance(max_tracked=10_000, hot_blocks=hot)
    caps = list(range(hot, 64))
    refs = [LruReference(c) for c in caps]
    for hashes, n in stream:
        sd.observe(hashes, n, BS)
        for ref in refs:
            ref.request(hashes, n)
    got = sd.curve.hit_rates(caps)
    assert got == pytest.approx([r.hit_rate for r in refs], abs=1e-12)


def test_buckets_tile_the_capacities():
    j_prev, high_prev = -1, 1
    for need in [*range(1, 5000), *(1 << k for k in range(13, 47)), (1 << 47) - 1]:
        j = bucket_of(need)
        low, high = bucket_range(j)
        assert low <= need < high
        assert j >= j_prev
        if j != j_prev:
            assert low == high_prev or j_prev == -1 or need >= 5000
        j_prev, high_prev = j, high
    assert bucket_of(1 << 60) == NUM_BUCKETS - 1
    assert (high - low) / low <= 1 / 32 + 1e-9


def test_capacity_for_inverts_the_curve():
    curve = ReuseCurve()
    curve.tokens = 1000
    for need, w in [(10, 100.0), (500, 200.0), (30_000, 300.0)]:
        curve.add(need, w)
    assert curve.ceiling() == pytest.approx(0.6)
    for goal in (0.05, 0.1, 0.2, 0.3, 0.45, 0.6):
        c = curve.capacity_for(goal)
        assert c is not None
        assert curve.hit_rate(c) >= goal - 1e-9
        assert curve.hit_rate(c - 1) < goal
    assert curve.capacity_for(0.61) is None
    assert curve.capacity_for(0.0) == 0


def test_saturation_is_where_doubling_stops_paying():
    caps = [1, 2, 4, 8, 16, 32]
    assert saturation(caps, [0.0, 0.0, 0.1, 0.3, 0.305, 0.31]) == 8
    assert saturation(caps, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]) == 1
    assert saturation(caps, [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]) == 32
    # a flat stretch below a later rise is not saturation
    assert saturation(caps, [0.0, 0.005, 0.006, 0.2, 0.2, 0.2]) == 8


def test_bad_arguments():
    for kwargs in ({"max_tracked": 0}, {"rate": 0.0}, {"rate": 1.5}, {"horizon": 0}):
        with pytest.raises(ValueError):
            StackDistance(**kwargs)
