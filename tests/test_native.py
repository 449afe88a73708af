"""The native core against the Python it replaces: XXH3-64 and the rolling block hashes
bit for bit, the hash map under heavy churn, and a build check for CI."""

from __future__ import annotations

import os
import random

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from index import BlockHasher
from index.backend import IMPLEMENTATIONS, NATIVE, make_ingest
from index.prefix_index import PrefixIndex

native = pytest.importorskip("index._native") if NATIVE else None
needs_native = pytest.mark.skipif(not NATIVE, reason="native core not built")


def test_native_core_is_built_where_ci_requires_it() -> None:
    # .ci/run sets this: on a fresh `pip install -e .` the extension must exist.
    if os.environ.get("CACHE_ROUTER_REQUIRE_NATIVE") == "1":
        assert NATIVE, "pip install -e . did not build index._native"
        # tests/test_native_events.py skips on a build from before the event reader
        assert hasattr(native, "EventReader"), "index._native has no EventReader: a stale build"
    assert IMPLEMENTATIONS[0] is PrefixIndex


@needs_native
@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2100), st.integers(0, 2**64 - 1))
def test_xxh3_equals_the_xxhash_package(data: bytes, seed: int) -> None:
    assert native.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed)


@needs_native
def test_xxh3_every_length_class() -> None:
    rng = random.Random(7)
    for n in [*range(0, 260), 1023, 1024, 1025, 2047, 2048, 4096, 10_000]:
        data = rng.randbytes(n)
        for seed in (0, 1, 2**63, 2**64 - 1, rng.getrandbits(64)):
            assert native.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed), (n, seed)


def python_chain(tokens: list[int], block_size: int, bigram: bool, seed: int) -> list[int]:
    """The rolling hash exactly as index/hashing.py's loop computes it."""
    buf = b"".join(t.to_bytes(4, "little") for t in tokens)
    n = max(0, (len(tokens) - 1) // block_size) if bigram else len(tokens) // block_size
    window = (block_size + bigram) * 4
    out, h = [], seed
    for i in range(n):
        h = xxhash.xxh3_64_intdigest(buf[i * block_size * 4 : i * block_size * 4 + window], h)
        out.append(h)
    return out


@needs_native
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=300),
    st.sampled_from([1, 2, 16, 32, 64, 128]),
    st.booleans(),
    st.integers(0, 2**64 - 1),
)
def test_rolling_hashes_equal_the_python_chain(
    tokens: list[int], block_size: int, bigram: bool, seed: int
) -> None:
    expected = python_chain(tokens, block_size, bigram, seed)
    assert native.rolling_hashes(tokens, block_size, bigram, seed) == expected
    hasher = BlockHasher(block_size, seed, bigram=bigram)
    assert hasher.hash_tokens(tokens) == expected  # the path the router takes


@needs_native
def test_bad_token_ids_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="token id"):
        native.rolling_hashes([1, -1], 1, False, 0)
    with pytest.raises(ValueError, match="token id"):
        native.rolling_hashes([2**32], 1, False, 0)


@needs_native
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_hash_map_under_churn_equals_a_set(seed: int) -> None:
    # Many keys, deletions interleaved with growth, and the edge keys (0, 2**64 - 1,
    # the map's empty marker): what the index holds equals a plain set.
    from index.native_index import NativePrefixIndex

    rng = random.Random(seed)
    index = NativePrefixIndex()
    held: set[int] = set()
    edge = [0, 2**64 - 1, 0x8F3A71C59D2E4B61, 1]
    universe = edge + [rng.getrandbits(64) for _ in range(400)] + list(range(2, 300))
    for _ in range(30):
        batch = rng.sample(universe, rng.randint(1, 120))
        if rng.random() < 0.6:
            index.store("w", batch)
            held.update(batch)
        else:
            index.remove("w", batch)
            held.difference_update(batch)
        assert len(index) == len(held)
    for key in universe:
        assert index.holds("w", key) == (key in held)


