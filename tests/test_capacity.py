"""index.capacity: pooled and per-worker forecasts against plain LRU caches, tiers, warnings."""

from __future__ import annotations

import random

import orjson
import pytest
from test_reuse import BS, LruReference, conversations

from index.capacity import CapacityForecast, Sampling, Tiers, host_saturation

EXACT = Sampling(max_tracked=1 << 20, hot_blocks=0, horizon=None)


def routed(seed: int, workers: int) -> list[tuple[str, list[int], int]]:
    """Conversations, each session pinned to one worker (as session affinity would)."""
    rng = random.Random(seed)
    pin: dict[int, str] = {}
    out = []
    for hashes, n in conversations(seed, sessions=40, turns=6):
        session = hashes[8]  # the first block after the shared system prompt
        wid = pin.setdefault(session, f"w{rng.randrange(workers)}")
        out.append((wid, hashes, n))
    return out


def test_pooled_and_per_worker_curves_are_the_lru_caches():
    stream = routed(1, workers=3)
    fc = CapacityForecast(BS, EXACT)
    pooled = LruReference(60)
    per_worker = {f"w{i}": LruReference(20) for i in range(3)}
    for wid, hashes, n in stream:
        fc.observe(wid, hashes, n)
        pooled.request(hashes, n)
        per_worker[wid].request(hashes, n)
    report = fc.report({w: Tiers(20) for w in per_worker})
    assert report["pooled"]["capacity_blocks"] == 60
    assert report["pooled"]["predicted_hit_rate"] == pytest.approx(pooled.hit_rate)
    assert report["requests"] == len(stream)
    for wid, ref in per_worker.items():
        w = report["workers"][wid]
        assert w["predicted_hit_rate"] == pytest.approx(ref.hit_rate)
        assert w["predicted_host_hit_rate"] == 0.0
    orjson.dumps(report)  # JSON-ready as it is


def test_host_tier_is_the_next_lru_level():
    stream = routed(2, workers=2)
    fc = CapacityForecast(BS, EXACT)
    gpu, both = LruReference(12), LruReference(12 + 30)
    for wid, hashes, n in stream:
        fc.observe(wid, hashes, n)
        if wid == "w0":
            gpu.request(hashes, n)
            both.request(hashes, n)
    w0 = fc.report({"w0": Tiers(12, 30), "w1": Tiers(12, 30)})["workers"]["w0"]
    assert w0["predicted_gpu_hit_rate"] == pytest.approx(gpu.hit_rate)
    assert w0["predicted_hit_rate"] == pytest.approx(both.hit_rate)
    assert w0["predicted_host_hit_rate"] == pytest.approx(both.hit_rate - gpu.hit_rate)
    hosts = [h for h, _ in w0["host_curve"]]
    assert hosts[0] == 0 and hosts[1:] == sorted(hosts[1:])
    rates = [r for _, r in w0["host_curve"]]
    assert rates == sorted(rates)
    assert rates[0] == pytest.approx(gpu.hit_rate)


def test_saturation_needed_blocks_and_the_warning():
    stream = routed(3, workers=2)
    fc = CapacityForecast(BS, EXACT)
    for wid, hashes, n in stream:
        fc.observe(wid, hashes, n)
    big = fc.report({"w0": Tiers(4096), "w1": Tiers(4096)})
    assert big["warnings"] == []
    ceiling = big["ceiling_hit_rate"]
    assert 0 < ceiling < 1
    needed = big["needed_blocks"]
    assert needed["90"] <= needed["95"] <= needed["99"]
    assert big["working_set_blocks"] == needed["95"]
    curve = dict(big["pooled"]["curve"])
    sat = big["pooled"]["saturation_blocks"]
    assert all(curve[2 * c] - curve[c] < 0.01 for c in curve if c >= sat and 2 * c in curve)
    assert curve[sat] <= ceiling
    small = fc.report({"w0": Tiers(8), "w1": Tiers(8)})
    assert len(small["warnings"]) == 1
    assert "outgrows the pool" in small["warnings"][0]
    assert str(needed["95"]) in small["warnings"][0]


def test_host_saturation():
    assert host_saturation([0, 4, 8, 16], [0.3, 0.301, 0.302, 0.302]) == 0
    assert host_saturation([0, 4, 8, 16], [0.3, 0.35, 0.4, 0.405]) == 8
    assert host_saturation([0, 4, 8, 16], [0.3, 0.305, 0.4, 0.4]) == 8


def test_unrouted_requests_count_only_in_the_pool():
    fc = CapacityForecast(BS, EXACT)
    for hashes, n in conversations(4, sessions=5, turns=3):
        fc.observe(None, hashes, n)
    report = fc.report({})
    assert report["workers"] == {}
    assert report["requests"] == 15
    assert report["pooled"]["predicted_hit_rate"] is None  # no known capacity
    with pytest.raises(ValueError):
        CapacityForecast(0)
