"""The online capacity forecast in the router: mock engines -> agents -> NATS -> router.

The forecast is fed off the request path and answered at ``GET /admin/capacity``; its
pooled and per-worker curves must be the LRU caches a replay of the routed requests
gives, and its gauges must be on ``/metrics``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from stack import MODEL, MockStack, Replica, prompt, send, until
from test_reuse import LruReference

from router.config import RouterConfig
from router.tokens.tokenize import num_tokens

AUTH = {"authorization": "Bearer t"}


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[tuple[MockStack, Replica]]:
    # 12-block engines: the pool (what the index says the engines hold) is at most 36
    # blocks, under the 41 the ten prompts below need, wherever the policy puts them. With
    # 32-block engines the warning came or not by placement (3 runs in 17 without it).
    mocks = await MockStack(nats_url).start(3, gpu_blocks=12)
    cfg = mocks.router_config("r0")
    replica = await Replica(cfg).start()
    yield mocks, replica
    await replica.stop()
    await mocks.stop()


async def test_admin_capacity_is_the_lru_of_the_routed_requests(stack) -> None:
    mocks, replica = stack
    state = replica.state
    pool = replica.pool()
    tok = state.tokenizers.get(MODEL)
    sent = []
    async with httpx.AsyncClient(timeout=10) as http:
        for i in range(30):
            text = prompt(i % 10)  # each prompt three times: hits on whoever has it
            worker = await send(http, replica, text)
            sent.append((worker, pool.hasher.hash_tokens(tok.encode(text, True)), text))
        await until(lambda: state.capacity.analysed == 30, what="forecast analysed")
        # the sizes come from the index: an index still empty under load gave no warning
        await until(lambda: mocks.applied(replica), what="the engines' events applied")
        r = await http.get(replica.url + "/admin/capacity", headers=AUTH)
        assert r.status_code == 200, r.text
        body = r.json()
        one = (await http.get(replica.url + f"/admin/capacity?model={MODEL}", headers=AUTH)).json()
        missing = await http.get(replica.url + "/admin/capacity?model=nope", headers=AUTH)
        unauthorized = await http.get(replica.url + "/admin/capacity")
        metrics = (await http.get(replica.url + "/metrics")).text
    assert missing.status_code == 404
    assert unauthorized.status_code == 401
    assert body["dropped_requests"] == 0 and body["queued"] == 0
    report = body["models"][MODEL]
    assert one["requests"] == report["requests"] == 30
    assert report["block_size"] == pool.block_size
    # sizes are what the index says each worker holds
    held = pool.index.stats().workers
    for wid, size in report["capacity"]["workers"].items():
        assert size["gpu_blocks"] == held[wid]["gpu"]
    # the pooled curve is an LRU over every request, the workers' over theirs
    ntok = [num_tokens(tok.encode(text, True)) for _, _, text in sent]
    assert report["pooled"]["curve"][0][0] == 16  # not sampling yet: exact from small sizes
    for cap, rate in report["pooled"]["curve"]:
        ref = LruReference(cap, block_size=pool.block_size)
        for (_, hashes, _), n in zip(sent, ntok, strict=True):
            ref.request(hashes, n)
        assert rate == pytest.approx(ref.hit_rate)
    ref = LruReference(report["capacity"]["pool_blocks"], block_size=pool.block_size)
    for (_, hashes, _), n in zip(sent, ntok, strict=True):
        ref.request(hashes, n)
    assert report["pooled"]["predicted_hit_rate"] == pytest.approx(ref.hit_rate)
    for wid, w in report["workers"].items():
        ref = LruReference(w["gpu_blocks"] + w["host_blocks"], block_size=pool.block_size)
        for (worker, hashes, _), n in zip(sent, ntok, strict=True):
            if worker == wid:
                ref.request(hashes, n)
        assert w["predicted_hit_rate"] == pytest.approx(ref.hit_rate)
    assert report["ceiling_hit_rate"] > 0.5  # each prompt came three times
    for name in (
        "cache_router_forecast_hit_rate{",
        "cache_router_forecast_delivered_hit_rate{",
        "cache_router_forecast_pool_hit_rate{",
        "cache_router_forecast_needed_blocks{",
        "cache_router_forecast_saturation_blocks{",
        "cache_router_forecast_working_set_exceeds_pool{",
    ):
        assert name in metrics, name
    # 12-block engines, ten prompts of 5-8 blocks: the working set outgrows the pool
    assert report["warnings"] and "outgrows the pool" in report["warnings"][0]
    assert state.capacity.check() == [f"model {MODEL}: {report['warnings'][0]}"]


def test_forecast_can_be_turned_off() -> None:
    from router.http.app import RouterApp

    app = RouterApp(RouterConfig(forecast_tracked=0))
    assert app.state.capacity is None


def test_full_queue_drops_and_counts() -> None:
    from index.capacity import Sampling
    from router.config import ConfigError, validate
    from router.observe.capacity import CapacityWatch
    from router.workers.registry import WorkerRegistry

    cfg = RouterConfig()
    watch = CapacityWatch(WorkerRegistry(cfg), Sampling(), queue_max=2)
    for i in range(3):
        watch.record(MODEL, 16, "w0", [i + 1, i + 2], 40)
    assert watch.dropped == 1
    assert watch.drain() == 2 and watch.analysed == 2
    assert watch.reports()["models"][MODEL]["requests"] == 2
    with pytest.raises(ConfigError):
        validate(RouterConfig(forecast_tracked=-1))


def test_queue_is_bounded_in_blocks_too() -> None:
    """Long prompts fill the queue's block budget before its request count."""
    from index.capacity import Sampling
    from router.observe.capacity import CapacityCollector, CapacityWatch
    from router.observe.metrics import RouterMetrics
    from router.workers.registry import WorkerRegistry

    watch = CapacityWatch(WorkerRegistry(RouterConfig()), Sampling(), queue_max_blocks=10)
    for n in (4, 4, 4, 2):  # the third would hold 12 hashes: dropped; the fourth fits
        watch.record(MODEL, 16, "w0", list(range(1, n + 1)), n * 16)
    assert (watch.dropped, watch.queued, watch.queued_blocks) == (1, 3, 10)
    queued = [
        s.value
        for family in CapacityCollector(watch, RouterMetrics()).collect()
        for s in family.samples
        if s.name == "cache_router_forecast_queued_requests"
    ]
    assert queued == [3]
    assert watch.drain() == 3
    assert (watch.queued, watch.queued_blocks) == (0, 0)
    assert watch.reports()["queued_blocks"] == 0
    watch.record(MODEL, 16, "w0", list(range(1, 11)), 160)  # room again
    assert watch.queued == 1 and watch.dropped == 1