# Blocks drawn from a small universe with arbitrary parents (a parent the index never saw,
# a block its own parent, cycles): the native nodes keep a parent nobody holds as a
# "ghost" while a child of it is held, and erase it after; the hole count, the sizes and
# the matches must equal the Python index's at every step.
NODE_KEYS = [0, 1, 2, 3, 4, 5, 6, 7, 2**64 - 1, 0x8F3A71C59D2E4B61]
NODE_WORKERS = ["a", "b", "c"]


def node_ops(tiers: list[str]) -> st.SearchStrategy[tuple]:
    blocks = st.lists(st.sampled_from(NODE_KEYS), min_size=1, max_size=5)
    worker = st.sampled_from(NODE_WORKERS)
    return st.one_of(
        st.tuples(
            st.just("store"),
            worker,
            blocks,
            st.sampled_from(tiers),
            st.none() | st.sampled_from(NODE_KEYS),
        ),
        st.tuples(st.just("remove"), worker, blocks, st.sampled_from(tiers)),
        st.tuples(st.sampled_from(["clear", "remove_worker"]), worker),
        st.tuples(st.just("match"), st.lists(st.sampled_from(NODE_KEYS), max_size=6)),
    )


def _step(index: object, op: str, args: tuple) -> object:
    if op == "store":
        worker, hashes, tier, parent = args
        return index.store(worker, hashes, tier, parent=parent)
    if op == "remove":
        return index.remove(*args)
    if op == "match":
        return index.match(*args)
    return getattr(index, op)(*args)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(node_ops(["gpu", "gpu", "cpu", "shared"]), max_size=50))
def test_native_nodes_and_holes_equal_the_python_index(steps: list[tuple]) -> None:
    from index.native_index import NativePrefixIndex

    py, nat = PrefixIndex(bisect_min_blocks=1), NativePrefixIndex(bisect_min_blocks=1)
    for i, (op, *args) in enumerate(steps):
        assert _step(nat, op, tuple(args)) == _step(py, op, tuple(args)), (i, steps[: i + 1])
        a, b = py.stats(), nat.stats()
        assert len(nat) == len(py) and b.blocks == a.blocks, steps[: i + 1]
        assert b.workers_with_holes == a.workers_with_holes, steps[: i + 1]
        assert {w: c for w, c in b.workers.items() if any(c.values())} == {
            w: c for w, c in a.workers.items() if any(c.values())
        }
    for key in NODE_KEYS:
        for w in NODE_WORKERS:
            assert nat.holds(w, key) == py.holds(w, key)
        assert nat.match_tiers([key, *NODE_KEYS]) == py.match_tiers([key, *NODE_KEYS])


@needs_native
@settings(max_examples=100, deadline=None)
@given(st.lists(node_ops(["gpu", "gpu", "cpu"]), max_size=60), st.integers(1, 6))
def test_native_memory_bound_keeps_nodes_consistent(steps: list[tuple], bound: int) -> None:
    # Eviction order may differ from Python's on ties, so: the bound holds, and every
    # match equals the leading run of blocks the worker holds (no shared tier here; the
    # linear walk, as bisection trusts a query to be a chain).
    from index.native_index import NativePrefixIndex

    nat = NativePrefixIndex(max_blocks=bound, bisect_min_blocks=10**9)
    for op, *args in steps:
        _step(nat, op, tuple(args))
        assert len(nat) <= bound
    for key in NODE_KEYS:
        query = [key, *NODE_KEYS]
        for w, depth in nat.match(query).items():
            run = 0
            while run < len(query) and nat.holds(w, query[run]):
                run += 1
            assert depth == run


# -- event ingest: native decode -> rehash -> apply equals the Python path --------------

TOKEN_BLOCKS = [[i, i + 1, i + 2, i + 3] for i in range(0, 40, 4)]
ENGINE: list[int | bytes] = [*range(1, 9), 2**64 - 1, 2**63, b"\x00\x07", bytes(range(32))]


