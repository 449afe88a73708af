"""EventIngest: engine events -> router hashes -> index, with seq gaps, restarts, faults."""

from __future__ import annotations

import hashlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    EventBatch,
    PrefixIndex,
    SeqStatus,
    decode,
    encode,
    extra_key_bytes,
)
from index.backend import IMPLEMENTATIONS, make_ingest
from index.wire import EPOCH_START_SEQ

# Every test runs against the Python index and the native one (when built): with the
# native one, decode -> rehash -> apply happens in index._native.
pytestmark = pytest.mark.parametrize("Index", IMPLEMENTATIONS)

B = 4


def engine_hash(parent: int | None, tokens: list[int]) -> int:
    """An engine's own opaque hash (sha256 like vLLM's), unrelated to the router's."""
    data = repr((parent, tokens)).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


class Engine:
    """A tiny engine cache: stores chains, evicts leaves, emits vLLM-shaped events."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, tokens)
        self.log: list[bytes] = []

    def store(self, tokens: list[int], medium: str = "GPU") -> None:
        parent: int | None = None
        new_hashes, new_tokens, first_parent = [], [], None
        for i in range(len(tokens) // B):
            blk = tokens[i * B : (i + 1) * B]
            h = engine_hash(parent, blk)
            if h not in self.blocks:
                if not new_hashes:
                    first_parent = parent
                self.blocks[h] = (parent, blk)
                new_hashes.append(h)
                new_tokens += blk
            elif new_hashes:
                break
            parent = h
        if new_hashes:
            self.emit([BlockStored(new_hashes, first_parent, new_tokens, B, medium=medium)])

    def evict_leaf(self, pick: int) -> None:
        parents = {p for p, _ in self.blocks.values()}
        leaves = sorted(h for h in self.blocks if h not in parents)
        if leaves:
            h = leaves[pick % len(leaves)]
            del self.blocks[h]
            self.emit([BlockRemoved([h], "GPU")])

    def clear(self) -> None:
        self.blocks.clear()
        self.emit([AllBlocksCleared()])

    def emit(self, events: list) -> None:
        self.log.append(encode(EventBatch(float(len(self.log)), events, 0)))

    def router_hashes(self, hasher: BlockHasher) -> set[int]:
        """What the index should hold for this engine: rehash every chain it has."""
        out = set()
        for h in self.blocks:
            chain = []
            cur: int | None = h
            while cur is not None:
                parent, tokens = self.blocks[cur]
                chain.append(tokens)
                cur = parent
            flat = [t for blk in reversed(chain) for t in blk]
            out.add(hasher.hash_tokens(flat)[-1])
        return out


prompts = st.lists(st.integers(0, 3), min_size=B, max_size=4 * B)
engine_ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), prompts),
        st.tuples(st.just("evict"), st.integers(0, 10)),
        st.tuples(st.just("clear")),
    ),
    max_size=25,
)


def run_engine(ops: list) -> Engine:
    eng = Engine()
    for op, *args in ops:
        {"store": eng.store, "evict": eng.evict_leaf, "clear": eng.clear}[op](*args)
    return eng


def held(index: PrefixIndex, worker: str, hashes: set[int]) -> bool:
    return all(index.holds(worker, h) for h in hashes)


@settings(max_examples=150, deadline=None)
@given(engine_ops)
def test_index_mirrors_the_engine_cache(Index, ops: list) -> None:
    eng = run_engine(ops)
    hasher, index = BlockHasher(B), Index()
    ingest = make_ingest(index, hasher)
    for seq, payload in enumerate(eng.log):
        assert ingest.apply("w", seq, payload).status in (SeqStatus.OK,)
    expected = eng.router_hashes(hasher)
    assert held(index, "w", expected)
    assert len(index) == len(expected)
    assert not ingest.errors


@settings(max_examples=150, deadline=None)
@given(engine_ops, st.data())
def test_faulty_delivery_with_replay_converges(Index, ops: list, data: st.DataObject) -> None:
    """Drop, duplicate and reorder batches; replaying from expected_seq must converge."""
    eng = run_engine(ops)
    n = len(eng.log)
    deliveries = data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=2 * n)) if n else []
    hasher, index = BlockHasher(B), Index()
    ingest = make_ingest(index, hasher)
    replays = 0
    for seq in [*deliveries, n - 1] if n else []:
        result = ingest.apply("w", seq, eng.log[seq])
        if result.status is SeqStatus.GAP:
            replays += 1
            for s in range(result.expected_seq, seq + 1):  # the agent's replay
                assert ingest.apply("w", s, eng.log[s]).status is SeqStatus.OK
        assert ingest.in_sync("w") or result.status is SeqStatus.DUPLICATE
    if n:
        assert ingest.in_sync("w")
        assert ingest.last_seq("w") == n - 1
        expected = eng.router_hashes(hasher)
        assert held(index, "w", expected) and len(index) == len(expected)


@settings(max_examples=60, deadline=None)
@given(engine_ops, engine_ops, st.data())
def test_workers_past_64_ingest_and_replay_like_the_first(
    Index, ops_a: list, ops_b: list, data: st.DataObject
) -> None:
    """130 workers (16 engines x 8 DP ranks needs 128): one in the first group of 64,
    one in the third, faulty interleaved delivery with replays."""
    engines = {"w3": run_engine(ops_a), "w129": run_engine(ops_b)}
    hasher, index = BlockHasher(B), Index()
    for i in range(130):
        index.add_worker(f"w{i}")
    ingest = make_ingest(index, hasher)
    pick = st.sampled_from([w for w, e in engines.items() if e.log])
    steps = (
        data.draw(st.lists(st.tuples(pick, st.integers(0, 30)), max_size=40))
        if any(e.log for e in engines.values())
        else []
    )
    for worker, s in [*steps, *((w, len(e.log) - 1) for w, e in engines.items() if e.log)]:
        log = engines[worker].log
        seq = s % len(log)
        result = ingest.apply(worker, seq, log[seq])
        if result.status is SeqStatus.GAP:
            for r in range(result.expected_seq, seq + 1):
                assert ingest.apply(worker, r, log[r]).status is SeqStatus.OK
    for worker, eng in engines.items():
        expected = eng.router_hashes(hasher)
        assert held(index, worker, expected)
        assert index.stats().workers[worker]["gpu"] == len(expected)
        assert ingest.in_sync(worker)
        assert ingest.last_seq(worker) == (len(eng.log) - 1 if eng.log else None)
    ingest.remove_worker("w129")
    assert ingest.last_seq("w129") is None and "w129" not in index.workers


def test_duplicate_batch_changes_nothing(Index) -> None:
    eng = Engine()
    eng.store(list(range(8)))
    ingest = make_ingest(Index(), BlockHasher(B))
    assert ingest.apply("w", 0, eng.log[0]).status is SeqStatus.OK
    assert ingest.apply("w", 0, eng.log[0]).status is SeqStatus.DUPLICATE
    assert ingest.duplicates == 1 and ingest.events_applied == 1


def test_gap_is_not_applied_and_marks_out_of_sync(Index) -> None:
    eng = Engine()
    eng.store(list(range(8)))
    eng.store([9] * 8)
    ingest = make_ingest(Index(), BlockHasher(B))
    ingest.apply("w", 0, eng.log[0])
    eng.store([7] * 8)
    result = ingest.apply("w", 2, eng.log[2])
    assert result.status is SeqStatus.GAP and result.expected_seq == 1
    assert not ingest.in_sync("w")
    assert ingest.apply("w", 1, eng.log[1]).status is SeqStatus.OK
    assert not ingest.in_sync("w")  # seq 2 was seen and is still missing
    assert ingest.apply("w", 2, eng.log[2]).status is SeqStatus.OK
    assert ingest.in_sync("w")


def test_joining_mid_stream_asks_for_history_from_zero(Index) -> None:
    eng = Engine()
    for i in range(3):
        eng.store([i] * 8)
    ingest = make_ingest(Index(), BlockHasher(B))
    result = ingest.apply("w", 2, eng.log[2])
    assert result.status is SeqStatus.GAP and result.expected_seq == 0


def test_restart_by_seq_zero_or_new_epoch_clears_the_worker(Index) -> None:
    hasher, index = BlockHasher(B), Index()
    ingest = make_ingest(index, hasher)
    old = Engine()
    old.store(list(range(8)))
    old.store([5] * 8)
    ingest.apply("w", 0, old.log[0])
    ingest.apply("w", 1, old.log[1])
    new = Engine()
    new.store([6] * 8)
    assert ingest.apply("w", 0, new.log[0]).status is SeqStatus.RESTART  # seq back to 0
    assert index.match(hasher.hash_tokens(list(range(8)))) == {}
    assert index.match(hasher.hash_tokens([6] * 8)) == {"w": 2}
    # epoch change with a seq that would otherwise look like a duplicate
    third = Engine()
    third.store([3] * 8)
    ingest.apply("w", 1, new.log[0], epoch="a")
    assert ingest.apply("w", 0, third.log[0], epoch="b").status is SeqStatus.RESTART
    assert index.match(hasher.hash_tokens([6] * 8)) == {}
    assert ingest.restarts == 2


def test_dump_replaces_state_and_reports_newer_batches_missing(Index) -> None:
    hasher, index = BlockHasher(B), Index()
    ingest = make_ingest(index, hasher)
    eng = Engine()
    for i in range(4):
        eng.store([i] * 8)
    ingest.apply("w", 0, eng.log[0])
    ingest.apply("w", 3, eng.log[3])  # gap: 1..2 missing, 3 seen
    dump = Engine()
    for i in range(3):
        dump.store([i] * 8)
    result = ingest.load_dump("w", 2, [decode(p) for p in dump.log])
    assert result.applied == 3
    assert not ingest.in_sync("w")  # seq 3 was seen after the dump point
    assert ingest.apply("w", 3, eng.log[3]).status is SeqStatus.OK
    assert ingest.in_sync("w")
    for i in range(4):
        assert index.match(hasher.hash_tokens([i] * 8)) == {"w": 2}


def test_malformed_batch_is_counted_and_asks_for_replay(Index) -> None:
    ingest = make_ingest(Index(), BlockHasher(B))
    result = ingest.apply("w", 0, b"\x93garbage")
    assert result.status is SeqStatus.MALFORMED and result.expected_seq == 0
    assert ingest.errors["malformed_batch"] == 1 and not ingest.in_sync("w")


def test_bad_events_are_counted_by_kind(Index) -> None:
    hasher, index = BlockHasher(B), Index()
    ingest = make_ingest(index, hasher)
    events = [
        BlockStored([1], None, list(range(6)), 6),  # wrong block size (not a multiple)
        BlockStored([2, 3], None, list(range(4)), B),  # token count
        BlockStored([4], 999, list(range(4)), B),  # unknown parent
        BlockStored([5], None, list(range(4)), B, medium="NVME?"),  # unknown medium
        BlockStored([6], None, list(range(4)), B, group_idx=1),  # sliding-window group
        BlockStored([7], None, list(range(4)), B),  # fine
    ]
    result = ingest.apply("w", 0, encode(EventBatch(0.0, events, 0)))
    assert result.applied == 1
    assert result.errors == {
        "block_size_mismatch": 1,
        "token_count_mismatch": 1,
        "unknown_parent": 1,
        "unknown_medium": 1,
        "other_kv_group": 1,
    }


def test_tiers_lora_and_extra_keys_follow_the_request_side_hashes(Index) -> None:
    hasher, index = BlockHasher(B), Index()
    ingest = make_ingest(index, hasher)
    toks = list(range(8))
    events = [
        BlockStored([1, 2], None, toks, B, medium="GPU"),
        BlockStored([1, 2], None, toks, B, medium="CPU"),
        BlockRemoved([2], "GPU"),
        BlockStored([3], None, toks[:4], B, lora_name="sql"),
        BlockStored([4], None, toks[:4], B, extra_keys=[["salt-a"]]),
    ]
    ingest.apply("w", 0, encode(EventBatch(0.0, events, 0)))
    tiers = index.match_tiers(hasher.hash_tokens(toks))["w"]
    assert (tiers.gpu, tiers.cpu) == (1, 2)
    assert index.match(hasher.hash_tokens(toks[:4], lora_name="sql")) == {"w": 1}
    salted = hasher.hash_tokens(toks[:4], block_extras={0: extra_key_bytes(["salt-a"])})
    assert index.match(salted) == {"w": 1}
    assert ingest.engine_hashes("w", hasher.hash_tokens(toks)) == [1, 2]


# Each medium the engines' kv_events sources name (index/ingest.py), by tier.
ENGINE_MEDIA = {
    "gpu": ["GPU", "DEVICE", None],
    "cpu": ["CPU", "CPU_PINNED", "CPU_TIER1", "HOST", "cpu_tier1"],
    "disk": ["DISK", "Disk", "LOCAL_DISK", "NVME", "FILE", "STORAGE", "CPU_TIER2"],
    "shared": ["SHARED", "REMOTE", "EXTERNAL", "NETWORK"],
}


@pytest.mark.parametrize("tier", list(ENGINE_MEDIA))
def test_every_engine_medium_lands_in_its_tier(Index, tier: str) -> None:
    """vLLM's offloading tiers and SGLang's HiCache tiers (``CPU_TIER1``, ``CPU_TIER2``)
    fell into ``unknown_medium``: a hit there was invisible to the policy."""
    hasher, index = BlockHasher(B), Index()
    ingest = make_ingest(index, hasher)
    media = ENGINE_MEDIA[tier]
    prompts = [list(range(100 * i, 100 * i + 4)) for i in range(len(media) + 1)]
    events = [
        BlockStored([1000 + i], None, toks, B, medium=medium)
        for i, (toks, medium) in enumerate(zip(prompts, [*media, "TAPE"], strict=True))
    ]
    result = ingest.apply("w", 0, encode(EventBatch(0.0, events, 0)))
    assert result.applied == len(media)
    assert result.errors == {"unknown_medium": 1}  # still counted, as before
    # TierMatch is cumulative (gpu <= cpu <= disk <= total): 0 up to the tier, then 1
    want = [int(i >= list(ENGINE_MEDIA).index(tier)) for i in range(4)]
    for toks in prompts[:-1]:
        tiers = index.match_tiers(hasher.hash_tokens(toks))["w"]
        assert [tiers.gpu, tiers.cpu, tiers.disk, tiers.total] == want, (tier, tiers)
    assert "w" not in index.match_tiers(hasher.hash_tokens(prompts[-1]))


def test_sglang_bigram_pairs_match_a_bigram_hasher(Index) -> None:
    hasher, index = BlockHasher(B, bigram=True), Index()
    ingest = make_ingest(index, hasher)
    pairs = [[t, t + 1] for t in range(8)]
    payload = msgpack.packb(
        [
            0.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [-1, -2],
                    "parent_block_hash": None,
                    "token_ids": pairs,
                    "block_size": B,
                    "lora_id": None,
                }
            ],
            None,
        ]
    )
    assert ingest.apply("w", 0, payload).applied == 1
    assert index.match(hasher.hash_tokens(list(range(9)))) == {"w": 2}


def test_garbage_never_escapes_the_ingest_loop(Index) -> None:
    ingest = make_ingest(Index(), BlockHasher(B))
    for seq, junk in enumerate([b"", b"\xff" * 9, msgpack.packb([1, [[None]], 0]), b"[]"]):
        ingest.apply("w", seq, junk)
    assert sum(ingest.errors.values()) >= 3


def test_with_epochs_a_late_seq_zero_is_a_duplicate_not_a_restart(Index) -> None:
    hasher, index = BlockHasher(B), Index()
    ingest = make_ingest(index, hasher)
    eng = Engine()
    eng.store(list(range(8)))
    eng.store([5] * 8)
    ingest.apply("w", 0, eng.log[0], epoch="e1")
    ingest.apply("w", 1, eng.log[1], epoch="e1")
    assert ingest.apply("w", 0, eng.log[0], epoch="e1").status is SeqStatus.DUPLICATE
    assert index.match(hasher.hash_tokens([5] * 8)) == {"w": 2}


def test_new_epoch_mid_stream_clears_and_asks_for_history(Index) -> None:
    hasher, index = BlockHasher(B), Index()
    ingest = make_ingest(index, hasher)
    eng = Engine()
    for i in range(3):
        eng.store([i] * 8)
    ingest.apply("w", 0, eng.log[0], epoch="a")
    result = ingest.apply("w", 2, eng.log[2], epoch="b")  # e.g. the agent restarted
    assert result.status is SeqStatus.GAP and result.expected_seq == 0
    assert index.match(hasher.hash_tokens([0] * 8)) == {} and not ingest.in_sync("w")
    for seq in range(3):  # the replay from 0, in the new epoch
        assert ingest.apply("w", seq, eng.log[seq], epoch="b").status is SeqStatus.OK
    assert ingest.in_sync("w") and ingest.restarts == 1


def test_an_epoch_start_clears_the_worker_and_expects_seq_0(Index) -> None:
    ingest = make_ingest(Index(), BlockHasher(4))
    stored = encode(EventBatch(0.0, [BlockStored([1], None, [1, 2, 3, 4], 4)]))
    clear = encode(EventBatch(0.0, [AllBlocksCleared()]))
    assert ingest.apply("w", 0, stored, epoch="a").status is SeqStatus.OK
    assert ingest.engine_blocks("w")
    result = ingest.apply("w", EPOCH_START_SEQ, clear, epoch="b")
    assert result.status is SeqStatus.RESTART and result.expected_seq == 0
    assert not ingest.engine_blocks("w") and ingest.in_sync("w") and ingest.restarts == 1
    again = ingest.apply("w", EPOCH_START_SEQ, clear, epoch="b")  # re-delivered
    assert again.status is SeqStatus.DUPLICATE
    assert ingest.apply("w", 0, stored, epoch="b").status is SeqStatus.OK
    assert ingest.engine_blocks("w") and ingest.in_sync("w")
    # a router that never saw the worker takes the marker as the start of its stream
    fresh = make_ingest(Index(), BlockHasher(4))
    assert fresh.apply("v", EPOCH_START_SEQ, clear, epoch="c").status is SeqStatus.RESTART
    assert fresh.in_sync("v") and fresh.apply("v", 0, stored, epoch="c").status is SeqStatus.OK


def test_blocks_a_multiple_of_the_block_size_are_split_and_removed_whole(Index) -> None:
    """vLLM 0.33 reports a coarser KV group's blocks (k router blocks, one hash each)."""
    hasher, index = BlockHasher(B), Index()
    ingest = make_ingest(index, hasher)
    toks = list(range(4 * B))
    events = [
        BlockStored([10], None, toks[: 2 * B], 2 * B, medium="GPU"),
        BlockStored([11], 10, toks[2 * B :], 2 * B, medium="GPU"),
    ]
    assert ingest.apply("w", 0, encode(EventBatch(0.0, events, 0))).applied == 2
    router = hasher.hash_tokens(toks)
    assert index.match_tiers(router)["w"].gpu == 4
    assert ingest.engine_blocks("w") == {10: router[1], 11: router[3]}
    ingest.apply("w", 1, encode(EventBatch(0.0, [BlockRemoved([11], "GPU")], 0)))
    assert index.match_tiers(router)["w"].gpu == 2


def test_remote_locality_is_the_shared_tier(Index) -> None:
    """vLLM 0.33's ``locality: "REMOTE"``: held in a store other nodes reach."""
    hasher, index = BlockHasher(B), Index()
    ingest = make_ingest(index, hasher)
    toks = list(range(2 * B))
    stored = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
              "token_ids": toks, "block_size": B, "lora_id": None, "medium": "CPU",
              "lora_name": None, "locality": "REMOTE"}  # fmt: skip
    ingest.apply("w", 0, msgpack.packb([0.0, [stored], None]))
    match = index.match_tiers(hasher.hash_tokens(toks))["w"]
    assert (match.gpu, match.cpu, match.disk, match.total) == (0, 0, 0, 2)
    removed = {"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU", "locality": "REMOTE"}
    ingest.apply("w", 1, msgpack.packb([0.0, [removed], None]))
    assert index.match_tiers(hasher.hash_tokens(toks))["w"].total == 1
