"""The agent's synchronous core: ring buffer, engine mirror, seq/epoch tracking, replies.

No sockets: batches come from the real engine cache model (``sim.cache``) or are built
by hand, and what the core answers is applied with the real ``EventIngest``.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core import AgentCore, Verdict
from agent.engine_zmq import END_SEQ, parse_live, parse_replay
from agent.load import parse_load
from agent.mirror import EngineMirror
from agent.ring import RingBuffer
from index.backend import make_ingest
from index.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode,
    encode,
)
from index.gapfill import GapFillMessage
from index.hashing import BlockHasher
from index.ingest import EventIngest
from index.prefix_index import PrefixIndex
from sim.cache import PrefixCache

BS = 4


def batch(*events: object, ts: float = 1.0, as_map: bool = False) -> bytes:
    return encode(EventBatch(ts, list(events), 0), events_as_map=as_map)  # type: ignore[arg-type]


def stored(hashes: list[int], parent: int | None, first_token: int = 1) -> BlockStored:
    tokens = list(range(first_token, first_token + BS * len(hashes)))
    return BlockStored(hashes, parent, tokens, BS, medium="GPU")


def apply_replay(ingest: EventIngest, worker: str, msgs: list[GapFillMessage]) -> None:
    """What a router does with an agent's reply stream."""
    end = msgs[-1]
    assert end.kind == "end"
    if end.dump:
        dumps = [decode(m.payload) for m in msgs if m.kind == "dump"]
        ingest.load_dump(worker, end.seq, dumps, epoch=end.epoch)
    else:
        for m in msgs[:-1]:
            assert m.kind == "batch"
            ingest.apply(worker, m.seq, m.payload, epoch=end.epoch)


# -- ring buffer ------------------------------------------------------------------------


def test_ring_serves_whole_runs_only() -> None:
    ring = RingBuffer(4)
    for seq in range(6):
        ring.append(seq, b"p%d" % seq, ok=seq != 4)
    assert (ring.oldest, ring.newest, len(ring)) == (2, 5, 4)
    assert ring.since(6) == []  # nothing new
    assert ring.since(5) == [(5, b"p5")]
    assert ring.since(3) is None  # crosses the undecodable batch 4
    assert ring.since(1) is None  # left the buffer
    assert ring.get(4) == b"p4" and ring.get(1) is None
    with pytest.raises(ValueError):
        ring.append(5, b"again")


def test_ring_with_a_lost_batch_is_not_whole() -> None:
    ring = RingBuffer(8)
    ring.append(0, b"a")
    ring.append(2, b"c")
    assert ring.since(0) is None
    assert ring.since(2) == [(2, b"c")]


# -- seq and epochs ---------------------------------------------------------------------


def test_classify_next_gap_duplicate_restart() -> None:
    core = AgentCore(16, epoch_factory=iter(["e1", "e2"]).__next__)
    assert core.classify(3, b"x") is Verdict.GAP  # joined late: 0..2 are missing
    p0, p1 = batch(stored([10], None), ts=1), batch(stored([11], 10), ts=2)
    assert core.classify(0, p0) is Verdict.NEXT
    acc = core.accept(0, p0)
    assert acc is not None and (acc.seq, acc.epoch, acc.payload) == (0, "e1", p0)
    core.accept(1, p1)
    assert core.classify(1, p1) is Verdict.DUPLICATE  # replay and live stream overlap
    restarted = batch(stored([99], None), ts=9)
    assert core.classify(0, restarted) is Verdict.RESTART
    core.restart()
    assert core.epoch == "e2" and core.last_seq is None and len(core.mirror) == 0
    assert core.classify(0, restarted) is Verdict.NEXT
    assert core.counters["restarts"] == 1


def test_lost_batches_are_counted_and_make_dumps_incomplete() -> None:
    core = AgentCore(16)
    core.accept(0, batch(stored([10], None)))
    core.accept(3, batch(stored([20], None)))
    assert core.counters["lost_batches"] == 2 and not core.complete
    msgs = core.gap_fill(0)  # the ring has a hole: only a dump can answer
    assert msgs[-1].dump and core.counters["incomplete_dumps"] == 1


def test_undecodable_batch_is_not_published_and_forces_a_dump() -> None:
    core = AgentCore(16)
    core.accept(0, batch(stored([10], None)))
    assert core.accept(1, b"\xc1 not msgpack") is None
    core.accept(2, batch(stored([11], 10, first_token=50)))
    assert core.counters["bad_payloads"] == 1
    assert core.classify(1, b"\xc1 not msgpack") is Verdict.DUPLICATE  # kept as a hole
    assert core.gap_fill(2)[0].kind == "batch"
    msgs = core.gap_fill(1)
    assert [m.kind for m in msgs] == ["dump", "end"] and msgs[-1].seq == 2