def stored_event(draw: st.DrawFn) -> object:
    from index import BlockStored

    n = draw(st.integers(0, 3))
    size = draw(st.sampled_from([4, 4, 4, 8]))  # 8: a coarse block, two router blocks
    tokens = [t for _ in range(n * size // 4) for t in draw(st.sampled_from(TOKEN_BLOCKS))]
    if draw(st.integers(0, 9)) == 0:
        tokens = tokens[:-1]  # token_count_mismatch
    return BlockStored(
        block_hashes=[draw(st.sampled_from(ENGINE)) for _ in range(n)],
        parent_block_hash=draw(st.none() | st.sampled_from(ENGINE)),
        token_ids=tokens,
        block_size=size,
        lora_id=draw(st.sampled_from([None, None, None, 3])),
        medium=draw(st.sampled_from([None, "GPU", "cpu", "DISK", "shared", "TAPE"])),
        lora_name=draw(st.sampled_from([None, None, None, "ada"])),
        # [None, None, None]: vLLM 0.32's keys of a plain prompt, one None per block
        extra_keys=draw(
            st.sampled_from([None, None, [["salt-1"]], [None, [7]], [None, None, None], [None, []]])
        ),
        group_idx=draw(st.sampled_from([None, None, 0, 1])),
    )


@st.composite
def event_batches(draw: st.DrawFn) -> list[bytes]:
    from index import AllBlocksCleared, BlockRemoved, EventBatch, encode

    out = []
    for i in range(draw(st.integers(1, 12))):
        events = []
        for _ in range(draw(st.integers(0, 4))):
            kind = draw(st.integers(0, 9))
            if kind < 6:
                events.append(stored_event(draw))
            elif kind < 9:
                hashes = draw(st.lists(st.sampled_from(ENGINE), max_size=3))
                medium = draw(st.sampled_from([None, "GPU", "CPU"]))
                events.append(BlockRemoved(hashes, medium))
            else:
                events.append(AllBlocksCleared())
        batch = EventBatch(float(i), events, draw(st.none() | st.integers(0, 3)))
        out.append(
            encode(batch, events_as_map=draw(st.booleans()), batch_as_map=draw(st.booleans()))
        )
    return out


@needs_native
@settings(max_examples=150, deadline=None)
@given(event_batches(), st.sampled_from([None, None, 6]))
def test_native_ingest_equals_the_python_ingest(payloads: list[bytes], quota: int | None) -> None:
    from index.native_index import NativePrefixIndex

    ingests = [
        make_ingest(make(), BlockHasher(4), max_worker_blocks=quota)
        for make in (PrefixIndex, NativePrefixIndex)
    ]
    seen: set[int] = set()  # router hashes ever named, stale ones too
    for seq, payload in enumerate(payloads):
        results = [ing.apply("w", seq, payload) for ing in ingests]
        assert results[0] == results[1], seq
        seen.update(ingests[0].engine_blocks("w").values())
    py, nat = ingests
    for rh in seen:  # a router hash re-stored under another keeps its last engine hash
        assert nat.engine_hashes("w", [rh]) == py.engine_hashes("w", [rh])
    assert nat.errors == py.errors
    blocks = py.engine_blocks("w")
    assert nat.engine_blocks("w") == blocks
    # The native path gives a worker its slot at its first batch, the Python one at its
    # first stored block: both report the same blocks.
    stats = [ing.index.stats() for ing in ingests]
    held = [{w: c for w, c in st.workers.items() if any(c.values())} for st in stats]
    assert held[0] == held[1]
    assert stats[0].blocks == stats[1].blocks
    assert stats[0].workers_with_holes == stats[1].workers_with_holes
    chain = sorted(set(blocks.values()))
    for rh in chain:
        assert nat.index.match([rh]) == py.index.match([rh])
        assert nat.engine_hashes("w", [rh]) == py.engine_hashes("w", [rh])


@needs_native
@settings(max_examples=100, deadline=None)
@given(event_batches(), st.data())
def test_native_ingest_survives_damaged_payloads(
    payloads: list[bytes], data: st.DataObject
) -> None:
    from index.native_index import NativePrefixIndex

    py = make_ingest(PrefixIndex(), BlockHasher(4))
    nat = make_ingest(NativePrefixIndex(), BlockHasher(4))
    for seq, payload in enumerate(payloads):
        raw = bytearray(payload)
        for _ in range(data.draw(st.integers(0, 3))):
            if raw:
                raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        raw = raw[: data.draw(st.integers(0, len(raw)))] if data.draw(st.booleans()) else raw
        try:
            want = py.apply("w", seq, bytes(raw))
        except (TypeError, ValueError, OverflowError):
            return  # the Python path has no answer to compare with (a non-int token id)
        got = nat.apply("w", seq, bytes(raw))  # raises nothing where Python does not
        assert got.status == want.status
        if got.errors != want.errors or got.applied != want.applied:
            # A damaged token id that Python accepts as an int but not as u32 is the one
            # place they may differ; everything else must agree.
            assert got.errors.get("bad_event", 0) > want.errors.get("bad_event", 0)
            return


# msgpack's unsigned widths and their edges: fixint, uint 8, 16, 32 (and 64 for hashes)
U32_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**31, 2**32 - 1]


@needs_native
@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(U32_EDGES) | st.integers(0, 2**32 - 1), min_size=4, max_size=4),
        min_size=1,
        max_size=6,
    ),
    st.lists(
        st.sampled_from([*U32_EDGES[1:], 2**32, 2**63, 2**64 - 1]),
        min_size=6,
        max_size=6,
        unique=True,
    ),
    st.integers(0, 12),
)
def test_ids_of_every_width_and_cut_payloads_decode_as_python_reads_them(
    blocks: list[list[int]], hashes: list[int], cut: int
) -> None:
    """Token ids and hashes of every msgpack width, whole and with the payload cut ``cut``
    bytes short (the bulk reader's unchecked part ends 9 bytes a value before the end)."""
    from index import BlockStored, EventBatch, encode
    from index.native_index import NativePrefixIndex

    event = BlockStored(
        block_hashes=hashes[: len(blocks)],
        parent_block_hash=None,
        token_ids=[t for b in blocks for t in b],
        block_size=4,
        medium="GPU",
    )
    payload = encode(EventBatch(0.0, [event], None))
    payload = payload[: len(payload) - cut]
    py, nat = (make_ingest(make(), BlockHasher(4)) for make in (PrefixIndex, NativePrefixIndex))
    assert nat.apply("w", 0, payload) == py.apply("w", 0, payload)
    assert nat.engine_blocks("w") == py.engine_blocks("w")
    assert nat.errors == py.errors
    # the native path gives the worker its slot at its first batch: a 0 is no match
    chain = list(py.engine_blocks("w").values())
    matched = [{w: n for w, n in ing.index.match(chain).items() if n} for ing in (nat, py)]
    assert matched[0] == matched[1]


