"""The native ingest against the Python reference, batch for batch: one engine's stream of
stores, evictions and clears whose block hashes are ints (signed or not) and bytes
(32-byte sha256s as vLLM sends by default, and other lengths), delivered with gaps,
duplicates, garbage and bad events, through ``apply`` and ``apply_many``. Every result,
every counter, the blocks held, the matches and the engine hashes a prefetch hint would
name must be the same on both.
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventIngest,
    PrefixIndex,
    encode,
)
from index.backend import NATIVE, NativePrefixIndex, make_ingest
from index.codec import EngineHash

pytestmark = pytest.mark.skipif(not NATIVE, reason="native core not built")

B = 4
# How an engine names a block: the forms index/codec.py accepts.
FORMS = ("u64", "i64", "sha256", "sha256_head0", "sha256_tail0", "bytes16", "bytes0")


def engine_hash(form: str, parent: EngineHash | None, tokens: list[int]) -> EngineHash:
    digest = hashlib.sha256(repr((parent, tokens)).encode()).digest()
    if form == "u64":
        return int.from_bytes(digest[:8], "little")
    if form == "i64":
        return int.from_bytes(digest[:8], "little", signed=True)
    if form == "sha256":
        return b"\x00" + digest[1:]  # a leading zero byte: an int form would lose it
    # the native key is the first 8 bytes xor a hash of the other 24 (events.hpp
    # ``bytes_key``), and a hint's bytes come back from the key and the 24: either part
    # constant must still give distinct keys and the same bytes back
    if form == "sha256_head0":
        return bytes(8) + digest[8:]
    if form == "sha256_tail0":
        return digest[:8] + bytes(24)
    if form == "bytes16":
        return digest[:16]
    return b""  # every such block is the same key: a collision both sides must agree on


class Engine:
    """Stores chains, evicts leaves, clears; each block's hash form drawn per block."""

    def __init__(self, forms: list[str]) -> None:
        self.forms = forms
        self.blocks: dict[EngineHash, EngineHash | None] = {}  # hash -> parent
        self.chains: list[list[int]] = []  # every prompt stored, for the matches
        self.n = 0

    def store(self, tokens: list[int], medium: str) -> list[object]:
        parent: EngineHash | None = None
        hashes: list[EngineHash] = []
        stored: list[int] = []
        first: EngineHash | None = None
        for i in range(len(tokens) // B):
            blk = tokens[i * B : (i + 1) * B]
            form = self.forms[self.n % len(self.forms)]
            self.n += 1
            h = engine_hash(form, parent, blk)
            if h in self.blocks and not hashes:
                parent = h
                continue
            if not hashes:
                first = parent
            self.blocks[h] = parent
            hashes.append(h)
            stored += blk
            parent = h
        self.chains.append(tokens)
        if not hashes:
            return []
        return [BlockStored(hashes, first, stored, B, medium=medium)]

    def evict(self, pick: int) -> list[object]:
        parents = set(self.blocks.values())
        leaves = [h for h in self.blocks if h not in parents]
        if not leaves:
            return []
        h = leaves[pick % len(leaves)]
        del self.blocks[h]
        return [BlockRemoved([h], "GPU")]

    def clear(self) -> list[object]:
        self.blocks.clear()
        return [AllBlocksCleared()]


prompts = st.lists(st.integers(0, 3), min_size=B, max_size=5 * B)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), prompts, st.sampled_from(["GPU", "GPU", "CPU"])),
        st.tuples(st.just("evict"), st.integers(0, 10)),
        st.tuples(st.just("clear")),
        st.tuples(st.just("bad_hash")),  # an event whose hash is a str: a bad event
        st.tuples(st.just("garbage"), st.binary(max_size=40)),
    ),
    max_size=30,
)
# What the transport does to each batch: deliver, drop it (a gap), or send it twice.
fates = st.lists(st.sampled_from(["ok", "ok", "ok", "drop", "twice"]), max_size=30)


def batches(forms: list[str], script: list, as_map: bool) -> tuple[Engine, list[bytes]]:
    eng = Engine(forms)
    out: list[bytes] = []
    for op, *args in script:
        if op == "garbage":
            out.append(args[0])
            continue
        if op == "bad_hash":
            events: list[object] = [BlockRemoved(["not-a-hash"], "GPU")]  # type: ignore[list-item]
        else:
            events = {"store": eng.store, "evict": eng.evict, "clear": eng.clear}[op](*args)
        if events:
            out.append(encode(EventBatch(float(len(out)), events, None), events_as_map=as_map))
    return eng, out


