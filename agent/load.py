"""Engine load from its Prometheus ``/metrics`` text, for ``kv.load.<worker_id>``.

vLLM and SGLang name the same three numbers differently; a DP engine exposes one series
per rank (label ``engine`` / ``dp``), so request counts are summed and usage averaged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from router.load import KV_USAGE_GAUGES, RUNNING_GAUGES, WAITING_GAUGES


@dataclass(slots=True, frozen=True)
class LoadReport:
    running: int
    waiting: int
    kv_usage: float
    ts: float

    def to_json(self) -> dict[str, float | int]:
        return {
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "ts": self.ts,
        }


def _samples(text: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample.value)
    return out


def _first(samples: dict[str, list[float]], names: tuple[str, ...]) -> list[float] | None:
    return next((samples[n] for n in names if samples.get(n)), None)


def parse_load(text: str, *, ts: float | None = None) -> LoadReport:
    """The load report in ``text``; ValueError when it has neither vLLM nor SGLang gauges."""
    samples = _samples(text)
    running = _first(samples, RUNNING_GAUGES)
    waiting = _first(samples, WAITING_GAUGES)
    usage = _first(samples, KV_USAGE_GAUGES)
    if running is None or waiting is None or usage is None:
        raise ValueError("no vLLM or SGLang load gauges in /metrics")
    return LoadReport(
        running=round(sum(running)),
        waiting=round(sum(waiting)),
        kv_usage=sum(usage) / len(usage),
        ts=time.time() if ts is None else ts,
    )