def _give(idx: object, ids: list[str], out: dict[str, int]) -> None:
    for w in ids:
        out[w] = idx.slot(w)  # type: ignore[attr-defined]


@needs_native
def test_a_worker_gets_one_slot_when_two_threads_meet_it_first() -> None:
    """The ingest thread and the event loop both give slots to workers they see first;
    a slot handed out twice left an applied batch in an orphaned slot."""
    import sys
    import threading

    from index.native_index import NativePrefixIndex

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches inside slot(), where the race was
    try:
        for _ in range(30):
            idx = NativePrefixIndex()
            ids = [f"w{i}" for i in range(300)]
            got: list[dict[str, int]] = [{}, {}]
            threads = [threading.Thread(target=_give, args=(idx, ids, g)) for g in got]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert got[0] == got[1]
            assert sorted(idx.workers) == sorted(ids)
            assert sorted(got[0].values()) == list(range(len(ids)))
    finally:
        sys.setswitchinterval(switch)


@needs_native
@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.integers(0, 2**64 - 1)
        | st.sampled_from([0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, 2**64 - 1]),
        min_size=1,
        max_size=40,
    )
)
def test_hashes_are_read_exactly(hashes: list[int]) -> None:
    """Hashes read from a list (the digits fast path) are the values pybind reads."""
    core = native.Core(0, 24)
    core.add_slot(0)
    core.store(0, hashes, 0, None)
    assert all(core.holds(0, h, 0) for h in hashes)
    assert len(core) == len(set(hashes))


