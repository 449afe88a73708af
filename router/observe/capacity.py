"""The online capacity forecast: how much cache each tier needs, from the routed traffic.

The request path only appends ``(model, block size, worker, hashes, tokens, prefetched)`` to a
bounded queue (``record``: a tuple and a deque append; the hashes are the list routing
already computed). A background task drains it into one ``index.capacity`` forecast
per model on a thread of its own, and the stacks are native (``index.native_reuse``):
each request is one call per stack that reads the hashes and then, from 256 blocks up,
runs with the GIL released, so the event loop keeps running through a long prompt's
analysis instead of waiting for the switch interval. A shorter one keeps the GIL: at
saturation (short chats) handing it over and back twice a request cost the forecast's
thread 30-43 us a request, 8.6-9.7 us without (session 12, BENCHMARKS.md).

Why: in Python the analysis of a turn of a conversation grown to 33K tokens (2K blocks,
every block tracked while the 2,048-block sample fills) cost 34-42 ms of CPU for the
pooled and the worker's stack, and the router's CPU per request over the last 4 turns
read 32.3 ms with the forecast on against 3.94 off (bench/hotpath.py, session 5); at
saturation the forecast's thread was 16-21 % of the router's CPU. Native, the same
turn costs ~1 ms (numbers in BENCHMARKS.md, issue 12). It was bursty because the queue
is drained every ``POLL_S``: a drain lands inside some requests' CPU windows and not
others, with all the requests queued since the last one.

Bounds: the queue holds at most ``queue_max`` requests and ``QUEUE_MAX_BLOCKS`` block
hashes (the lists it keeps alive: 2M hashes are ~75 MB of Python ints); past either, a
request is dropped and counted (``cache_router_forecast_dropped_requests``), and the
forecast runs on a sample. A lock keeps readers (reports, scrapes) from seeing a
half-analysed request; a reader waits at most one request's analysis.

Current sizes come from the index: the blocks each worker holds per tier (``gpu`` and
``cpu``) are its capacity once its cache has filled, a lower bound before. Predicted hit
rates are read off each worker's curve at that size; delivered ones are what the engines
reported (``cached_tokens``) for the same workers, so the two gauges sit side by side.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from index.capacity import SHARES, CapacityForecast, Sampling, Tiers
from index.prefix_index import Tier
from router.observe.metrics import RouterMetrics
from router.workers.registry import WorkerRegistry

log = logging.getLogger(__name__)

QUEUE_MAX = 8192  # requests waiting for analysis (about 20 s at 400 requests/s)
QUEUE_MAX_BLOCKS = 1 << 21  # block hashes the queued requests hold (256 of 128K tokens)
POLL_S = 0.1
CHECK_S = 30.0  # how often the working set is compared with the pool


class CapacityWatch:
    """Per-model forecasts fed off the request path; reports and warnings."""

    def __init__(
        self,
        registry: WorkerRegistry,
        sampling: Sampling,
        queue_max: int = QUEUE_MAX,
        queue_max_blocks: int = QUEUE_MAX_BLOCKS,
    ) -> None:
        self.registry = registry
        self.sampling = sampling
        self.forecasts: dict[str, CapacityForecast] = {}
        self._queue: deque[tuple[str, int, str, Sequence[int], int, int]] = deque()
        self.queue_max = queue_max
        self.queue_max_blocks = queue_max_blocks
        # hashes queued and analysed: one writer each (the loop, the thread), so no lock
        self._blocks_in = self._blocks_out = 0
        self.dropped = 0
        self.analysed = 0
        self.errors = 0
        self._short: set[str] = set()  # models whose working set outgrows the pool
        self._lock = threading.Lock()  # the forecasts: analysed on the thread, read on the loop
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forecast")

    # -- request path ---------------------------------------------------------------
    def record(
        self,
        model: str,
        block_size: int,
        worker: str,
        hashes: Sequence[int],
        tokens: int,
        prefetched: int = 0,
    ) -> None:
        """One routed request; ``prefetched`` leading blocks were hinted to its worker."""
        if (
            len(self._queue) >= self.queue_max
            or self.queued_blocks + len(hashes) > self.queue_max_blocks
        ):
            self.dropped += 1
            return
        self._blocks_in += len(hashes)
        self._queue.append((model, block_size, worker, hashes, tokens, prefetched))

    @property
    def queued(self) -> int:
        """Requests waiting for analysis."""
        return len(self._queue)

    @property
    def queued_blocks(self) -> int:
        """Block hashes the waiting requests hold."""
        return self._blocks_in - self._blocks_out

    # -- background -----------------------------------------------------------------
    def drain(self, budget_s: float | None = None) -> int:
        """Analyse queued requests, for at most ``budget_s`` seconds; how many were done."""
        queue, forecasts = self._queue, self.forecasts
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        done = 0
        while queue:
            model, block_size, worker, hashes, tokens, prefetched = queue.popleft()
            self._blocks_out += len(hashes)
            try:
                with self._lock:
                    fc = forecasts.get(model)
                    if fc is None or fc.block_size != block_size:  # new, or its pool changed
                        fc = forecasts[model] = CapacityForecast(block_size, self.sampling)
                    fc.observe(worker, hashes, tokens, prefetched)
                self.analysed += 1
            except Exception:  # one bad request must not stop the others' analysis
                self._failed()
            done += 1
            if deadline is not None and time.perf_counter() >= deadline:
                break
        return done

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        checked = time.monotonic()
        while True:
            await asyncio.sleep(POLL_S)
            try:
                if self._queue:  # an idle router skips the thread's round trip: 2.5 ms/s
                    await loop.run_in_executor(self._thread, self.drain)
                if time.monotonic() - checked >= CHECK_S:
                    checked = time.monotonic()
                    self.check()
            except Exception:  # a bug here must not end the forecast for good
                self._failed()

    def _failed(self) -> None:
        with self._lock:  # the thread (one request) and the loop (a check) both count here
            self.errors += 1
        if self.errors == 1 or self.errors % 1000 == 0:  # seen, not a flood
            log.exception("capacity forecast: analysis failed %d times", self.errors)

    # -- reading --------------------------------------------------------------------
    def capacities(self, model: str) -> dict[str, Tiers]:
        """Each worker serving ``model``: the blocks it holds in GPU and host memory."""
        out: dict[str, Tiers] = {}
        held_by_pool: dict[str, dict[str, dict[Tier, int]]] = {}
        for w in self.registry.for_model(model):
            held = held_by_pool.get(w.pool.name)
            if held is None:
                held = held_by_pool[w.pool.name] = w.pool.index.stats().workers
            tiers = held.get(w.id, {})
            out[w.id] = Tiers(tiers.get("gpu", 0), tiers.get("cpu", 0))
        return out

    def models(self) -> list[str]:
        with self._lock:
            return sorted(self.forecasts)

    def report(self, model: str) -> dict[str, Any]:
        caps = self.capacities(model)
        with self._lock:
            fc = self.forecasts.get(model)
            if fc is None:
                return {"model": model, "requests": 0, "capacity": _sizes(caps)}
            return {"model": model, "capacity": _sizes(caps), **fc.report(caps)}

    def reports(self) -> dict[str, Any]:
        return {
            "models": {m: self.report(m) for m in self.models()},
            "queued": self.queued,
            "queued_blocks": self.queued_blocks,
            "analysed_requests": self.analysed,
            "dropped_requests": self.dropped,
            "errors": self.errors,
            "sampling": {
                "max_tracked": self.sampling.max_tracked,
                "hot_blocks": self.sampling.hot_blocks,
                "horizon": self.sampling.horizon,
            },
        }

    def check(self) -> list[str]:
        """Log once when a model's working set outgrows its pool, and when it fits again."""
        warnings = []
        for model in self.models():
            found = self.report(model).get("warnings", [])
            warnings += [f"model {model}: {w}" for w in found]
            if found and model not in self._short:
                self._short.add(model)
                log.warning("capacity forecast, model %s: %s", model, found[0])
            elif not found and model in self._short:
                self._short.discard(model)
                log.info("capacity forecast, model %s: the working set fits the pool", model)
        return warnings