def test_replay_before_any_batch_is_an_empty_end() -> None:
    core = AgentCore(4, epoch_factory=lambda: "e")
    msgs = core.gap_fill(0)
    assert len(msgs) == 1 and (msgs[0].kind, msgs[0].seq, msgs[0].epoch) == ("end", -1, "e")


def test_replay_batches_then_dump_once_the_ring_moved_on() -> None:
    core = AgentCore(3)
    payloads = [
        batch(stored([1, 2], None)),
        batch(stored([3], 2, first_token=100)),
        batch(BlockRemoved([3], "GPU")),
        batch(stored([4], 2, first_token=200)),
    ]
    for seq, p in enumerate(payloads):
        core.accept(seq, p)
    msgs = core.gap_fill(2)
    assert [(m.kind, m.seq) for m in msgs] == [("batch", 2), ("batch", 3), ("end", 3)]
    assert not msgs[-1].dump
    msgs = core.gap_fill(0)  # seq 0 left the 3-batch ring
    assert msgs[-1].dump and msgs[-1].seq == 3 and msgs[-1].epoch == core.epoch
    # A router that loads the dump knows exactly what one that saw every batch knows.
    hasher = BlockHasher(BS)
    live, dumped = make_ingest(PrefixIndex(), hasher), make_ingest(PrefixIndex(), hasher)
    for seq, p in enumerate(payloads):
        live.apply("w", seq, p)
    apply_replay(dumped, "w", msgs)
    assert (
        dumped.engine_blocks("w") == live.engine_blocks("w") and len(live.engine_blocks("w")) == 3
    )
    assert dumped.in_sync("w") and dumped.last_seq("w") == 3
    later = batch(stored([5], 4, first_token=300))
    assert dumped.apply("w", 4, later).status.value == "ok"
    assert core.gap_fill(9)[-1].dump  # a seq this epoch never reached: another life


# -- the mirror -------------------------------------------------------------------------


def test_mirror_tiers_orphans_clear_and_chunks() -> None:
    m = EngineMirror()
    m.apply(decode(batch(stored([1, 2, 3], None))))
    m.apply(decode(batch(BlockStored([2], 1, [5, 6, 7, 8], BS, medium="CPU"))))
    m.apply(decode(batch(BlockRemoved([2], "GPU"))))
    assert m.hashes("GPU") == {1, 3} and m.hashes("CPU") == {2}
    assert m.tokens_of([1, 2, 3, 4]) == list(range(1, 13))  # held in some tier, 4 is not
    m.apply(decode(batch(BlockRemoved([2], "CPU"))))
    # 3's parent is gone: a dump cannot describe it, so it is left out.
    events = [e for c in m.dump() for e in decode(c).events]
    assert [e.block_hashes for e in events] == [[1]]
    m.apply(decode(batch(stored([7, 8, 9], None, first_token=40))))
    chunks = m.dump(max_tokens=2 * BS)
    # Parents first; a chain becomes one multi-block event within a chunk.
    assert [[e.block_hashes for e in decode(c).events] for c in chunks] == [[[1], [7]], [[8, 9]]]
    assert decode(chunks[1]).events[0].token_ids == list(range(44, 52))
    m.apply(decode(batch(AllBlocksCleared())))
    assert len(m) == 0 and m.dump() == []


def test_dump_keeps_extra_keys_salts_and_loras() -> None:
    hasher = BlockHasher(BS)
    events = [
        BlockStored([1, 2, 3], None, list(range(12)), BS, medium="GPU",
                    extra_keys=[None, ["img-hash"], None]),
        BlockStored([4], 3, list(range(12, 16)), BS, medium="GPU"),
        BlockStored([5, 6], None, list(range(8)), BS, medium="GPU", cache_salt="s"),
        BlockStored([7], None, list(range(4)), BS, medium="GPU", lora_name="ad"),
    ]  # fmt: skip
    payloads = [batch(e, as_map=True) for e in events]  # maps: SGLang's cache_salt
    core = AgentCore(1)
    live = make_ingest(PrefixIndex(), hasher)
    for seq, p in enumerate(payloads):
        core.accept(seq, p)
        live.apply("w", seq, p)
    dumped = make_ingest(PrefixIndex(), hasher)
    apply_replay(dumped, "w", core.gap_fill(0))
    assert dumped.engine_blocks("w") == live.engine_blocks("w")
    assert len(set(live.engine_blocks("w").values())) == 7  # salt and LoRA changed hashes


