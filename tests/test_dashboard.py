"""The Grafana dashboard names only metrics the router's /metrics serves.

The router runs in front of a mock engine, takes a request, and its scrape is parsed
with Prometheus' own parser; a family's sample names follow from its type (a counter
``x`` is scraped as ``x_total``, a histogram as ``x_bucket``/``x_sum``/``x_count``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from stack import Served

from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.scheduler import Timing

DASHBOARD = Path(__file__).parent.parent / "dashboards" / "cache-router.json"
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
    "summary": ("_sum", "_count", ""),
}


def dashboard_exprs() -> dict[str, list[str]]:
    dash = json.loads(DASHBOARD.read_text())
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in dash["panels"]}


async def served_names() -> set[str]:
    engine = await MockEngine(MockEngineConfig(timing=Timing(speed=100.0))).start()
    app = RouterApp(RouterConfig(workers=[WorkerSpec("w0", engine.url, model="mock-model")]))
    served = await Served(app).start()
    try:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            body = {"model": "mock-model", "prompt": "hello " * 40, "max_tokens": 2}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            text = (await http.get("/metrics")).text
    finally:
        await served.stop()
        await engine.stop()
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in SUFFIXES[family.type])
    return names


async def test_every_metric_the_dashboard_names_is_served():
    exprs = dashboard_exprs()
    named = {m for es in exprs.values() for e in es for m in re.findall(r"cache_router_\w+", e)}
    served = await served_names()
    assert named, "the dashboard names no metric"
    assert sorted(named - served) == []
    # the four views, each a panel with queries
    titles = " | ".join(exprs).lower()
    for view in ("predicted vs delivered", "time to first token by arm", "per worker", "index",
                 "event health"):  # fmt: skip
        assert view in titles, view
    assert all(exprs.values())


def test_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    variables = {v["name"] for v in dash["templating"]["list"]}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}"
        assert {"h", "w", "x", "y"} <= set(p["gridPos"])
        for t in p["targets"]:
            # every $variable a query uses is defined (Grafana's own ones start with __)
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
            assert used <= variables, (p["title"], used)
