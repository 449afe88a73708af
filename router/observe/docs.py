"""``python3 -m router.observe.docs > docs/metrics.md``: every metric, from the registry.

A router app is built (one worker, nothing started) and its registry read: each family's
name as a scrape shows it, its type, labels and help text; ``cache_router_process_up``
comes from the ``--processes`` supervisor's merge. tests/test_docs.py fails when
docs/metrics.md was not regenerated after a metric changed.
"""

from __future__ import annotations

import sys
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from router.config import load_config
from router.http.app import build_app
from router.http.processes import merge_metrics

HEAD = """# Metrics

Generated from the metrics registry by `python3 -m router.observe.docs > docs/metrics.md`;
tests/test_docs.py fails when it is stale. Do not edit by hand.

`GET /metrics` (behind `metrics_token` when set) serves them in the Prometheus text
format. Request metrics are labelled by experiment `arm` and `worker` (a DP engine's rank
is its own worker, `w0@1`); the state gauges are read at scrape time. With
`--processes N` every sample also has a `process` label.
"""

_SUFFIX = {"counter": "_total"}
_NOT_LABELS = {"le", "quantile"}


def families() -> list[dict[str, Any]]:
    """Name (as scraped), type, labels and help of every metric family, sorted by name."""
    app = build_app(load_config(env={}, extra_workers=["w=http://127.0.0.1:9"]))
    registry = app.state.metrics.registry
    declared: dict[str, tuple[str, ...]] = {}
    for collector in registry._collector_to_names:  # the labels of metrics with no samples
        names = getattr(collector, "_labelnames", None)
        if names is not None:
            declared[collector._name] = tuple(names)  # type: ignore[attr-defined]
    found = list(registry.collect())
    found += text_string_to_metric_families(merge_metrics({0: None}).decode())
    out = []
    for fam in found:
        # a metric's own, else its family's (a collector's families name theirs), else seen
        labels = declared.get(fam.name) or getattr(fam, "_labelnames", None) or None
        if labels is None:
            seen = {k for s in fam.samples for k in s.labels}
            labels = tuple(sorted(seen - _NOT_LABELS))
        out.append(
            {
                "name": fam.name + _SUFFIX.get(fam.type, ""),
                "type": fam.type,
                "labels": labels,
                "help": " ".join(fam.documentation.split()),
            }
        )
    return sorted(out, key=lambda f: f["name"])


def render() -> str:
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for f in families():
        labels = ", ".join(f"`{x}`" for x in f["labels"])
        help_ = f["help"].replace("|", "\\|")
        rows.append(f"| `{f['name']}` | {f['type']} | {labels} | {help_} |")
    return HEAD + "\n" + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