async def test_a_bad_entry_does_not_stop_the_analysis() -> None:
    import asyncio

    from index.capacity import Sampling
    from router.observe.capacity import CapacityWatch
    from router.workers.registry import WorkerRegistry

    watch = CapacityWatch(WorkerRegistry(RouterConfig()), Sampling())
    task = asyncio.create_task(watch.run())
    try:
        watch.record(MODEL, 16, "w0", ["not a hash"], 40)  # type: ignore[list-item]
        await until(lambda: watch.errors == 1, what="the error counted")
        watch.record(MODEL, 16, "w0", [1, 2], 40)
        await until(lambda: watch.analysed == 1, what="analysis goes on")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_bad_entry_is_counted_and_the_drain_goes_on() -> None:
    """A request whose analysis raises was lost from every count, so a reader waiting
    for ``analysed + errors`` to reach what it recorded (bench/capacity.py) waited for good."""
    from index.capacity import Sampling
    from router.observe.capacity import CapacityWatch
    from router.workers.registry import WorkerRegistry

    watch = CapacityWatch(WorkerRegistry(RouterConfig()), Sampling())
    watch.record(MODEL, 16, "w0", [1, 2], 40)
    watch.record(MODEL, 16, "w0", ["not a hash"], 40)  # type: ignore[list-item]
    watch.record(MODEL, 16, "w1", [3, 4], 40)
    assert watch.drain() == 3
    assert (watch.analysed, watch.errors, watch.queued) == (2, 1, 0)
    assert watch.reports()["models"][MODEL]["requests"] == 2


async def test_the_analysis_runs_off_the_event_loop_while_reports_are_read() -> None:
    """The analysis thread and readers on the loop: every request analysed, on the
    forecast's own thread, every report readable meanwhile (the lock between them)."""
    import asyncio
    import random
    import threading

    from index.capacity import Sampling
    from router.observe.capacity import CapacityWatch
    from router.workers.registry import WorkerRegistry

    watch = CapacityWatch(WorkerRegistry(RouterConfig()), Sampling(max_tracked=512))
    threads: set[str] = set()
    observe = watch.drain

    def drain(budget_s: float | None = None) -> int:
        threads.add(threading.current_thread().name)
        return observe(budget_s)

    watch.drain = drain  # type: ignore[method-assign]
    rng = random.Random(3)
    task = asyncio.create_task(watch.run())
    try:
        for i in range(120):
            hashes = [rng.getrandbits(64) for _ in range(2048)]
            watch.record(f"model-{i % 3}", 16, f"w{i % 4}", hashes, 2048 * 16)
            if i % 10 == 0:
                reports = watch.reports()["models"]
                assert all(r["model"] in reports for r in reports.values())
                await asyncio.sleep(0)
        await until(lambda: watch.analysed == 120, timeout=60, what="every request analysed")
        models = watch.reports()["models"]
        assert sorted(models) == ["model-0", "model-1", "model-2"]
        assert sum(m["requests"] for m in models.values()) == 120
        assert watch.errors == 0
        assert threads and all(t.startswith("forecast") for t in threads)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
