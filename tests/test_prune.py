"""The pruned decision against the unpruned one (router/routing/prune.py).

Two routers built alike over a wide pool (72 to 160 targets, past ``PRUNE_ABOVE``), the
same holdings (shared prefixes, some below GPU), loads (few distinct values: many ties),
engine reports, a worker down or draining now and then, and the same requests (some in
sessions), with the policy's draws seeded alike; one prunes, the other sees every
candidate. Whenever the pruned candidates hold the unpruned winner and every candidate
tied with it, the decision is the same: worker, reason, prefetch hint and the scores of
the kept candidates, request after request (so the policy's state stays the same too).
Each decision starts from the same policy state on both (the unpruned decision is the one
both go on with). When the kept set lacks part of the tie class, the pruned choice is a
usable kept candidate, mostly another draw from the same class; ``least_load`` never
misses the class (the board orders by its key), the others rarely.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from index import _native
from policies.base import Decision, RouteRequest, WorkerView
from policies.selection import load_key
from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterState
from router.routing.decide import Parsed, Prepared
from router.routing.prune import KEEP, PRUNE_ABOVE, TIE_CAP
from router.workers.load import EngineLoad, Flight

pytestmark = pytest.mark.skipif(
    not hasattr(_native, "LoadBoard"), reason="the native core predates the load board"
)

BLOCK = 16
POLICIES = ("least_load", "dynamo_kv", "cache_aware", "sglang_cache_aware")


def _state(nodes: int, dp: int, policy: str, seed: int) -> RouterState:
    specs = [
        WorkerSpec(f"n{i}", f"http://127.0.0.1:{9000 + i}", model="m", dp_size=dp)
        for i in range(nodes)
    ]
    cfg = RouterConfig(workers=specs, forecast_tracked=0, block_size=BLOCK, policy=policy)
    st = RouterState(cfg)
    _policy(st).rng = random.Random(seed)
    return st


def _policy(st: RouterState) -> Any:
    return st.router.experiment.policy_for(st.router.experiment.arms[0])


def _prep(st: RouterState, i: int, chain: list[int], session: str | None) -> Prepared:
    parsed = Parsed("chat", {"model": "m"}, "m", False, session, f"r{i}", None)
    ntok = len(chain) * BLOCK + 5
    request = RouteRequest(f"r{i}", "m", ntok, chain, BLOCK, session_key=session)
    return st.router.prepared(parsed, st.registry.for_model("m"), request)


def _ranked(policy: str, view: WorkerView, d: Decision, tie_ms: float) -> float:
    s = d.scores.get(view.worker_id)
    if policy == "least_load":
        return 0.0
    assert s is not None
    if policy == "dynamo_kv":
        return s["logit"]
    ranked = s["ttft_ms"] + s["recompute_ms"]
    if s["prefetch_blocks"]:
        ranked += s["prefetch_risk_ms"] + tie_ms
    return ranked


def _tie_class(policy: str, views: list[WorkerView], d: Decision, tie_ms: float) -> set[str]:
    """Every candidate the unpruned policy could have drawn."""
    if policy == "least_load":
        lo = min(load_key(v) for v in views)
        return {v.worker_id for v in views if load_key(v) == lo}
    if policy == "sglang_cache_aware":
        return {d.worker_id}
    ranked = {v.worker_id: _ranked(policy, v, d, tie_ms) for v in views}
    lo = min(ranked.values()) + (tie_ms if policy == "cache_aware" else 0.0)
    return {w for w, r in ranked.items() if r <= lo}


def _world(seed: int, policy: str) -> tuple[list[RouterState], random.Random, list[list[int]]]:
    rng = random.Random(seed)
    nodes, dp = rng.choice([(9, 8), (12, 8), (20, 8), (40, 4)])
    pair = [_state(nodes, dp, policy, seed), _state(nodes, dp, policy, seed)]
    _policy(pair[1]).prunable = lambda request: False
    targets = [t for w in pair[0].registry for t in w.targets]
    assert len(targets) > PRUNE_ABOVE
    fams = [[rng.getrandbits(63) for _ in range(rng.randrange(2, 12))] for _ in range(4)]
    chains = []
    for _ in range(3 * len(targets) // 2):
        chain = rng.choice(fams) + [rng.getrandbits(63) for _ in range(rng.randrange(0, 30))]
        chains.append(chain)
        holders = rng.sample(targets, rng.choice([1, 1, 2, 5, len(targets) // 2]))
        for t in holders:
            depth = rng.randrange(1, len(chain) + 1)
            tier = rng.choice(["gpu", "gpu", "gpu", "cpu", "disk"])
            for st in pair:
                index = next(iter(st.registry)).pool.index
                index.store(t, chain[:depth])
                if tier != "gpu":
                    index.store(t, chain[:depth], tier)
    loads = rng.choice([(0, 1), (0, 3), (0, 10)])
    tokens = rng.choice([(0,), (0, 512), (0, 512, 4096, 20000)])
    for wi, _ in enumerate(pair[0].registry):
        report = EngineLoad(running=rng.randrange(4), waiting=rng.choice([0, 0, 2]))
        n_flights = [rng.randint(*loads) for _ in range(dp)]
        sizes = [[rng.choice(tokens) for _ in range(k)] for k in n_flights]
        down = rng.random() < 0.05
        for st in pair:
            w = list(st.registry)[wi]
            w.load.report(report)
            for load, flights in zip(w.rank_loads, sizes, strict=True):
                for t in flights:
                    load.begin(t)
            w.healthy = not down
    behind = rng.sample(targets, rng.choice([0, 0, 1, 3]))
    for st in pair:  # targets whose events are out of sync: their hits do not count
        ingest = next(iter(st.registry)).pool.ingest
        for t in behind:
            ingest.mark_out_of_sync(t)
    return pair, rng, chains


def _sync(pair: list[RouterState]) -> None:
    """The pruning router's policy state made the unpruned one's (its draws too)."""
    full = {k: v for k, v in vars(_policy(pair[1])).items() if k != "prunable"}
    vars(_policy(pair[0])).update(copy.deepcopy(full))


def _compare(policy: str, seed: int, steps: int = 24) -> tuple[int, int, int, int]:
    """Over one world: (decisions whose tie class was kept whole, pruned ones among them,
    decisions drawn elsewhere in a tie class kept in part, misses). Each decision starts
    from the same state on both routers; the unpruned decision is the one both go on with.
    """
    pair, rng, chains = _world(seed, policy)
    tie_ms = getattr(_policy(pair[1]), "tie_ms", 0.0)
    flights: list[tuple[Flight, Flight]] = []
    whole = pruned = drawn = missed = 0
    for i in range(steps):
        _sync(pair)
        chain = rng.choice(chains)
        chain = [*chain[: rng.randrange(1, len(chain) + 1)], rng.getrandbits(63)]
        session = rng.choice([None, None, f"s{rng.randrange(6)}"])
        preps = [_prep(st, i, chain, session) for st in pair]
        exclude = {rng.choice(list(pair[0].registry)).targets[0]} if rng.random() < 0.2 else set()
        d, kept = pair[0].router.decide(preps[0], exclude)
        e, views = pair[1].router.decide(preps[1], exclude)
        kept_ids = {v.worker_id for v in kept}
        assert d.worker_id in kept_ids and d.worker_id not in exclude
        ties = _tie_class(policy, views, e, tie_ms)
        if ties <= kept_ids:
            assert (d.worker_id, d.reason, d.prefetch) == (e.worker_id, e.reason, e.prefetch)
            assert {w: e.scores[w] for w in d.scores} == d.scores
            whole += 1
            pruned += len(kept) < len(views)
        elif d.worker_id in ties:
            drawn += 1
        else:
            missed += 1
        # the unpruned choice takes the request on both; now and then one finishes
        tokens = rng.choice([0, 512, 4096])
        started = []
        for st, p in zip(pair, preps, strict=True):
            found = st.registry.target(e.worker_id)
            assert found is not None
            started.append(found[0].rank_load(found[1]).begin(tokens))
            st.router.predict(p, e.worker_id)
        flights.append((started[0], started[1]))
        if rng.random() < 0.4:
            done = rng.random() < 0.5
            for f in flights.pop(rng.randrange(len(flights))):
                f.finish() if done else f.first_byte()
    return whole, pruned, drawn, missed


@pytest.mark.parametrize("policy", POLICIES)
def test_pruned_decision_is_the_unpruned_one_when_it_holds_the_winner(policy: str) -> None:
    whole = pruned = drawn = missed = 0
    for seed in range(12):
        w, p, d, m = _compare(policy, seed)
        whole, pruned, drawn, missed = whole + w, pruned + p, drawn + d, missed + m
    total = 12 * 24
    assert whole >= total // 3  # worlds with many ties: a third is decided by the claim
    if policy == "sglang_cache_aware":
        assert pruned == 0 and whole == total  # it reads every tenant: never pruned
    else:
        assert pruned >= whole // 3  # many of the compared decisions were pruned
    if policy == "least_load":
        assert missed == 0  # the board orders by its key: only ties past the cap differ
    assert missed <= total // 10


def test_a_large_tie_is_sampled_uniformly() -> None:
    """Idle targets holding nothing, more than ``KEEP + TIE_CAP`` of them: each kept
    set is ``KEEP`` of them for each of the board's two orders (two draws) and over many
    picks every one is drawn."""
    board = _native.LoadBoard()
    n = KEEP + TIE_CAP + 40
    for s in range(n):
        board.set(s, 0, 0)
    seen: dict[int, int] = {}
    for _ in range(400):
        got = board.pick([], [], True, 0.0, KEEP, TIE_CAP)
        assert KEEP <= len(got) <= 2 * KEEP and all(g[1:] == (0, 0, 0, 0) for g in got)
        for g in got:
            seen[g[0]] = seen.get(g[0], 0) + 1
    assert len(seen) == n


def test_the_tie_at_the_kth_key_is_kept_whole_up_to_the_cap() -> None:
    board = _native.LoadBoard()
    for s in range(100):
        board.set(s, 1 if s < 10 else 2, 0)
    board.set(50, 0, 7)
    board.block(3, True)
    got = sorted(g[0] for g in board.pick([], [], True, 0.0, KEEP, TIE_CAP))
    # 50 alone at (0, 7); then the nine unblocked at (1, 0), all tied at the 4th key
    assert got == [*(s for s in range(10) if s != 3), 50]


def test_the_second_order_keeps_the_shortest_queue() -> None:
    """Many targets with one long prompt in flight and one with three short ones: by
    requests it is last, by the tokens a prefill waits behind it is first; kept."""
    board = _native.LoadBoard()
    for s in range(20):
        board.set(s, 1, 5000 + s)
    board.set(60, 3, 10)
    got = sorted(g[0] for g in board.pick([], [], True, 0.0, 2, 0))
    assert got == [0, 1, 60]


def test_views_keep_what_the_policy_must_see() -> None:
    """A session's request in flight on a busy target: ``cache_aware`` counts its
    blocks as held there, so that target is kept though the board ranks it last."""
    st = _state(10, 8, "cache_aware", 1)
    chain = [random.getrandbits(63) for _ in range(20)]
    busy = list(st.registry)[3]
    for _ in range(9):
        busy.rank_loads[2].begin(8000)
    first = _prep(st, 0, chain, "sess")
    policy = _policy(st)
    policy.prunable = lambda request: True
    d, _ = st.router.decide(first)
    d.worker_id = busy.targets[2]
    policy._routed[first.request.request_id] = (busy.targets[2], 1000, 1.0)
    # the first prompt is in flight on the busy target (routed there, not finished)
    policy._remember(first.request.request_id, busy.targets[2], chain, "sess", 0)
    _, kept = st.router.decide(_prep(st, 1, [*chain, 5], "sess"))
    assert busy.targets[2] in {v.worker_id for v in kept}
    assert len(kept) < 80