def state(ingest: EventIngest, index: object, hasher: BlockHasher, eng: Engine) -> object:
    chains = [hasher.hash_tokens(c) for c in eng.chains]
    return (
        ingest.engine_blocks("w"),
        [ingest.engine_hashes("w", c) for c in chains],
        [index.match(c) for c in chains],  # type: ignore[attr-defined]
        ingest.in_sync("w"),
        set(ingest.out_of_sync()),
        ingest.last_seqs("w"),
        dict(ingest.errors),
        ingest.events_applied,
        ingest.batches_applied,
        ingest.gaps,
        ingest.duplicates,
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(FORMS), min_size=1, max_size=4),
    ops,
    fates,
    st.booleans(),
    st.integers(1, 4),
    st.booleans(),
)
def test_native_ingest_equals_the_reference(
    forms: list[str], script: list, fate: list[str], as_map: bool, run: int, names: bool
) -> None:
    eng, log = batches(forms, script, as_map)
    hasher = BlockHasher(B)
    py_index, nat_index = PrefixIndex(), NativePrefixIndex()
    py = make_ingest(py_index, hasher, keep_names=names)
    nat = make_ingest(nat_index, hasher, keep_names=names)
    assert type(nat).__name__ == "NativeEventIngest"
    sends: list[tuple[int, bytes]] = []
    for seq, payload in enumerate(log):
        what = fate[seq] if seq < len(fate) else "ok"
        if what != "drop":
            sends += [(seq, payload)] * (2 if what == "twice" else 1)
    for start in range(0, len(sends), run):  # runs of batches through apply_many
        chunk = [("w", seq, payload, None, None) for seq, payload in sends[start : start + run]]
        got = [(r.status, r.expected_seq, r.applied, dict(r.errors)) for r in nat.apply_many(chunk)]
        want = [(r.status, r.expected_seq, r.applied, dict(r.errors)) for r in py.apply_many(chunk)]
        assert got == want
    # the replay that closes any gap, one batch at a time
    for seq in range(len(log)):
        r_py, r_nat = py.apply("w", seq, log[seq]), nat.apply("w", seq, log[seq])
        assert (r_nat.status, r_nat.expected_seq, r_nat.applied, dict(r_nat.errors)) == (
            r_py.status,
            r_py.expected_seq,
            r_py.applied,
            dict(r_py.errors),
        )
    assert state(nat, nat_index, hasher, eng) == state(py, py_index, hasher, eng)


def test_out_of_sync_names_every_worker_in_sync_is_false_for() -> None:
    """The views ask ``out_of_sync`` once a request where they asked ``in_sync`` per
    candidate: both ingests name the same workers, over two native groups (a core's
    mask per 64 workers), and a removed worker's slot comes back in sync."""
    for index in (PrefixIndex(), NativePrefixIndex()):
        ingest = make_ingest(index, BlockHasher(B))
        names = [f"w{i}" for i in range(70)]
        for name in names:
            index.add_worker(name)
        assert not ingest.out_of_sync()
        for name in ("w3", "w64", "w69"):
            ingest.mark_out_of_sync(name)
        assert set(ingest.out_of_sync()) == {"w3", "w64", "w69"}
        ingest.remove_worker("w3")
        ingest.remove_worker("w69")
        index.add_worker("new")  # takes a freed slot
        assert set(ingest.out_of_sync()) == {"w64"}
        assert {n for n in [*names, "new"] if not ingest.in_sync(n)} == {"w64"}


def test_a_sha256_hash_comes_back_as_the_engines_bytes() -> None:
    """The default vLLM case end to end: 32-byte hashes in, the same bytes out of the
    prefetch hint's lookup, gone once the engine removes the block."""
    hasher = BlockHasher(B)
    index = NativePrefixIndex()
    ingest = make_ingest(index, hasher)
    eng = Engine(["sha256"])
    tokens = list(range(3 * B))
    stored = eng.store(tokens, "GPU")
    payload = encode(EventBatch(0.0, stored, None))
    ingest.apply("w", 0, payload)
    core, _ = index.locate("w")
    assert not core.parse(payload).slow  # decoded and applied in the core, not in Python
    engine = stored[0].block_hashes  # type: ignore[attr-defined]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in engine)
    router = hasher.hash_tokens(tokens)
    assert ingest.engine_hashes("w", router) == engine
    assert index.match(router)["w"] == 3
    ingest.apply("w", 1, encode(EventBatch(1.0, [BlockRemoved([engine[2]], "GPU")], None)))
    assert ingest.engine_hashes("w", router) == engine[:2]
    assert set(ingest.engine_blocks("w")) == set(engine[:2])


def test_names_not_kept_stop_a_hint_at_the_first_block_named_by_bytes() -> None:
    """A router whose policies send no prefetch hints keeps no 32-byte names: a lookup
    asked anyway names the int-named blocks before the first bytes-named one and stops
    there (never the key in place of the bytes), and the names cannot be switched back
    on under blocks stored without them."""
    hasher = BlockHasher(B)
    index = NativePrefixIndex()
    ingest = make_ingest(index, hasher, keep_names=False)
    eng = Engine(["u64", "u64", "sha256", "u64"])
    tokens = list(range(4 * B))
    stored = eng.store(tokens, "GPU")
    ingest.apply("w", 0, encode(EventBatch(0.0, stored, None)))
    engine = [h for ev in stored for h in ev.block_hashes]  # type: ignore[attr-defined]
    assert [type(h) for h in engine] == [int, int, bytes, int]
    router = hasher.hash_tokens(tokens)
    assert index.match(router)["w"] == 4  # matching does not need the names
    assert ingest.engine_hashes("w", router) == engine[:2]
    assert set(ingest.engine_blocks("w")) == {engine[0], engine[1], engine[3]}
    core, _ = index.locate("w")
    with pytest.raises(ValueError, match="before any block"):
        core.keep_names(True)