@needs_native
def test_hashes_out_of_range_are_refused() -> None:
    core = native.Core(0, 24)
    core.add_slot(0)
    for bad in (-1, 2**64, 2**90, -(2**63), "7", 1.0):
        with pytest.raises((ValueError, TypeError)):
            core.store(0, [5, bad], 0, None)
    assert len(core) == 0
    core.store(0, [True, 2**64 - 1], 0, None)  # an int subclass: the C API's reading
    assert core.holds(0, 1, 0) and core.holds(0, 2**64 - 1, 0)


@pytest.mark.slow
@needs_native
@settings(max_examples=120, deadline=None)
@given(st.data())
def test_ingest_many_equals_the_python_ingest_one_batch_at_a_time(data: st.DataObject) -> None:
    """``apply_many`` (runs of batches per native call, ending early at the first batch
    that is not a plain apply) against the reference applying them one by one: faulty
    seqs, epochs, dp ranks, workers on two cores (past 64), runs cut anywhere."""
    from index.native_index import NativePrefixIndex

    workers = ["w1", "w2", "w69"]
    logs = {w: data.draw(event_batches()) for w in workers}
    steps = data.draw(
        st.lists(
            st.tuples(
                st.sampled_from(workers),
                st.integers(-1, 12),  # -1: an epoch start
                st.sampled_from([None, None, 0, 1]),
                st.sampled_from([None, "a", "a", "b"]),
                st.booleans(),  # a run ends after this batch
            ),
            max_size=40,
        )
    )
    py = make_ingest(
        PrefixIndex(), BlockHasher(4), max_worker_blocks=data.draw(st.sampled_from([None, 5]))
    )
    nat = make_ingest(NativePrefixIndex(), BlockHasher(4), max_worker_blocks=py.max_worker_blocks)
    for i in range(70):
        for ing in (py, nat):
            ing.index.add_worker(f"w{i}")
    want, got, run = [], [], []
    for worker, seq, rank, epoch, cut in steps:
        log = logs[worker]
        batch = (worker, seq, log[max(seq, 0) % len(log)], rank, epoch)
        want.append(py.apply(worker, seq, batch[2], dp_rank=rank, epoch=epoch))
        run.append(batch)
        if cut:
            got += nat.apply_many(run)
            run = []
    got += nat.apply_many(run)
    assert got == want
    for name in ("events_applied", "batches_applied", "duplicates", "gaps", "restarts"):
        assert getattr(nat, name) == getattr(py, name), name
    assert nat.errors == py.errors
    for w in workers:
        assert nat.engine_blocks(w) == py.engine_blocks(w), w
        assert nat.in_sync(w) == py.in_sync(w), w
        assert nat.last_seqs(w) == py.last_seqs(w), w
        assert nat.epoch(w) == py.epoch(w), w
    # Per worker: ``blocks`` counts a block once per group of 64 natively (w1 and w69 are
    # in two), once in all in Python (index/native_index.py says so).
    assert nat.index.stats().workers == py.index.stats().workers
    assert nat.index.stats().blocks >= py.index.stats().blocks


@needs_native
def test_a_plain_vllm_batch_is_decoded_natively() -> None:
    """vLLM 0.32 publishes ``extra_keys`` as one None per block for a plain prompt: that
    is no keys, decoded natively; a block with keys still goes to Python."""
    from index import BlockStored, EventBatch, encode

    core = native.Core(1 << 16, 64)
    core.configure_events(4, False, 0, {"GPU": 0})

    def slow(extra_keys: list[object] | None, kind: str | None = None) -> bool:
        event = BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None, extra_keys)
        event.kv_cache_spec_kind = kind
        return bool(core.parse(encode(EventBatch(1.0, [event], None))).slow)

    assert not slow(None) and not slow([None, None]) and not slow([None, []])
    assert not slow([None, None], "full_attention")
    assert slow([None, ["salt-1"]]) and slow([["ada"], None])
    assert slow([None, None], "sliding_window")  # Python learns the groups from it