# -- against the engine cache model -----------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 7), st.integers(0, 3)), min_size=1, max_size=40
    ),
    ring=st.integers(1, 6),
    host=st.sampled_from([0, 6]),
)
def test_mirror_and_dump_track_the_engine_cache(
    ops: list[tuple[int, int, int]], ring: int, host: int
) -> None:
    """Random requests through the real cache model: the mirror holds what the cache
    holds, per tier, and a router fed only the latest dump matches prompts exactly
    like one that saw every batch (and like the cache itself)."""
    cache = PrefixCache(BS, gpu_blocks=12, host_blocks=host)
    core = AgentCore(ring)
    hasher = BlockHasher(BS)
    live = make_ingest(PrefixIndex(), hasher)
    prompts: list[list[int]] = []
    seq = 0
    for i, (family, blocks, extra) in enumerate(ops):
        prompt = [family * 1000 + t for t in range(blocks * BS)] + [7] * extra
        prompts.append(prompt)
        if cache.allocate(f"r{i}", prompt, reserve_tokens=2) is None:
            continue
        cache.commit(f"r{i}", len(prompt))
        cache.release(f"r{i}")
        events = cache.drain_events()
        if events:
            payload = batch(*events, ts=float(seq))
            core.accept(seq, payload)
            live.apply("w", seq, payload)
            seq += 1
        assert core.mirror.hashes("GPU") == cache.gpu_hashes()
        assert core.mirror.hashes("CPU") == cache.host_hashes()
    dumped = make_ingest(PrefixIndex(), hasher)
    msgs = core.gap_fill(0)
    assert msgs[-1].dump == (seq > ring)  # batches while the ring still has seq 0
    apply_replay(dumped, "w", msgs)
    assert dumped.in_sync("w")
    for prompt in prompts:
        gpu, host_more = cache.lookup(cache.hash_blocks(prompt))
        router = hasher.hash_tokens(prompt)
        for ingest in (live, dumped):
            got = ingest.index.match_tiers(router).get("w")
            assert ((got.gpu, got.cpu) if got else (0, 0)) == (gpu, gpu + host_more)


# -- wire helpers -----------------------------------------------------------------------


def test_zmq_frame_parsing() -> None:
    assert parse_live([b"", (5).to_bytes(8, "big"), b"p"]) == (5, b"p")
    assert parse_live([b"", b"\x05", b"p"]) is None
    assert parse_live([b"only"]) is None
    seq = (7).to_bytes(8, "big")
    assert parse_replay([b"", seq, b"p"]) == (7, b"p")  # DEALER, vLLM <= PR #45177
    assert parse_replay([b"", b"topic", seq, b"p"]) == (7, b"p")  # with the topic frame
    assert parse_replay([b"", END_SEQ, b""]) == (-1, b"")
    assert parse_replay([b"", b"short", b"p"]) is None


VLLM_METRICS = """
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
"""

SGLANG_METRICS = """
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 4.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 6.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.75
"""

OLD_VLLM_METRICS = """
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc 0.1
"""


def test_load_from_vllm_sglang_and_old_vllm_metrics() -> None:
    r = parse_load(VLLM_METRICS, ts=5.0)
    # counts summed over DP ranks; usage is the fullest rank's (the one that queues)
    assert (r.running, r.waiting, r.kv_usage, r.ts) == (5, 1, 0.5, 5.0)
    assert r.to_json() == {"running": 5, "waiting": 1, "kv_usage": 0.5, "ts": 5.0}
    r = parse_load(SGLANG_METRICS)
    assert (r.running, r.waiting, r.kv_usage) == (4, 6, 0.75)
    assert parse_load(OLD_VLLM_METRICS).kv_usage == pytest.approx(0.1)
    with pytest.raises(ValueError):
        parse_load("# TYPE other gauge\nother 1.0\n")


def test_random_redelivery_never_breaks_order() -> None:
    """Batches fed in a shuffled, duplicated order, each only once it is next, as the
    shell does: the core accepts each seq exactly once."""
    rng = random.Random(3)
    payloads = [batch(stored([100 + i], None if i == 0 else 99 + i, i * 10)) for i in range(30)]
    core = AgentCore(64)
    arrivals = [s for s in range(30) for _ in range(rng.randint(1, 3))]
    rng.shuffle(arrivals)
    accepted: list[int] = []
    pending = set()
    for s in arrivals:
        pending.add(s)
        while core.expected in pending:
            nxt = core.expected
            verdict = core.classify(nxt, payloads[nxt])
            assert verdict is Verdict.NEXT
            core.accept(nxt, payloads[nxt])
            accepted.append(nxt)
        if s < core.expected:
            assert core.classify(s, payloads[s]) is Verdict.DUPLICATE
    assert accepted == list(range(30))
