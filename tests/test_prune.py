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
from policies.base import NO_MATCH, Decision, RouteRequest, WorkerView
from policies.selection import load_key
from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterState
from router.routing.decide import Parsed, Prepared, hit_blocks
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
        if d.worker_id == e.worker_id:
            # the chosen target's match as every candidate's views show it (least_load's
            # looked up alone, the others' from the walk): the hit the router counts
            mine = next(v for v in kept if v.worker_id == d.worker_id)
            full = next(v for v in views if v.worker_id == e.worker_id)
            assert (mine.match, mine.in_sync) == (full.match, full.in_sync)
            assert hit_blocks(kept, d) == hit_blocks(views, e)
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


def _reference(
    keys: dict[int, tuple[int, int]], k: int, cap: int
) -> list[tuple[set[int], set[int], int]]:
    """Per order (requests then tokens; tokens then requests) over ``keys``' slots: the
    slots below the k-th key, the tie class at it, and how many of the tie fill the k."""
    out = []
    for order in ((0, 1), (1, 0)):

        def key(s: int, order: tuple[int, int] = order) -> tuple[int, int]:
            return keys[s][order[0]], keys[s][order[1]]

        ranked = sorted(keys, key=key)
        if len(ranked) <= k:
            out.append((set(ranked), set(), 0))
            continue
        kth = key(ranked[k - 1])
        below = {s for s in ranked if key(s) < kth}
        ties = {s for s in ranked if key(s) == kth}
        out.append((below, ties, k - len(below)))
    return out


def _check(got: set[int], ref: list[tuple[set[int], set[int], int]], cap: int) -> bool:
    """``got`` holds each order's k least as ``_reference`` gives them: every slot below
    the k-th key, the tie whole up to the cap, else ``room`` of it. Whether nothing was
    drawn (then it is exactly those)."""
    drawn = False
    for below, ties, room in ref:
        assert below <= got
        if len(ties) <= room + cap:
            assert ties <= got
        else:
            assert len(ties & got) >= room
            drawn = True
    return drawn


