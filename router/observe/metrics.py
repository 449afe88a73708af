"""Prometheus metrics, every request metric labelled by experiment arm and worker.

Each router app owns its own ``CollectorRegistry`` (several routers may share one
process in tests). Request metrics are label children cached per (arm, worker) so the
hot path does no label lookups; index, event and worker gauges are read from the live
objects at scrape time instead of being kept up to date on every change.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.workers.registry import WorkerRegistry

TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class Series:
    """The label children of one (arm, worker)."""

    __slots__ = ("hit_tokens", "prompt_tokens", "requests", "routed_hit_tokens", "ttft")

    def __init__(self, m: RouterMetrics, arm: str, worker: str) -> None:
        self.requests = m.requests.labels(arm, worker)
        self.prompt_tokens = m.prompt_tokens.labels(arm, worker)
        self.routed_hit_tokens = m.routed_hit_tokens.labels(arm, worker)
        self.hit_tokens = m.hit_tokens.labels(arm, worker)
        self.ttft = m.ttft.labels(arm, worker)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        aw = ["arm", "worker"]
        self.requests = Counter(
            "cache_router_requests", "Requests sent to a worker", aw, registry=r
        )
        self.prompt_tokens = Counter(
            "cache_router_prompt_tokens", "Prompt tokens routed (router's count)", aw, registry=r
        )
        self.routed_hit_tokens = Counter(
            "cache_router_routed_hit_tokens",
            "Prompt tokens the index said the chosen worker held when routing",
            aw,
            registry=r,
        )
        self.hit_tokens = Counter(
            "cache_router_hit_tokens",
            "Cached prompt tokens reported by the engine (usage cached_tokens)",
            aw,
            registry=r,
        )
        self.ttft = Histogram(
            "cache_router_ttft_seconds",
            "Router-measured time to the engine's first response byte",
            aw,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "cache_router_errors", "Failed requests by kind", [*aw, "kind"], registry=r
        )
        self.retries = Counter(
            "cache_router_retries", "Sends retried on another worker", ["worker"], registry=r
        )
        self.migrations = Counter(
            "cache_router_migrations",
            "Requests moved to another engine after theirs broke (router.forward.migrate), "
            "by cause: connection, status, stall, error_event",
            ["cause"],
            registry=r,
        )
        self.tokens_in = Counter(
            "cache_router_tokens_in",
            "Chats and Responses requests sent to the engine as the router's token ids "
            "(outcome sent), or as they came and why (router.forward.tokens_in)",
            ["outcome"],
            registry=r,
        )
        self.not_migrated = Counter(
            "cache_router_not_migrated",
            "Requests whose engine broke and that could not move to another one, by why",
            ["reason"],
            registry=r,
        )
        self.passthrough = Counter(
            "cache_router_passthrough_requests",
            "Requests sent on without a cache-aware decision (embeddings, score, rerank, "
            "tokenize, stored responses), by endpoint",
            ["endpoint", "worker"],
            registry=r,
        )
        self.prefetch_hints = Counter(
            "cache_router_prefetch_hints", "Prefetch hints published", aw, registry=r
        )
        self._series: dict[tuple[str, str], Series] = {}

    def series(self, arm: str, worker: str) -> Series:
        s = self._series.get((arm, worker))
        if s is None:
            s = self._series[(arm, worker)] = Series(self, arm, worker)
        return s

    def error(self, arm: str, worker: str, kind: str) -> None:
        self.errors.labels(arm, worker, kind).inc()

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def by_arm(self) -> dict[str, dict[str, float | None]]:
        """Live per-arm totals (summed over workers) for the admin API."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for metric, key in (
            (self.requests, "requests"),
            (self.prompt_tokens, "prompt_tokens"),
            (self.routed_hit_tokens, "routed_hit_tokens"),
            (self.hit_tokens, "hit_tokens"),
            (self.errors, "errors"),
        ):
            for family in metric.collect():
                for s in family.samples:
                    if s.name.endswith("_total"):
                        out[s.labels["arm"]][key] += s.value
        for family in self.ttft.collect():
            for s in family.samples:
                if s.name.endswith("_sum"):
                    out[s.labels["arm"]]["ttft_sum_seconds"] += s.value
                elif s.name.endswith("_count"):
                    out[s.labels["arm"]]["ttft_count"] += s.value
        result = {}
        for arm, v in out.items():
            n = v.get("ttft_count", 0.0)
            prompt = v.get("prompt_tokens", 0.0)
            result[arm] = {
                **v,
                "ttft_mean_seconds": v.get("ttft_sum_seconds", 0.0) / n if n else None,
                "hit_rate": v.get("hit_tokens", 0.0) / prompt if prompt else None,
            }
        return result


