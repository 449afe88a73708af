"""Policy registry, cache-blind baselines and session affinity; properties of every policy."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.prefix_index import TierMatch
from policies import (
    POLICY_NAMES,
    Decision,
    NoWorkerError,
    Policy,
    RouteRequest,
    WorkerView,
    make_policy,
    policy_params,
)


def req(i: int = 0, session: str | None = None, blocks: int = 8, bs: int = 16) -> RouteRequest:
    hashes = [hash((i, b)) & (2**64 - 1) for b in range(blocks)]
    return RouteRequest(f"r{i}", "m", blocks * bs, hashes, bs, session_key=session)


def idle(n: int) -> list[WorkerView]:
    return [WorkerView(f"w{i}") for i in range(n)]


# -- registry -------------------------------------------------------------------------
def test_every_name_builds_and_names_match() -> None:
    assert set(POLICY_NAMES) == {
        "round_robin",
        "random",
        "least_load",
        "power_of_two",
        "session_affinity",
        "sglang_cache_aware",
        "dynamo_kv",
        "cache_aware",
    }
    for name in POLICY_NAMES:
        policy = make_policy(name, random.Random(0))
        assert isinstance(policy, Policy)
        assert policy.name == name


def test_unknown_name_and_parameter_are_clear_value_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'nope'.*round_robin"):
        make_policy("nope")
    with pytest.raises(ValueError, match=r"no parameter.*'cache_threshold'.*known: "):
        make_policy("dynamo_kv", cache_threshold=0.5)
    with pytest.raises(ValueError, match="no parameter"):
        make_policy("round_robin", anything=1)
    with pytest.raises(ValueError, match="load_factor"):
        make_policy("session_affinity", load_factor=0.5)
    with pytest.raises(ValueError, match="cache_threshold"):
        make_policy("sglang_cache_aware", cache_threshold=1.5)
    with pytest.raises(ValueError, match="temperature"):
        make_policy("dynamo_kv", temperature=-1)
    with pytest.raises(ValueError, match="unknown EngineCosts field"):
        make_policy("cache_aware", costs={"prefill_ms_per_tok": 1.0})


def test_policy_params_lists_defaults() -> None:
    assert policy_params("sglang_cache_aware") == {
        "cache_threshold": 0.3,
        "balance_abs_threshold": 64,
        "balance_rel_threshold": 1.5,
        "max_tree_size": 2**20,
    }
    assert policy_params("session_affinity")["load_factor"] == 1.25
    assert policy_params("round_robin") == {}


# -- properties of every policy -------------------------------------------------------
_match = st.builds(
    lambda g, c, d, t: TierMatch(g, g + c, g + c + d, g + c + d + t),
    *(st.integers(0, 3) for _ in range(4)),
)
_view = st.builds(
    WorkerView,
    worker_id=st.just(""),
    match=_match,
    inflight_requests=st.integers(0, 200),
    inflight_prefill_tokens=st.integers(0, 100_000),
    decode_streams=st.integers(0, 100),
    engine_running=st.none() | st.integers(0, 300),
    engine_waiting=st.none() | st.integers(0, 300),
    kv_usage=st.none() | st.floats(0, 1),
    healthy=st.booleans(),
    in_sync=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(POLICY_NAMES),
    views=st.lists(_view, min_size=1, max_size=9),
    session=st.none() | st.text(max_size=8),
    seed=st.integers(0, 2**32),
    rounds=st.integers(1, 4),
)
def test_every_policy_picks_a_healthy_candidate(
    name: str, views: list[WorkerView], session: str | None, seed: int, rounds: int
) -> None:
    for i, v in enumerate(views):
        v.worker_id = f"w{i}"
    policy = make_policy(name, random.Random(seed))
    healthy_ids = {v.worker_id for v in views if v.healthy}
    for r in range(rounds):
        request = req(r, session, blocks=12)
        if not healthy_ids:
            with pytest.raises(NoWorkerError):
                policy.select(request, views)
            continue
        decision = policy.select(request, views)
        assert isinstance(decision, Decision)
        assert decision.worker_id in healthy_ids
        if decision.prefetch is not None:
            assert decision.prefetch.target_worker == decision.worker_id
            assert decision.prefetch.source_worker != decision.worker_id or (
                decision.prefetch.tier == "shared"
            )
        policy.on_finish(request, decision.worker_id)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_workers_at_all_raises(name: str) -> None:
    with pytest.raises(NoWorkerError):
        make_policy(name).select(req(), [])


# -- baselines ------------------------------------------------------------------------
def test_round_robin_spreads_evenly_and_skips_unhealthy() -> None:
    policy = make_policy("round_robin")
    views = idle(4)
    counts = Counter(policy.select(req(i), views).worker_id for i in range(400))
    assert counts == {f"w{i}": 100 for i in range(4)}
    views[2].healthy = False
    counts = Counter(policy.select(req(i), views).worker_id for i in range(300))
    assert counts == {"w0": 100, "w1": 100, "w3": 100}


def test_random_covers_all_workers() -> None:
    policy = make_policy("random", random.Random(1))
    counts = Counter(policy.select(req(i), idle(4)).worker_id for i in range(4000))
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert min(counts.values()) > 850


def test_least_load_prefers_idle_then_fewer_prefill_tokens_then_random() -> None:
    policy = make_policy("least_load", random.Random(2))
    views = [WorkerView(f"w{i}", inflight_requests=3) for i in range(4)]
    views[2].inflight_requests = 1
    assert policy.select(req(), views).worker_id == "w2"
    views[2].inflight_requests = 3
    for v, tokens in zip(views, (500, 100, 900, 100), strict=True):
        v.inflight_prefill_tokens = tokens
    picks = Counter(policy.select(req(i), views).worker_id for i in range(400))
    assert set(picks) == {"w1", "w3"}  # equal load: both, at random
    assert min(picks.values()) > 150


def test_power_of_two_prefers_the_idle_worker() -> None:
    policy = make_policy("power_of_two", random.Random(3))
    views = [WorkerView(f"w{i}", inflight_requests=10) for i in range(2)]
    views[1].inflight_requests = 0
    assert all(policy.select(req(i), views).worker_id == "w1" for i in range(50))
    # with 4 workers the busiest one is never chosen (it always loses its pair)
    views = [WorkerView(f"w{i}", inflight_requests=i) for i in range(4)]
    picks = Counter(policy.select(req(i), views).worker_id for i in range(600))
    assert "w3" not in picks
    assert picks["w0"] > picks["w1"] > picks["w2"] > 0


# -- session affinity -----------------------------------------------------------------
def test_session_affinity_sticks_to_one_worker() -> None:
    policy = make_policy("session_affinity")
    views = idle(8)
    for s in range(50):
        homes = {policy.select(req(i, f"user{s}"), views).worker_id for i in range(5)}
        assert len(homes) == 1
    spread = Counter(policy.select(req(0, f"user{s}"), views).worker_id for s in range(800))
    assert len(spread) == 8 and min(spread.values()) > 40


def test_session_affinity_moves_only_the_lost_workers_sessions() -> None:
    policy = make_policy("session_affinity")
    views = idle(8)
    sessions = [f"s{i}" for i in range(600)]
    before = {s: policy.select(req(0, s), views).worker_id for s in sessions}
    # unhealthy: skipped on the ring
    views[3].healthy = False
    sick = {s: policy.select(req(0, s), views).worker_id for s in sessions}
    # removed: the ring is rebuilt without it
    gone = {s: policy.select(req(0, s), views[:3] + views[4:]).worker_id for s in sessions}
    for after in (sick, gone):
        moved = {s for s in sessions if after[s] != before[s]}
        assert moved == {s for s in sessions if before[s] == "w3"}
        assert moved and all(after[s] != "w3" for s in moved)
    assert sick == gone
    # the worker comes back: its sessions return, nobody else moves
    views[3].healthy = True
    assert {s: policy.select(req(0, s), views).worker_id for s in sessions} == before


def test_session_affinity_ring_forgets_long_gone_workers() -> None:
    policy = make_policy("session_affinity", vnodes=4)
    for gen in range(10):  # the whole pool is replaced ten times over
        ws = [WorkerView(f"g{gen}-{i}") for i in range(3)]
        assert policy.select(req(0, "s"), ws).worker_id.startswith(f"g{gen}-")
    assert len(policy._points) <= 2 * 3 * 4


def test_session_affinity_stable_across_instances_and_list_order() -> None:
    views = idle(6)
    a = make_policy("session_affinity", random.Random(1))
    b = make_policy("session_affinity", random.Random(2))
    for s in range(100):
        key = f"k{s}"
        assert (
            a.select(req(0, key), views).worker_id == b.select(req(0, key), views[::-1]).worker_id
        )


def test_session_affinity_spills_a_hot_session_under_bounded_load() -> None:
    policy = make_policy("session_affinity")
    views = idle(4)
    home = policy.select(req(0, "hot"), views).worker_id
    load = Counter[str]()
    for i in range(40):  # one session floods the pool, nothing finishes
        for v in views:
            v.inflight_requests = load[v.worker_id]
        d = policy.select(req(i, "hot"), views)
        load[d.worker_id] += 1
        total = sum(load.values())
        # bound: ceil(1.25 * total / 4) after placing, for every worker
        assert max(load.values()) <= -(-5 * total // 16)
    assert load[home] == max(load.values())
    assert len(load) == 4  # it spilled to every worker, in ring order


def test_session_affinity_without_key_is_least_load() -> None:
    policy = make_policy("session_affinity", random.Random(0))
    views = [WorkerView(f"w{i}", inflight_requests=5) for i in range(4)]
    views[1].inflight_requests = 0
    d = policy.select(req(0, None), views)
    assert d.worker_id == "w1"
    assert "least load" in d.reason


@given(st.integers(0, 64), st.integers(0, 64))
def test_prefix_depth_is_the_first_depth_not_held(n, held_up_to):
    from policies.base import prefix_depth

    calls: list[int] = []

    def held(i: int) -> bool:
        calls.append(i)
        return i < held_up_to

    assert prefix_depth(n, held) == min(n, held_up_to)
    assert all(0 <= i < n for i in calls)
    assert len(calls) <= n.bit_length()  # a search, not a scan
