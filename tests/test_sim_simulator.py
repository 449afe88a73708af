"""Simulator invariants on small synthetic traces, through the real index and policies."""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from index.codec import Event
from policies import POLICY_NAMES, PrefetchHint, RouteRequest
from sim.batch_engine import BatchEngine
from sim.request import SimRequest
from sim.simulator import SimConfig, Simulation
from sim.synth import write_sessions
from sim.traces import Trace, load_trace

BS = 16


class Checked(Simulation):
    """Counts every finish and checks cache bounds after every engine step."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.finishes: Counter[str] = Counter()
        self.checks = 0

    def finished(self, req, now):  # type: ignore[no-untyped-def]
        self.finishes[req.rid] += 1
        super().finished(req, now)

    def rejected(self, req, now):  # type: ignore[no-untyped-def]
        self.finishes[req.rid] += 1
        super().rejected(req, now)

    def publish(self, engine: BatchEngine, events: list[Event], now: float) -> None:
        cache = engine.cache
        assert cache.gpu_used <= cache.gpu_blocks
        assert cache.host_used <= cache.host_blocks
        self.checks += 1
        super().publish(engine, events, now)


@pytest.fixture(scope="module")
def busy_trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    """Many conversations, arriving fast enough to queue and to evict."""
    path = tmp_path_factory.mktemp("traces") / "busy.jsonl"
    write_sessions(path, sessions=24, turns=5, gap_ms=3.0, turn_tokens=40)
    return load_trace(path, block_size=BS)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_request_finishes_once_within_cache_bounds(busy_trace: Trace, policy: str) -> None:
    config = SimConfig(workers=3, l1_blocks=48, l2_blocks=24, max_num_seqs=8)
    sim = Checked(busy_trace, policy, config)
    report = sim.run()
    n = len(busy_trace.requests)
    assert sim.finishes == Counter({f"r{i}": 1 for i in range(n)})
    assert sim.checks >= n // 2  # bounds were checked all along, not just at the end
    for r in sim.requests:
        assert r.arrival_ms <= r.admit_ms <= r.first_token_ms <= r.finish_ms
    assert report["rejected"] == 0
    assert report["ingest_errors"] == 0
    assert report["hit_rate"] <= busy_trace.ideal_hit_rate() + 1e-12
    assert all(e.cache.num_requests == 0 and e.cache.usage == 0 for e in sim.engines)
    assert all(len(p) == 0 for p in sim.prefills.values())  # every timed prefill released


def test_hits_use_both_tiers_and_the_index_mirrors_the_engines(busy_trace: Trace) -> None:
    config = SimConfig(workers=3, l1_blocks=48, l2_blocks=64)
    sim = Simulation(busy_trace, "cache_aware", config)
    report = sim.run()
    assert report["hit_rate_gpu"] > 0 and report["hit_rate_host"] > 0
    assert report["hit_rate"] <= busy_trace.ideal_hit_rate() + 1e-12
    # Every event was delivered: the router's index agrees with each engine's cache.
    for i, req in enumerate(busy_trace.requests):
        matches = sim.index.match_tiers(req.router_hashes.tolist(), speculative=False)
        for wid, engine in zip(sim.ids, sim.engines, strict=True):
            gpu, host = engine.cache.lookup(req.engine_hashes)
            m = matches.get(wid)
            got = (m.gpu, m.cpu - m.gpu) if m else (0, 0)
            assert got == (gpu, host), (i, wid)


def test_round_robin_spreads_evenly(busy_trace: Trace) -> None:
    sim = Simulation(busy_trace, "round_robin", SimConfig(workers=4))
    report = sim.run()
    assert max(sim.routed) - min(sim.routed) <= 1
    assert report["requests_max_over_mean"] == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("policy", ["session_affinity", "cache_aware"])
def test_a_session_stays_on_one_worker_at_low_load(tmp_path: Path, policy: str) -> None:
    path = write_sessions(tmp_path / "calm.jsonl", sessions=6, turns=4, gap_ms=400.0)
    trace = load_trace(path, block_size=BS)
    sim = Simulation(trace, policy, SimConfig(workers=4))
    report = sim.run()
    workers_of: dict[str, set[int]] = defaultdict(set)
    for r in sim.requests:
        workers_of[r.route.session_key or ""].add(r.worker)
    assert all(len(ws) == 1 for ws in workers_of.values()), workers_of
    assert report["hit_rate"] > 0.5 * trace.ideal_hit_rate()


def test_cache_aware_does_not_pile_onto_the_shared_prefix(tmp_path: Path) -> None:
    """Every request shares block 0 (a system prompt) and nothing else, under load."""
    path = write_sessions(
        tmp_path / "shared.jsonl",
        sessions=160,
        turns=1,
        gap_ms=4.0,
        system_tokens=4 * BS,
        turn_tokens=400,
    )
    trace = load_trace(path, block_size=BS)
    sim = Simulation(trace, "cache_aware", SimConfig(workers=4))
    report = sim.run()
    assert report["requests_max_over_mean"] < 1.5, sim.routed
    assert report["prefill_load_max_over_mean"] < 1.5
    # It still reuses the shared prefix wherever it lands.
    assert report["hit_rate"] > 0.5 * trace.ideal_hit_rate()


def test_same_seed_same_result(busy_trace: Trace) -> None:
    config = SimConfig(workers=3, l1_blocks=64, seed=5)
    a = Simulation(busy_trace, "power_of_two", config).run()
    b = Simulation(busy_trace, "power_of_two", config).run()
    keys = ("hit_rate", "ttft_mean_ms", "ttft_p99_ms", "prefill_load_max_over_mean")
    assert [a[k] for k in keys] == [b[k] for k in keys]


def test_cache_loss_is_zero_without_hits_and_positive_with_them(tmp_path: Path) -> None:
    cold = load_trace(
        write_sessions(tmp_path / "cold.jsonl", sessions=10, turns=1, gap_ms=5.0, system_tokens=0),
        block_size=BS,
    )
    report = Simulation(cold, "round_robin", SimConfig(workers=2)).run()
    assert report["hit_rate"] == 0.0
    assert report["cache_loss"] == pytest.approx(0.0, abs=1e-12)
    warm = load_trace(
        write_sessions(tmp_path / "warm.jsonl", sessions=4, turns=4, gap_ms=50.0),
        block_size=BS,
    )
    report = Simulation(warm, "cache_aware", SimConfig(workers=2, l1_blocks=24, l2_blocks=64)).run()
    assert report["hit_rate"] > 0 and report["hit_rate_host"] > 0
    # Missed tokens sit after the cached context (dearer attention), host hits are loaded.
    assert 0.0 < report["cache_loss"] < 0.5


def test_a_prefetch_sends_only_the_blocks_the_target_lacks(tmp_path: Path) -> None:
    """The policy budgets the missing blocks; the simulated transfer moves just those."""
    path = write_sessions(tmp_path / "one.jsonl", sessions=1, turns=1, gap_ms=1.0, turn_tokens=0)
    trace = load_trace(path, block_size=BS)  # 64 tokens: 4 full blocks
    sim = Simulation(trace, "round_robin", SimConfig(workers=2, l2_blocks=16))
    tr = trace.requests[0]
    tokens = trace.tokens(0)
    source, target = sim.engines[0].cache, sim.engines[1].cache
    source.allocate("warm", tokens, block_hashes=tr.engine_hashes)
    source.commit("warm", len(tokens))
    source.release("warm")
    target.prefetch(tokens, block_hashes=tr.engine_hashes, max_blocks=1)
    for engine in sim.engines:
        sim.publish(engine, engine.cache.drain_events(), 0.0)
    while sim._heap:  # deliver the events: the index now knows both engines
        _, _, fn, args = heapq.heappop(sim._heap)
        fn(*args)
    route = RouteRequest("r0", "sim", tr.input_len, tr.router_hashes.tolist(), BS)
    req = SimRequest(0, 0.0, tr.input_len, tr.output_len, tokens, tr.engine_hashes, route)
    sim._prefetch(req, PrefetchHint("w0", "w1", 3, "cpu", deadline_ms=100.0))
    # 3 blocks hinted, the target already holds the first: 2 cross the link
    assert sim.counters["prefetch_blocks_sent"] == 2
    assert sim.link_free[1] == pytest.approx(sim.costs.prefetch_ms(2 * BS))
    sim._prefetch(req, PrefetchHint("w0", "w1", 1, "cpu", deadline_ms=100.0))
    assert sim.counters["prefetch_already_held"] == 1  # nothing to send
