"""The disaggregated choice: decode by load and KV room, prefill by the cache-aware
estimate, and the local-prefill threshold (llm-d's decode-first rule)."""

from __future__ import annotations

import random

import pytest

from index.hashing import cacheable_blocks
from index.prefix_index import TierMatch
from policies import RouteRequest, WorkerView, make_policy, make_prefill_policy
from policies.base import NoWorkerError
from policies.pd import DECODE_POLICIES, DecodeLoad, choose, make_decode_policy

BS = 16


def request(tokens: int = 1024, rid: str = "r", max_tokens: int | None = 128) -> RouteRequest:
    return RouteRequest(rid, "m", tokens, list(range(tokens // BS)), BS, max_tokens=max_tokens)


def view(wid: str, blocks: int = 0, **load: object) -> WorkerView:
    return WorkerView(wid, TierMatch(blocks, blocks, blocks, blocks), **load)  # type: ignore[arg-type]


def test_decode_goes_to_the_engine_with_fewer_streams():
    policy = DecodeLoad(random.Random(0))
    busy = view("d0", decode_streams=40, inflight_requests=40)
    idle = view("d1", decode_streams=2, inflight_requests=2)
    decision = policy.select(request(), [busy, idle])
    assert decision.worker_id == "d1"
    assert decision.scores["d0"]["tpot_ms"] > decision.scores["d1"]["tpot_ms"]


def test_engine_reports_count_when_larger_than_the_routers_own():
    policy = DecodeLoad(random.Random(0))
    other_routers = view("d0", engine_running=60)
    decision = policy.select(request(), [other_routers, view("d1", decode_streams=3)])
    assert decision.worker_id == "d1" and decision.scores["d0"]["streams"] == 60


def test_its_own_prefix_means_less_to_transfer():
    policy = DecodeLoad(random.Random(0))
    decision = policy.select(request(4096), [view("d0"), view("d1", blocks=200)])
    assert decision.worker_id == "d1"
    assert decision.scores["d1"]["transfer_ms"] < decision.scores["d0"]["transfer_ms"]


def test_transfer_weight_scales_what_a_held_prefix_is_worth():
    # d1 holds the prompt but decodes 6 more streams: ~0.3 ms more per token
    views = [view("d0", decode_streams=2), view("d1", blocks=255, decode_streams=8)]
    req = request(4096, max_tokens=64)
    held = DecodeLoad(random.Random(0), transfer_weight=1.0).select(req, views)
    assert held.worker_id == "d1"  # 53 ms of transfer saved outweigh 19 ms of decoding
    blind = DecodeLoad(random.Random(0)).select(req, views)  # the default weight, 0
    assert blind.worker_id == "d0"
    assert blind.scores["d0"]["transfer_ms"] == held.scores["d0"]["transfer_ms"] > 0
    with pytest.raises(ValueError, match="transfer_weight"):
        DecodeLoad(transfer_weight=-1.0)


def test_among_equal_engines_the_one_holding_the_prompt_wins():
    views = [view("d0"), view("d1", blocks=100), view("d2", blocks=200), view("d3")]
    for seed in range(16):  # not a coin toss
        decision = DecodeLoad(random.Random(seed)).select(request(4096), views)
        assert decision.worker_id == "d2"
    # equal holdings: at random among them
    views = [view("d0", blocks=200), view("d1", blocks=200), view("d2")]
    chosen = {
        DecodeLoad(random.Random(s)).select(request(4096), views).worker_id for s in range(16)
    }
    assert chosen == {"d0", "d1"}


def test_a_full_engine_is_avoided_unless_all_are_full():
    policy = DecodeLoad(random.Random(0))
    full = view("d0", kv_usage=0.97)
    busy = view("d1", decode_streams=30, kv_usage=0.5)
    assert policy.select(request(), [full, busy]).worker_id == "d1"
    both = [full, view("d1", decode_streams=30, kv_usage=0.99)]
    assert policy.select(request(), both).worker_id == "d0"


def test_context_in_flight_counts_until_finished():
    policy = DecodeLoad(random.Random(0))
    long = request(30_000, "a")
    loaded = policy.select(long, [view("d0"), view("d1")]).worker_id
    assert policy.select(long, [view("d0"), view("d1")]).worker_id  # a retry counts once
    other = "d1" if loaded == "d0" else "d0"
    second = policy.select(request(1024, "b"), [view("d0"), view("d1")])
    assert second.worker_id == other  # 30K tokens of context make every step slower there
    retried = policy.select(long, [view(loaded)])
    assert retried.scores[loaded]["context_tokens"] == 0  # its own earlier count was dropped
    policy.on_finish(long, loaded)
    after = policy.select(request(1024, "c"), [view(loaded)])
    assert after.scores[loaded]["context_tokens"] == 0


def test_remote_prefill_goes_to_the_prefix_holder():
    prefill = make_policy("cache_aware", random.Random(0))
    decode = DecodeLoad(random.Random(0))
    pd = choose(
        request(4096),
        [view("p0"), view("p1", blocks=250)],
        [view("d0"), view("d1")],
        prefill,
        decode,
        local_prefill_tokens=256,
    )
    assert pd.prefill is not None and pd.prefill.worker_id == "p1"
    assert pd.uncached_on_decode == 4096 and pd.reason == "remote prefill"


def test_a_prefill_holder_of_most_of_the_prompt_keeps_it_through_a_long_queue():
    # p1 holds all of an 8K prompt behind ~7 s of queued prefill (140K tokens); leaving
    # recomputes 8K tokens (~0.4 s) on an idle p0. A flat weight 8 leaves (7 s > 9 x
    # 0.4 s); the prefill side's share term (weight 6 x (1 + 4 x 1.0)) stays. A holder
    # of a tenth of the prompt is still left: the term is the holder's share.
    req = request(8192)
    full = cacheable_blocks(8192, BS)
    for blocks, flat, shared in ((full, "p0", "p1"), (full // 10, "p0", "p0")):
        views = [view("p0"), view("p1", blocks=blocks, inflight_requests=14,
                                  inflight_prefill_tokens=140_000)]  # fmt: skip
        old = make_policy("cache_aware", random.Random(0), recompute_weight=8.0, recompute_share=0)
        assert old.select(req, views).worker_id == flat
        assert (
            make_prefill_policy("cache_aware", random.Random(0)).select(req, views).worker_id
            == shared
        )
    with pytest.raises(ValueError, match="recompute_share"):
        make_policy("cache_aware", recompute_share=-1.0)


def test_a_short_uncached_suffix_is_prefilled_by_the_decode_engine():
    prefill = make_policy("cache_aware", random.Random(0))
    decode = DecodeLoad(random.Random(0))
    prefills = [view("p0"), view("p1", blocks=250)]
    held = [view("d0", blocks=250)]  # the decode engine holds all but 96 tokens
    pd = choose(request(4096), prefills, held, prefill, decode, local_prefill_tokens=256)
    assert pd.prefill is None and pd.uncached_on_decode == 4096 - 250 * BS
    assert pd.reason.startswith("local prefill")
    pd = choose(request(4096), prefills, held, prefill, decode, local_prefill_tokens=96)
    assert pd.prefill is not None  # 96 is not under 96
    # an out-of-sync decode engine is taken to hold nothing
    stale = [WorkerView("d0", TierMatch(250, 250, 250, 250), in_sync=False)]
    pd = choose(request(4096), prefills, stale, prefill, decode, local_prefill_tokens=256)
    assert pd.prefill is not None and pd.uncached_on_decode == 4096


def test_no_prefill_engine_means_local_prefill_and_no_decode_engine_an_error():
    prefill = make_policy("cache_aware", random.Random(0))
    decode = DecodeLoad(random.Random(0))
    down = WorkerView("p0", healthy=False)
    pd = choose(request(), [down], [view("d0")], prefill, decode)
    assert pd.prefill is None and pd.decode.worker_id == "d0"
    assert pd.reason == "local prefill: no usable prefill engine"
    with pytest.raises(NoWorkerError):
        choose(request(), [view("p0")], [], prefill, decode)


def test_decode_policies_by_name():
    assert DECODE_POLICIES[0] == "decode_load" and "power_of_two" in DECODE_POLICIES
    assert isinstance(make_decode_policy("decode_load", kv_full=0.9), DecodeLoad)
    assert make_decode_policy("round_robin").name == "round_robin"
    with pytest.raises(ValueError, match="kv_full"):
        make_decode_policy("decode_load", kv_full=2)
    with pytest.raises(ValueError, match="decode_load"):
        make_decode_policy("decode_load", nope=1)
