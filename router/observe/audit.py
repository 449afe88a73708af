"""The hit-prediction audit: per worker, the cached tokens the router predicted against
the ones the engine reports (``usage.prompt_tokens_details.cached_tokens``).

The most common failure in the field is silent: a wrong tokenizer or chat template, a
block size that differs from the engine's, events that never arrive (vLLM's publisher
connects instead of binding unless its endpoint is a wildcard), and the router just
predicts zero hits while the engine hits. The two counts agree request for request
when all is well (every request of ``tests/real_engines`` against vLLM), so the audit
keeps a sliding window per worker and warns when they drift apart beyond a bound, or
when a worker serves prefix traffic but has sent no KV event at all.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

WINDOW = 200  # requests per worker the divergence is measured over
MIN_SAMPLES = 20  # fewer requests than this in the window: no verdict yet
FIRST_BLOCKS = 4096  # first-block hashes remembered per worker (prefix traffic)


@dataclass(slots=True)
class WorkerAudit:
    requests: int = 0  # responses that reported cached_tokens
    unreported: int = 0  # responses without cached_tokens (usage off or no details)
    predicted_tokens: int = 0
    reported_tokens: int = 0
    mismatched: int = 0  # requests whose prediction differed from the engine's count
    repeated_prefixes: int = 0  # requests whose first block went to this worker before
    window: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    window_abs: int = 0  # sum |predicted - reported| over the window
    window_max: int = 0  # sum max(predicted, reported) over the window
    first_blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)
    warned: frozenset[str] = frozenset()

    def divergence(self) -> float | None:
        """Mismatched hit tokens over the window, 0 (exact) .. 1 (nothing agrees)."""
        if len(self.window) < MIN_SAMPLES:
            return None
        return self.window_abs / self.window_max if self.window_max else 0.0


class HitAudit:
    """Fed by the proxy per request; read by metrics, ``/admin/index`` and the doctor."""

    def __init__(self, bound: float, events_seen: Callable[[str], bool]) -> None:
        self.bound = bound
        self.events_seen = events_seen  # did this worker's KV events ever reach us?
        self.workers: dict[str, WorkerAudit] = {}

    def _get(self, worker_id: str) -> WorkerAudit:
        a = self.workers.get(worker_id)
        if a is None:
            a = self.workers[worker_id] = WorkerAudit()
        return a

    def routed(self, worker_id: str, first_block: int | None) -> None:
        """A request went to ``worker_id``; its first block says if prefixes repeat."""
        if first_block is None:
            return
        a = self._get(worker_id)
        seen = a.first_blocks
        if first_block in seen:
            a.repeated_prefixes += 1
            seen.move_to_end(first_block)
        else:
            seen[first_block] = None
            if len(seen) > FIRST_BLOCKS:
                seen.popitem(last=False)

    def record(self, worker_id: str, predicted: int, reported: int | None) -> None:
        a = self._get(worker_id)
        if reported is None:
            a.unreported += 1
        else:
            a.requests += 1
            a.predicted_tokens += predicted
            a.reported_tokens += reported
            a.mismatched += predicted != reported
            if len(a.window) == a.window.maxlen:
                p, r = a.window[0]
                a.window_abs -= abs(p - r)
                a.window_max -= max(p, r)
            a.window.append((predicted, reported))
            a.window_abs += abs(predicted - reported)
            a.window_max += max(predicted, reported)
        self._warn(worker_id, a)

    def warnings(self, worker_id: str) -> dict[str, str]:
        """What looks wrong with ``worker_id``, by kind, in words an operator can act on."""
        a = self.workers.get(worker_id)
        if a is None:
            return {}
        out: dict[str, str] = {}
        kinds = self._kinds(worker_id, a)
        if "divergence" in kinds:
            out["divergence"] = (
                f"predicted cached tokens differ from the engine's by {a.divergence():.0%} "
                f"over the last {len(a.window)} requests (bound {self.bound:.0%}): check the "
                "tokenizer and chat template, the block size, and that the worker's events "
                "arrive"
            )
        if "no_events" in kinds:
            out["no_events"] = (
                "serves prefix traffic but no KV event from it ever arrived: check its agent "
                "and the engine's KV-event endpoint (vLLM binds only tcp://*:PORT or ipc://)"
            )
        if "no_usage" in kinds:
            out["no_usage"] = (
                "the engine reports no cached_tokens, so hits cannot be audited "
                "(vLLM: --enable-prompt-tokens-details)"
            )
        return out

    def _kinds(self, worker_id: str, a: WorkerAudit) -> frozenset[str]:
        """The kinds of ``warnings`` that hold, without their words (checked per request)."""
        kinds = []
        div = a.divergence()
        if div is not None and div > self.bound:
            kinds.append("divergence")
        prefix_traffic = a.repeated_prefixes > 0 or a.reported_tokens > 0
        if prefix_traffic and not self.events_seen(worker_id):
            kinds.append("no_events")
        if a.unreported >= MIN_SAMPLES and a.requests == 0:
            kinds.append("no_usage")
        return frozenset(kinds)

    def _warn(self, worker_id: str, a: WorkerAudit) -> None:
        new = self._kinds(worker_id, a)
        onset = new - a.warned
        if onset:  # once per onset, not per request
            words = self.warnings(worker_id)
            for kind in sorted(onset):
                log.warning("hit audit: worker %s %s", worker_id, words[kind])
        a.warned = new

    def snapshot(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for worker_id, a in self.workers.items():
            out[worker_id] = {
                "requests": a.requests,
                "unreported": a.unreported,
                "predicted_hit_tokens": a.predicted_tokens,
                "reported_hit_tokens": a.reported_tokens,
                "mismatched_requests": a.mismatched,
                "repeated_prefixes": a.repeated_prefixes,
                "window": len(a.window),
                "divergence": a.divergence(),
                "events_seen": self.events_seen(worker_id),
                "warnings": self.warnings(worker_id),
            }
        return out


class AuditCollector(Collector):
    def __init__(self, audit: HitAudit) -> None:
        self.audit = audit

    def collect(self) -> Iterator[Metric]:
        w = ["worker"]
        counters = {
            key: CounterMetricFamily(f"cache_router_audit_{key}", text, labels=w)
            for key, text in (
                ("requests", "Responses that reported cached_tokens"),
                ("predicted_hit_tokens", "Cached tokens the router predicted, audited requests"),
                ("reported_hit_tokens", "Cached tokens the engine reported, audited requests"),
                ("mismatched_requests", "Requests whose predicted and reported hits differ"),
            )
        }
        divergence = GaugeMetricFamily(
            "cache_router_audit_divergence",
            "Mismatched hit tokens over the recent window, 0..1 (absent until enough requests)",
            labels=w,
        )
        warning = GaugeMetricFamily(
            "cache_router_audit_warning",
            "1 while the audit warns about a worker (divergence, no_events, no_usage)",
            labels=["worker", "kind"],
        )
        for worker_id, a in self.audit.workers.items():
            counters["requests"].add_metric([worker_id], a.requests)
            counters["predicted_hit_tokens"].add_metric([worker_id], a.predicted_tokens)
            counters["reported_hit_tokens"].add_metric([worker_id], a.reported_tokens)
            counters["mismatched_requests"].add_metric([worker_id], a.mismatched)
            div = a.divergence()
            if div is not None:
                divergence.add_metric([worker_id], div)
            for kind in ("divergence", "no_events", "no_usage"):
                warning.add_metric([worker_id, kind], float(kind in a.warned))
        yield from (*counters.values(), divergence, warning)