def _board(rng: random.Random, n: int) -> tuple[_native.LoadBoard, dict[int, tuple[int, int]]]:
    """A board grown slot by slot in any order (its trees past several sizes), some
    slots blocked or dropped, some moved since: and the keys of those left."""
    board = _native.LoadBoard()
    keys: dict[int, tuple[int, int]] = {}
    for s in rng.sample(range(n), n):
        keys[s] = (rng.randrange(rng.choice([1, 3, 8])), rng.choice([0, 512, 4096]))
        board.set(s, *keys[s])
    for s in rng.sample(range(n), n // 10):
        if rng.random() < 0.5:
            board.block(s, True)
        else:
            board.drop(s)
        del keys[s]
    for s in rng.sample(sorted(keys), len(keys) // 5):
        keys[s] = (rng.randrange(3), rng.choice([0, 512]))
        board.set(s, *keys[s])
    return board, keys


@pytest.mark.skipif(not hasattr(_native.LoadBoard, "least"), reason="a build before the min trees")
def test_the_least_loaded_from_the_min_trees() -> None:
    """``LoadBoard.least`` (min trees, O(log n)) keeps, in each of the two orders, the
    k least and the tie at the k-th key, whole up to the cap, else ``room`` of it drawn,
    and the ``also`` slots; each once. Against a sort of every slot's key."""
    rng = random.Random(5)
    sampled = whole = 0
    for _ in range(300):
        n = rng.choice([5, 70, 300, 1100])
        board, keys = _board(rng, n)
        k, cap = rng.randint(1, 6), rng.choice([0, 2, 32])
        also = rng.sample(range(n), 2)
        for _ in range(3):  # again: each pick leaves the trees as it found them
            got = board.least(k, cap, also)
            assert len(got) == len(set(got))
            ref = _reference(keys, k, cap)
            kept = {a for a in also if a in keys}
            allowed = set(kept)
            for below, ties, _ in ref:
                allowed |= below | ties
            assert set(got) <= allowed
            if _check(set(got), ref, cap):
                sampled += 1
            else:
                assert set(got) == kept.union(*(b | t for b, t, _ in ref))
                whole += 1
    assert whole > 100 and sampled > 100


def test_pick_keeps_each_class_and_the_non_holders_least_loaded() -> None:
    """``LoadBoard.pick`` over a real index (several groups): per class of equal hits
    and among the targets holding nothing (taken from the min trees past the holders, or
    by a pass where holders are many), the k least in each order and the tie at the
    k-th key, whole up to the cap, else drawn. Against ``match_tiers`` and a sort."""
    from index.native_index import NativePrefixIndex

    rng = random.Random(9)
    sampled = whole = 0
    for _ in range(60):
        n = rng.choice([40, 150, 700])
        index = NativePrefixIndex()
        names = [f"w{s}" for s in range(n)]
        for name in names:
            index.add_worker(name)
        board, keys = _board(rng, n)
        # short chains walked block by block; long ones galloped and bisected
        chain = [rng.getrandbits(63) for _ in range(rng.choice([6, 40]))]
        share = rng.choice([0.02, 0.3, 0.8])  # few holders, many, most
        for s in range(n):
            if rng.random() < share:
                index.store(names[s], chain[: rng.randrange(1, len(chain) + 1)])
                if rng.random() < 0.1:
                    index.store(names[s], chain[:3], rng.choice(["cpu", "disk"]))
        k, cap = rng.randint(1, 5), rng.choice([0, 3, 32])
        got = {p[0]: p[1:] for p in index.pick(board, chain, k, cap)}
        matches = index.match_tiers(chain)
        classes: dict[tuple[int, int, int, int], dict[int, tuple[int, int]]] = {}
        for s, key in keys.items():
            m = matches.get(names[s])
            cls = (0, 0, 0, 0) if m is None else (m.gpu, m.cpu, m.disk, m.total)
            classes.setdefault(cls, {})[s] = key
        drawn = False
        allowed: set[int] = set()
        for cls, members in classes.items():
            ref = _reference(members, k, cap)
            mine = {s for s in got if s in members}
            assert all(got[s] == cls for s in mine)  # each slot with its own hit
            drawn |= _check(mine, ref, cap)
            for below, ties, _ in ref:
                allowed |= below | ties
        assert set(got) <= allowed
        if drawn:
            sampled += 1
        else:
            assert set(got) == allowed
            whole += 1
    assert whole > 10 and sampled > 10


def _wide_least_load(seed: int) -> tuple[RouterState, list[list[int]]]:
    st = _state(12, 8, "least_load", seed)
    rng = random.Random(seed)
    index = next(iter(st.registry)).pool.index
    targets = [t for w in st.registry for t in w.targets]
    fam = [rng.getrandbits(63) for _ in range(6)]
    chains = []
    for t in targets:
        chain = fam + [rng.getrandbits(63) for _ in range(rng.randrange(1, 20))]
        index.store(t, chain[: rng.randrange(1, len(chain) + 1)])
        if rng.random() < 0.2:
            index.store(t, chain, rng.choice(["cpu", "disk"]))
        chains.append(chain)
    for w in st.registry:
        for load in w.rank_loads:
            for _ in range(rng.randrange(3)):
                load.begin(rng.choice([0, 512]))
    return st, chains


def test_least_load_walks_no_index_group_and_counts_its_choice_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``least_load`` weighs no hit: in a wide pool its views come from the board alone
    (no walk of the index's groups, no sync state asked group by group), and the chosen
    target's match, looked up alone, is the one every candidate's views show: what
    ``hit_blocks`` counts for the request; out of sync, none."""
    st, chains = _wide_least_load(3)
    pool = next(iter(st.registry)).pool
    index, ingest = pool.index, pool.ingest
    behind = next(iter(st.registry)).targets[1]
    ingest.mark_out_of_sync(behind)
    rng = random.Random(3)
    preps = []
    for i in range(40):
        chain = [*rng.choice(chains), rng.getrandbits(63)]
        preps.append(_prep(st, i, chain, None))
    full = [index.match_tiers(p.request.block_hashes[:-1]) for p in preps]

    def walked(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a group walked for a policy that weighs no hit")

    monkeypatch.setattr(index, "match_tiers", walked)
    monkeypatch.setattr(index, "pick", walked)
    monkeypatch.setattr(ingest, "out_of_sync", walked)
    for p, matches in zip(preps, full, strict=True):
        d, views = st.router.decide(p)
        assert len(views) <= 2 * (KEEP + TIE_CAP)
        chosen = next(v for v in views if v.worker_id == d.worker_id)
        want = matches.get(d.worker_id, NO_MATCH) if d.worker_id != behind else NO_MATCH
        assert chosen.match == want and chosen.in_sync == (d.worker_id != behind)
        assert hit_blocks(views, d) == want.total
        assert all(v.match == NO_MATCH for v in views if v is not chosen)
    # the target out of sync, chosen: no hit counted there
    for w in st.registry:
        for tid, load in w.candidates:
            for _ in range(5 if tid != behind else 0):  # the others busier than it
                load.begin(0)
    d, views = st.router.decide(preps[0])
    assert d.worker_id == behind and hit_blocks(views, d) == 0


def test_admission_saves_the_best_and_the_holder_from_the_kept_holders() -> None:
    """A full pool's ticket weighs what each holder's cache saves (``Gate._saved``); in
    a wide pool from the kept candidates alone (each hit class's least loaded): the best
    saving is every candidate's, the savings kept are theirs, and the holder (the first
    best) is the same whenever the kept set holds it."""
    from router.admission.gate import Gate

    same_holder = 0
    for seed in range(8):
        pair, rng, chains = _world(seed, "cache_aware")
        st = pair[0]
        gate = Gate(_settings(), st.router, st.registry)
        for i in range(12):
            chain = rng.choice(chains)
            chain = [*chain[: rng.randrange(1, len(chain) + 1)], rng.getrandbits(63)]
            prep = _prep(st, i, chain, None)
            kept = gate._saved(prep)
            every = _saved_every(gate, prep)
            assert all(every[w] == v for w, v in kept.items())
            assert max(kept.values(), default=0.0) == max(every.values(), default=0.0)
            if every:
                holder = max(every, key=every.__getitem__)
                if holder in kept:
                    assert max(kept, key=kept.__getitem__) == holder
                    same_holder += 1
            assert len(kept) <= len(every)
    assert same_holder > 20


def _settings() -> Any:
    from router.admission.core import AdmissionSettings

    return AdmissionSettings(max_inflight=1)


def _saved_every(gate: Any, prep: Prepared) -> dict[str, float]:
    """``Gate._saved`` over every candidate's view (what it read before the pruning)."""
    req = prep.request
    n = req.num_tokens
    full = gate.costs.prefill_ms(n)
    saved = {}
    for view in gate.router.views(prep):
        hit = min(view.match.total * req.block_size, n - 1)
        if hit > 0:
            saved[view.worker_id] = (full - gate.costs.prefill_ms(n - hit, hit)) / 1000.0
    return saved


@pytest.mark.skipif(not hasattr(_native.LoadBoard, "place"), reason="a build before ``place``")
def test_the_board_hands_out_its_slots_in_candidate_order() -> None:
    """``LoadBoard.place`` gives each slot its place in the candidate order: ``pick``
    and ``least`` hand out the same slots as a board never placed (same keys, same
    draws), ordered by place, so the pruner sorts nothing."""
    from index.native_index import NativePrefixIndex

    rng = random.Random(11)
    for _ in range(60):
        n = rng.choice([40, 150, 700])
        seed = rng.getrandbits(32)
        board, _ = _board(random.Random(seed), n)
        placed, _ = _board(random.Random(seed), n)
        order = rng.sample(range(n), n)  # slot -> its place
        for slot, rank in enumerate(order):
            placed.place(slot, rank)
        index = NativePrefixIndex()
        names = [f"w{s}" for s in range(n)]
        for name in names:
            index.add_worker(name)
        chain = [rng.getrandbits(63) for _ in range(rng.choice([6, 40]))]
        for s in rng.sample(range(n), n // 3):
            index.store(names[s], chain[: rng.randrange(1, len(chain) + 1)])
        k, cap = rng.randint(1, 5), rng.choice([0, 3, 32])
        also = rng.sample(range(n), 2)
        for b in (board, placed):
            b.seed(7)
        plain = index.pick(board, chain, k, cap, also)
        got = index.pick(placed, chain, k, cap, also)
        assert sorted(got) == sorted(plain)
        assert [order[p[0]] for p in got] == sorted(order[p[0]] for p in got)
        plain_least, got_least = board.least(k, cap, also), placed.least(k, cap, also)
        assert sorted(got_least) == sorted(plain_least)
        assert [order[s] for s in got_least] == sorted(order[s] for s in got_least)


def test_every_groups_out_of_sync_slots_in_one_call() -> None:
    """``out_of_sync_groups`` (one native call for a wide pool's groups) gives each
    core's ``out_of_sync`` mask, and the index names exactly the workers ``in_sync``
    is false for."""
    from index.backend import make_ingest
    from index.hashing import BlockHasher
    from index.native_index import NativePrefixIndex

    rng = random.Random(4)
    for _ in range(40):
        index = NativePrefixIndex()
        ingest = make_ingest(index, BlockHasher(BLOCK))
        names = [f"w{i}" for i in range(rng.choice([3, 70, 300]))]
        for name in names:
            index.add_worker(name)
        marked = rng.choice([0, 1, min(5, len(names)), len(names) // 2])
        for name in rng.sample(names, marked):
            ingest.mark_out_of_sync(name)
        for name in rng.sample(names, min(3, len(names))):
            if rng.random() < 0.3:
                ingest.remove_worker(name)
        each = [(g, m) for g, core in enumerate(index.cores) if (m := core.out_of_sync())]
        assert _native.out_of_sync_groups(index.cores) == each
        behind = {n for n in names if index.slot_of(n) is not None and not ingest.in_sync(n)}
        assert set(ingest.out_of_sync()) == behind == set(index.out_of_sync())


def test_pick_walks_give_each_holder_its_match() -> None:
    """``LoadBoard.pick``'s walk of every group (each group probing first where the
    groups before it found their holders' ends) gives every target the hit its group's
    own ``match_tiers`` gives: over prefixes shared in part across groups, holders with
    holes, predictions and lower tiers. The board keeps every target (one load, a cap
    past the pool), so every hit is compared."""
    from index.native_index import NativePrefixIndex

    rng = random.Random(21)
    for _ in range(40):
        n = rng.choice([70, 200, 520])
        index = NativePrefixIndex(bisect_min_blocks=rng.choice([4, 24]))
        names = [f"w{s}" for s in range(n)]
        for name in names:
            index.add_worker(name)
        base = [rng.getrandbits(63) for _ in range(rng.choice([30, 90]))]
        chains = [base[: rng.randrange(5, len(base))] + [rng.getrandbits(63) for _ in range(20)]
                  for _ in range(4)]  # fmt: skip
        for s in range(n):
            if rng.random() < 0.5:
                chain = rng.choice(chains)
                index.store(names[s], chain[: rng.randrange(1, len(chain) + 1)])
                r = rng.random()
                if r < 0.1:  # a hole: a block in the middle gone
                    index.remove(names[s], [chain[rng.randrange(1, 5)]])
                elif r < 0.2:
                    index.store(names[s], chain[:4], rng.choice(["cpu", "disk"]))
            if rng.random() < 0.05:
                index.predict(names[s], rng.choice(chains)[:10], 60.0)
        board = _native.LoadBoard()
        for s in range(n):
            board.set(s, 0, 0)
        request = [*rng.choice(chains), rng.getrandbits(63)]
        got = {p[0]: p[1:] for p in index.pick(board, request, 64, 10 * n)}
        assert set(got) == set(range(n))
        matches = index.match_tiers(request)
        for s, hit in got.items():
            m = matches.get(names[s])
            assert hit == ((0, 0, 0, 0) if m is None else (m.gpu, m.cpu, m.disk, m.total))
