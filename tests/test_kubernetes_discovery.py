"""Engines from the Kubernetes API (router/workers/kubernetes.py), against a stand-in API server.

The real API server cannot run here: ``kube_api.StandInApiServer`` serves the pods
list/watch protocol (HTTPS, a bearer token, resource versions, bookmarks, selectors
applied to old and new objects, 410 after a compaction) and nothing else. Engine
doubles play the pods' engines on loopback ports (each pod's port in its
``cache-router.io/port`` annotation); the router serves HTTP in-process. Every test
changes the cluster and then checks that routing followed: which engines get requests.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from kube_api import StandInApiServer, pod
from stack import EngineDouble, Served, until

from router.config import KubernetesSpec, RouterConfig
from router.http.app import RouterApp
from router.workers.kubernetes import KubernetesDiscovery

NS = "llm"
TOKEN = "sa-token"


class Cluster:
    """The stand-in API server, engine doubles for its pods, a router discovering them."""

    def __init__(self, api: StandInApiServer, engines: dict[str, EngineDouble]) -> None:
        self.api = api
        self.engines = engines
        self.app: RouterApp | None = None
        self.served: Served | None = None
        self.discovery: KubernetesDiscovery | None = None
        self.settings: dict[str, Any] = {}
        self.http = httpx.AsyncClient(timeout=10)

    def pod(self, name: str, labels: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
        port = self.engines[name].served.port
        notes = {"cache-router.io/port": str(port), **kw.pop("annotations", {})}
        return pod(name, {"app": "vllm"} if labels is None else labels, annotations=notes, **kw)

    async def route(self, tmp_path: Any, **spec: Any) -> KubernetesDiscovery:
        """The router, configured with one ``[[kubernetes]]`` source, serving."""
        token, ca = self.api.write_credentials(tmp_path)
        k8s = KubernetesSpec(**{"selector": "app=vllm", "namespace": NS, "model": "m",
                                "api_server": self.api.url, "token_file": token,
                                "ca_file": ca, "interval": 0.1, **spec})  # fmt: skip
        cfg = RouterConfig(block_size=4, health_interval=0.2, drain_timeout=5.0, kubernetes=[k8s],
                           **self.settings)  # fmt: skip
        self.app = RouterApp(cfg)
        self.served = await Served(self.app).start()
        (self.discovery,) = self.app.state.discovery
        await until(lambda: self.discovery.synced, what="listed")
        return self.discovery

    def usable(self) -> set[str]:
        assert self.app is not None
        registry = self.app.state.registry
        now = time.monotonic()
        return {w.id for w in registry if w.usable(now)}

    async def served_by(self, n: int = 12) -> set[str]:
        """Who answered ``n`` completions (different prompts: load spreads them)."""
        assert self.served is not None
        seen = set()
        for i in range(n):
            body = {"model": "m", "prompt": f"p{i} " * 5, "max_tokens": 1}
            r = await self.http.post(f"{self.served.url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-cache-router-worker"])
        return seen

    async def stop(self) -> None:
        if self.served is not None:
            await self.served.stop()
        await self.http.aclose()
        await self.api.stop()
        for e in self.engines.values():
            await e.stop()


@pytest.fixture
async def cluster(tmp_path):
    api = await StandInApiServer(NS, TOKEN).start(tmp_path)
    engines = {f"w{i}": await EngineDouble(f"w{i}", block_size=4).start() for i in range(4)}
    c = Cluster(api, engines)
    yield c
    await c.stop()


async def test_pods_added_ready_unready_deleted_relabelled(cluster, tmp_path):
    api = cluster.api
    api.create(cluster.pod("w0"))
    api.create(cluster.pod("w1", ready=False))
    api.create(cluster.pod("w2", labels={"app": "other"}))  # not selected
    await cluster.route(tmp_path)
    await until(lambda: cluster.usable() == {"w0"}, what="w0 only")
    assert await cluster.served_by() == {"w0"}
    # ready: routed to within an interval
    api.update("w1", ready=True)
    await until(lambda: cluster.usable() == {"w0", "w1"}, what="w1 ready")
    assert await cluster.served_by() == {"w0", "w1"}
    # unready: drained at once (its index kept), no request reaches it
    api.update("w0", ready=False)
    await until(lambda: cluster.usable() == {"w1"}, what="w0 unready")
    before = len(cluster.engines["w0"].requests)
    assert await cluster.served_by() == {"w1"}
    assert len(cluster.engines["w0"].requests) == before
    assert cluster.app.state.registry.get("w0") is not None  # kept, drained
    # relabelled into the selector: added; out of it: gone
    api.update("w2", labels={"app": "vllm"})
    api.update("w1", labels={"app": "retired"})
    await until(lambda: cluster.usable() == {"w2"}, what="w2 in, w1 out")
    await until(lambda: cluster.app.state.registry.get("w1") is None, what="w1 removed")
    # deleted: removed, and never routed to again
    api.delete("w0")
    await until(lambda: cluster.app.state.registry.get("w0") is None, what="w0 removed")
    counts = {n: len(e.requests) for n, e in cluster.engines.items()}
    assert await cluster.served_by() == {"w2"}
    for name in ("w0", "w1"):
        assert len(cluster.engines[name].requests) == counts[name]
    # a pod being deleted (deletionTimestamp) stops taking requests before it goes
    api.create(cluster.pod("w3"))
    await until(lambda: cluster.usable() == {"w2", "w3"}, what="w3 up")
    api.update("w3", deleting=True)
    await until(lambda: cluster.usable() == {"w2"}, what="w3 terminating")


async def test_a_watch_expiring_with_410_lists_again(cluster, tmp_path):
    api = cluster.api
    api.create(cluster.pod("w0"))
    discovery = await cluster.route(tmp_path, watch_timeout=1.0)
    await until(lambda: cluster.usable() == {"w0"}, what="w0")
    for gone_status in (False, True):  # the ERROR event, then the HTTP status
        api.gone_status = gone_status
        lists = discovery.sources[0].lists
        # changes while the watch is away, then the history compacted past them
        api.compact()
        name = "w1" if not gone_status else "w2"
        api.create(cluster.pod(name))
        api.delete("w0" if not gone_status else "w1")
        api.compact()
        await until(lambda lists=lists: discovery.sources[0].lists > lists, what="relisted")
        assert discovery.sources[0].expired >= 1
        await until(lambda name=name: cluster.usable() == {name}, what=f"{name} only")
    assert await cluster.served_by() == {"w2"}
    # each watch asked for bookmarks from the version it had
    watches = [q for q in api.requests if q.get("watch") == "1"]
    assert all(q["allowWatchBookmarks"] == "true" and q["resourceVersion"] for q in watches)


async def test_bookmarks_move_the_version_and_pages_are_followed(cluster, tmp_path):
    api = cluster.api
    for i in range(3):
        api.create(cluster.pod(f"w{i}"))
    for i in range(7):  # pods of another app: their events never reach this watch
        api.create(pod(f"x{i}", {"app": "x"}))
    discovery = await cluster.route(tmp_path)
    import router.workers.kubernetes as k8s

    assert k8s.PAGE >= 3
    source = discovery.sources[0]
    start = int(source.version)
    api.create(pod("x-late", {"app": "x"}))
    await until(lambda: int(source.version) > start, what="a bookmark moved the version")
    await until(lambda: cluster.usable() == {"w0", "w1", "w2"}, what="all three")


async def test_paged_list(cluster, tmp_path, monkeypatch):
    import router.workers.kubernetes as k8s

    monkeypatch.setattr(k8s, "PAGE", 2)
    for i in range(4):
        cluster.api.create(cluster.pod(f"w{i}"))
    await cluster.route(tmp_path)
    await until(lambda: cluster.usable() == {"w0", "w1", "w2", "w3"}, what="all pages")
    pages = [q for q in cluster.api.requests if "watch" not in q]
    assert [q.get("continue") for q in pages[:2]] == [None, "2"]


async def test_roles_dp_size_and_worker_id_from_the_pod(cluster, tmp_path):
    api = cluster.api
    api.create(cluster.pod("w0", labels={"app": "vllm", "role": "prefill"}))
    api.create(cluster.pod("w1", labels={"app": "vllm", "role": "decode"},
                           annotations={"cache-router.io/dp-size": "2"}))  # fmt: skip
    api.create(cluster.pod("w2", labels={"app": "vllm", "role": "decode"},
                           annotations={"cache-router.io/worker-id": "decode-b"}))  # fmt: skip
    await cluster.route(tmp_path, selector="", prefill_selector="app=vllm,role=prefill",
                        decode_selector="app=vllm,role=decode")  # fmt: skip
    registry = cluster.app.state.registry
    await until(lambda: len(registry) == 3, what="three workers")
    assert registry.get("w0").role == "prefill"
    assert registry.get("w1").role == "decode" and registry.get("w1").dp_size == 2
    assert registry.get("w1").targets == ["w1-dp0", "w1-dp1"]
    assert registry.get("decode-b").role == "decode"


async def test_the_api_refusing_or_away_keeps_the_pool(cluster, tmp_path):
    api = cluster.api
    api.create(cluster.pod("w0"))
    discovery = await cluster.route(tmp_path)
    await until(lambda: cluster.usable() == {"w0"}, what="w0")
    api.token = "rotated-elsewhere"  # every call now 401
    api.compact()  # the watch ends; the next list is refused
    await until(lambda: discovery.failures >= 1, what="a refused call")
    assert cluster.usable() == {"w0"}  # nothing removed for an API that does not answer
    api.token = TOKEN
    api.create(cluster.pod("w1"))
    await until(lambda: cluster.usable() == {"w0", "w1"}, what="back in step")


async def test_the_endpoint_picker_is_ready_once_the_pods_are_listed(cluster, tmp_path):
    """``epp_port`` and ``[[kubernetes]]`` together, from the config: the EPP is ready once
    the pods are listed (its readiness follows ``synced``), and routes to them."""
    from epp_gateway import Gateway
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from sim.mock.natsd import free_ports

    (port,) = free_ports(1)
    cluster.settings = {"epp_port": port}
    cluster.api.create(cluster.pod("w0"))
    await cluster.route(tmp_path)
    gw = Gateway(port)
    try:
        stub = health_pb2_grpc.HealthStub(gw.channel)

        async def ready() -> bool:
            r = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
            return r.status == health_pb2.HealthCheckResponse.SERVING

        await until(ready, what="the picker ready")
        await until(lambda: cluster.usable() == {"w0"}, what="w0 up")
        ex = await gw.send("/v1/completions", b'{"model": "m", "prompt": "hi"}')
        assert ex.worker == "w0" and ex.status == 200
        assert ex.endpoint == f"127.0.0.1:{cluster.engines['w0'].served.port}"
    finally:
        await gw.close()


def test_the_source_from_a_flag_a_table_and_the_checks(tmp_path):
    from router.config import ConfigError, load_config

    cfg = load_config(env={}, extra_discovery=[
        "k8s://llm?selector=app%3Dvllm,tier%21%3Dcanary&model=m&port=9000&interval=1",
        "dns://engines.llm.svc:8000",
    ])  # fmt: skip
    (k8s,) = cfg.kubernetes
    assert (k8s.namespace, k8s.selector, k8s.model, k8s.port) == ("llm", "app=vllm,tier!=canary",
                                                                   "m", 9000)  # fmt: skip
    assert k8s.interval == 1.0 and len(cfg.discovery) == 1
    toml = tmp_path / "r.toml"
    toml.write_text('[[kubernetes]]\nprefill_selector = "role=p"\ndecode_selector = "role=d"\n')
    (k8s,) = load_config(toml, env={}).kubernetes
    assert (k8s.selector, k8s.namespace) == ("", None)  # the pod's own namespace
    for bad, why in [
        ("k8s://llm", "a selector"),
        ("k8s://llm?selector=a%3Db&prefill_selector=r%3Dp", "go together"),
        ("k8s://LLM?selector=a", "not a namespace"),
        ("k8s://llm?selector=a&port=0", "out of range"),
        ("k8s://llm?selector=a&nope=1", "unknown kubernetes keys"),
        ("k8s://llm?selector=a;rm", "not a label selector"),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_config(env={}, extra_discovery=[bad])