def _sizes(caps: dict[str, Tiers]) -> dict[str, Any]:
    return {
        "source": "index: blocks each worker holds per tier",
        "pool_blocks": sum(t.total for t in caps.values()),
        "workers": {w: {"gpu_blocks": t.gpu, "host_blocks": t.host} for w, t in caps.items()},
    }


class CapacityCollector(Collector):
    """The forecast's gauges, computed at scrape time."""

    def __init__(self, watch: CapacityWatch, metrics: RouterMetrics) -> None:
        self.watch = watch
        self.metrics = metrics

    def _delivered(self) -> dict[str, float]:
        """Per worker: engine-reported cached tokens over prompt tokens (every arm)."""
        sums: dict[str, list[float]] = {}
        for counter, k in ((self.metrics.hit_tokens, 0), (self.metrics.prompt_tokens, 1)):
            for family in counter.collect():
                for s in family.samples:
                    if s.name.endswith("_total"):
                        sums.setdefault(s.labels["worker"], [0.0, 0.0])[k] += s.value
        return {w: hit / prompt for w, (hit, prompt) in sums.items() if prompt}

    def collect(self) -> Iterator[Metric]:
        mw = ["model", "worker"]
        predicted = GaugeMetricFamily(
            "cache_router_forecast_hit_rate",
            "Hit rate the capacity forecast predicts at the worker's current cache size",
            labels=mw,
        )
        delivered = GaugeMetricFamily(
            "cache_router_forecast_delivered_hit_rate",
            "Hit rate the worker's engine reported (cached tokens / prompt tokens)",
            labels=mw,
        )
        pooled = GaugeMetricFamily(
            "cache_router_forecast_pool_hit_rate",
            "Predicted hit rate of one LRU cache of the pool's whole size (the routing ceiling)",
            labels=["model"],
        )
        ceiling = GaugeMetricFamily(
            "cache_router_forecast_ceiling_hit_rate",
            "Hit rate of an unbounded cache on this traffic",
            labels=["model"],
        )
        needed = GaugeMetricFamily(
            "cache_router_forecast_needed_blocks",
            "Pool cache (blocks) needed for a share of the ceiling hit rate",
            labels=["model", "share"],
        )
        saturation = GaugeMetricFamily(
            "cache_router_forecast_saturation_blocks",
            "Cache size from which one more doubling adds less than a point",
            labels=["model", "worker"],
        )
        short = GaugeMetricFamily(
            "cache_router_forecast_working_set_exceeds_pool",
            "1 when 95 % of the ceiling needs more blocks than the pool holds",
            labels=["model"],
        )
        dropped = CounterMetricFamily(
            "cache_router_forecast_dropped_requests",
            "Requests the forecast skipped because its queue was full",
        )
        dropped.add_metric([], self.watch.dropped)
        queued = GaugeMetricFamily(
            "cache_router_forecast_queued_requests",
            "Requests waiting for the forecast's analysis (its lag)",
        )
        queued.add_metric([], self.watch.queued)
        done = self._delivered()
        for model in self.watch.models():
            r = self.watch.report(model)
            pool = r["pooled"]
            if pool["predicted_hit_rate"] is not None:
                pooled.add_metric([model], pool["predicted_hit_rate"])
            ceiling.add_metric([model], r["ceiling_hit_rate"])
            saturation.add_metric([model, ""], pool["saturation_blocks"])
            for share in SHARES:
                key = f"{round(share * 100)}"
                if r["needed_blocks"][key] is not None:
                    needed.add_metric([model, key], r["needed_blocks"][key])
            short.add_metric([model], float(bool(r["warnings"])))
            for wid, w in r["workers"].items():
                saturation.add_metric([model, wid], w["saturation_blocks"])
                if "predicted_hit_rate" in w:
                    predicted.add_metric([model, wid], w["predicted_hit_rate"])
                if wid in done:
                    delivered.add_metric([model, wid], done[wid])
        yield from (
            predicted, delivered, pooled, ceiling, needed, saturation, short, dropped, queued
        )  # fmt: skip
