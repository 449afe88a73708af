"""The native stack distance against index.reuse's Python one, the reference model: the
same histogram bit for bit, and the same sampling state, after every request of random
block streams (threshold drops, horizon, hot set, duplicates, prefetch touches)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_reuse import build, conversations, requests_st

from index.backend import NATIVE
from index.reuse import StackDistance

pytestmark = pytest.mark.skipif(not NATIVE, reason="native core not built")

if NATIVE:
    from index.native_reuse import NativeStackDistance

Op = tuple[str, list[int], int]


def assert_same(py: StackDistance, nat: NativeStackDistance) -> None:
    assert nat.threshold == py.threshold
    assert nat.tracked == py.tracked
    assert nat.accesses == py.accesses
    assert nat.sampled == py.sampled
    a, b = py.curve, nat.curve
    assert (b.tokens, b.requests) == (a.tokens, a.requests)
    assert b.buckets == a.buckets  # exact: the same float additions in the same order


def run_both(kwargs: dict[str, object], ops: list[Op], block_size: int) -> None:
    py = StackDistance(**kwargs)  # type: ignore[arg-type]
    nat = NativeStackDistance(**kwargs)  # type: ignore[arg-type]
    for kind, hashes, num_tokens in ops:
        if kind == "touch":
            py.touch(hashes)
            nat.touch(hashes)
        else:
            py.observe(hashes, num_tokens, block_size)
            nat.observe(hashes, num_tokens, block_size)
        assert_same(py, nat)


sampling_st = st.fixed_dictionaries(
    {
        "max_tracked": st.integers(1, 40),
        "rate": st.sampled_from([1.0, 1.0, 0.9, 0.5, 0.123, 2**-10]),
        "horizon": st.none() | st.integers(1, 60),
        "hot_blocks": st.sampled_from([0, 0, 1, 2, 3, 8, 17]),
    }
)


@st.composite
def raw_streams(draw: st.DrawFn) -> tuple[list[Op], int]:
    """Requests over a small pool of uniform 64-bit hashes: heavy reuse, duplicates
    inside a request, hashes either side of every threshold."""
    pool = draw(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=48, unique=True))
    block_size = draw(st.sampled_from([1, 4, 16]))
    ops: list[Op] = []
    for _ in range(draw(st.integers(1, 40))):
        hashes = [pool[i % len(pool)] for i in draw(st.lists(st.integers(0, 200), max_size=30))]
        kind = draw(st.sampled_from(["observe", "observe", "observe", "touch"]))
        num_tokens = draw(st.integers(0, (len(hashes) + 1) * block_size))
        ops.append((kind, hashes, num_tokens))
    return ops, block_size


@settings(max_examples=150, deadline=None)
@given(sampling_st, raw_streams())
def test_random_streams_give_the_same_histogram(kwargs, stream):
    ops, block_size = stream
    run_both(kwargs, ops, block_size)


@settings(max_examples=120, deadline=None)
@given(sampling_st, requests_st)
def test_prefix_chained_streams_give_the_same_histogram(kwargs, spec):
    """Streams shaped like real traffic: prompts that extend earlier prompts' prefixes."""
    ops = [("observe", hashes, n) for hashes, n in build(spec)]
    run_both(kwargs, ops, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tracked": 2000, "hot_blocks": 256},
        {"max_tracked": 500, "hot_blocks": 64, "horizon": 3000},
        {"max_tracked": 1 << 20},
        {"max_tracked": 300, "rate": 0.25, "horizon": 700},
    ],
)
def test_long_stream_same_histogram(kwargs):
    """55k block uses: slots renumbered many times, the heap rebuilt, the sample shrunk."""
    stream = conversations(3, sessions=150, turns=12)
    rng = random.Random(5)
    ops: list[Op] = []
    for hashes, n in stream:
        if rng.random() < 0.1:
            ops.append(("touch", hashes[: rng.randint(1, len(hashes))], 0))
        ops.append(("observe", hashes, n))
    py = StackDistance(**kwargs)
    nat = NativeStackDistance(**kwargs)
    for kind, hashes, n in ops:
        if kind == "touch":
            py.touch(hashes)
            nat.touch(hashes)
        else:
            py.observe(hashes, n, 4)
            nat.observe(hashes, n, 4)
    assert py.rate < 1 or kwargs["max_tracked"] == 1 << 20
    assert_same(py, nat)
    assert nat.bytes() > 0


def test_one_huge_request_then_small_ones():
    """A request larger than the whole slot array grows it; later ones still match."""
    rng = random.Random(11)
    big = [rng.getrandbits(64) for _ in range(20_000)]
    ops: list[Op] = [("observe", big, len(big) * 16)]
    ops += [("observe", big[: rng.randint(1, 3000)], 3000 * 16) for _ in range(20)]
    run_both({"max_tracked": 4096, "hot_blocks": 1024, "horizon": 1 << 24}, ops, 16)


def test_bad_arguments():
    for kwargs in ({"max_tracked": 0}, {"rate": 0.0}, {"rate": 1.5}, {"horizon": 0}):
        with pytest.raises(ValueError):
            NativeStackDistance(**kwargs)
    sd = NativeStackDistance()
    with pytest.raises(ValueError, match="block hash"):
        sd.observe([-1], 32, 16)
    with pytest.raises(ValueError, match="block_size"):
        sd.observe([1], 32, 0)
    assert sd.curve.requests == 0  # a refused request changed nothing


def test_short_and_long_requests_from_threads_with_a_reader():
    """Short requests are analysed with the GIL held, long ones without it (module.cpp's
    ``NOGIL_BLOCKS``): from two threads at once, with a third reading the curve all along,
    every request is counted once and nothing deadlocks (the reader waits for the stack's
    mutex with the GIL released)."""
    import threading

    rng = random.Random(3)
    short = [[rng.getrandbits(64) for _ in range(rng.randint(1, 40))] for _ in range(400)]
    long_ = [[rng.getrandbits(64) for _ in range(rng.randint(300, 3000))] for _ in range(40)]
    nat = NativeStackDistance(max_tracked=2048, hot_blocks=256, horizon=1 << 24)
    done = threading.Event()
    reads: list[int] = []

    def feed(reqs: list[list[int]]) -> None:
        for hashes in reqs:
            nat.observe(hashes, len(hashes) * 16, 16)

    def read() -> None:
        while not done.is_set():
            reads.append(nat.curve.requests)

    threads = [threading.Thread(target=feed, args=(r,)) for r in (short, long_)]
    reader = threading.Thread(target=read)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    done.set()
    reader.join(timeout=60)
    assert not reader.is_alive()
    curve = nat.curve
    assert curve.requests == len(short) + len(long_)
    assert curve.tokens == 16 * sum(map(len, short + long_))
    assert nat.accesses == sum(map(len, short + long_))
    assert reads == sorted(reads)  # the reader never saw a request counted then undone