class StateCollector(Collector):
    """Index, event and worker state, read at scrape time."""

    def __init__(
        self,
        registry: WorkerRegistry,
        event_counts: Callable[[], dict[str, int]],
        event_lag: Callable[[], tuple[int, float]] = lambda: (0, 0.0),
    ) -> None:
        self.workers = registry
        self.event_counts = event_counts
        self.event_lag = event_lag

    def collect(self) -> Iterator[Metric]:
        blocks = GaugeMetricFamily(
            "cache_router_index_blocks", "Blocks in the index", labels=["pool"]
        )
        held = GaugeMetricFamily(
            "cache_router_index_worker_blocks",
            "Blocks a worker holds, per tier",
            labels=["pool", "worker", "tier"],
        )
        dropped = CounterMetricFamily(
            "cache_router_index_dropped_blocks",
            "Blocks evicted by the index bound",
            labels=["pool"],
        )
        ingest: dict[str, Any] = {
            name: CounterMetricFamily(f"cache_router_events_{name}", help_, labels=["pool"])
            for name, help_ in (
                ("applied", "KV events applied"),
                ("gaps", "Sequence gaps detected"),
                ("restarts", "Engine restarts detected"),
                ("duplicates", "Duplicate batches ignored"),
            )
        }
        errors = CounterMetricFamily(
            "cache_router_event_errors", "KV events skipped, by reason", labels=["pool", "reason"]
        )
        for pool in self.workers.pools.values():
            stats = pool.index.stats()
            blocks.add_metric([pool.name], stats.blocks)
            dropped.add_metric([pool.name], stats.dropped)
            for worker, tiers in stats.workers.items():
                for tier, n in tiers.items():
                    held.add_metric([pool.name, worker, tier], n)
            ing = pool.ingest
            for name, value in (
                ("applied", ing.events_applied),
                ("gaps", ing.gaps),
                ("restarts", ing.restarts),
                ("duplicates", ing.duplicates),
            ):
                ingest[name].add_metric([pool.name], value)
            for reason, n in ing.errors.items():
                errors.add_metric([pool.name, reason], n)
        yield from (blocks, held, dropped, *ingest.values(), errors)
        nats = CounterMetricFamily("cache_router_nats", "NATS subscriber counts", labels=["kind"])
        for kind, n in self.event_counts().items():
            nats.add_metric([kind], n)
        yield nats
        queued, age = self.event_lag()
        yield GaugeMetricFamily(
            "cache_router_events_queued_batches",
            "Live KV-event batches waiting for the ingest thread",
            value=queued,
        )
        yield GaugeMetricFamily(
            "cache_router_events_lag_seconds",
            "How long the oldest waiting KV-event batch has waited",
            value=age,
        )
        gauges = {
            key: GaugeMetricFamily(
                f"cache_router_worker_{key}", key.replace("_", " "), labels=["worker"]
            )
            for key in ("inflight_requests", "inflight_prefill_tokens", "decode_streams", "healthy")
        }
        for w in self.workers:
            gauges["inflight_requests"].add_metric([w.id], w.load.inflight_requests)
            gauges["inflight_prefill_tokens"].add_metric([w.id], w.load.inflight_prefill_tokens)
            gauges["decode_streams"].add_metric([w.id], w.load.decode_streams)
            gauges["healthy"].add_metric([w.id], float(w.healthy))
        yield from gauges.values()
