"""Engine load from its Prometheus ``/metrics`` text, for ``kv.load.<worker_id>``.

The router scrapes the same text when no report arrives, so both read it with one
parser (``router.workers.load.parse_engine_metrics``): one engine, one set of numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from index import wire
from router.workers.load import parse_engine_metrics


@dataclass(slots=True, frozen=True)
class LoadReport:
    running: int
    waiting: int
    kv_usage: float
    ts: float
    # why requests wait, where the engine says (None: it does not)
    deferred: int | None = None
    preemptions: float | None = None
    kv_tokens: int | None = None

    def to_json(self) -> wire.LoadReport:
        out: wire.LoadReport = {
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "ts": self.ts,
        }
        if self.deferred is not None:
            out["deferred"] = self.deferred
        if self.preemptions is not None:
            out["preemptions"] = self.preemptions
        if self.kv_tokens is not None:
            out["kv_tokens"] = self.kv_tokens
        return out


def parse_load(text: str, *, ts: float | None = None) -> LoadReport:
    """The load report in ``text``; ValueError when it has neither vLLM nor SGLang gauges."""
    load = parse_engine_metrics(text)
    if load.running is None or load.waiting is None or load.kv_usage is None:
        raise ValueError("no vLLM or SGLang load gauges in /metrics")
    return LoadReport(
        running=load.running,
        waiting=load.waiting,
        kv_usage=load.kv_usage,
        ts=time.time() if ts is None else ts,
        deferred=load.deferred,
        preemptions=load.preemptions,
        kv_tokens=load.kv_tokens,
    )
