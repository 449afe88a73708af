"""DNS discovery against a real DNS server (tests/dns_server.py on loopback, started here).

Engines come and go under traffic and no request fails: a new address is checked before
it takes traffic, a vanished one is drained before it is removed, a DNS outage changes
nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from dns_server import DnsServer
from stack import Served, until

from router.config import ConfigError, DiscoverySpec, RouterConfig, discovery_spec, load_config
from router.http.app import RouterApp
from router.http.serve import add_arguments, config_from_args
from router.workers.discovery import DnsDiscovery, Endpoint
from router.workers.registry import WorkerRegistry
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.scheduler import Timing

MODEL = "mock-model"


@pytest.fixture
def dns() -> Iterator[DnsServer]:
    server = DnsServer()
    try:
        yield server.start()
    finally:
        server.close()


def shared_port(hosts: list[str]) -> int:
    """A port free on every one of ``hosts`` (A records carry no port: one for all)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = int(s.getsockname()[1])
        try:
            for h in hosts:
                with socket.socket() as s:
                    s.bind((h, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback address")


@contextlib.asynccontextmanager
async def engines(hosts: list[str], port: int) -> AsyncIterator[dict[str, MockEngine]]:
    started: dict[str, MockEngine] = {}
    try:
        for h in hosts:
            cfg = MockEngineConfig(host=h, port=port, model=MODEL, timing=Timing(speed=50.0))
            started[h] = await MockEngine(cfg).start()
        yield started
    finally:
        for e in started.values():
            await e.stop()


# -- configuration --------------------------------------------------------------------


def test_discovery_sources_from_strings_tables_env_and_flags(tmp_path):
    a = discovery_spec("dns://vllm.default.svc:8001?model=llama&interval=2.5", "flag")
    assert (a.record, a.name, a.port, a.model, a.interval) == ("a", "vllm.default.svc", 8001,
                                                               "llama", 2.5)  # fmt: skip
    s = discovery_spec("srv://_http._tcp.vllm.ns.svc.?nameserver=10.0.0.10:53&scheme=https", "f")
    assert (s.record, s.name, s.nameserver, s.scheme) == ("srv", "_http._tcp.vllm.ns.svc",
                                                          "10.0.0.10:53", "https")  # fmt: skip
    toml = tmp_path / "r.toml"
    toml.write_text(
        '[[discovery]]\nname = "e.ns.svc"\nport = 9000\npool = "p"\nblock_size = 32\n'
        'interval = 1\n'
    )
    cfg = load_config(toml, env={"CACHE_ROUTER_DISCOVER": "srv://_x._tcp.f.svc"})
    assert [(d.name, d.record) for d in cfg.discovery] == [("e.ns.svc", "a"), ("_x._tcp.f.svc",
                                                                              "srv")]  # fmt: skip
    assert cfg.discovery[0] == DiscoverySpec("e.ns.svc", port=9000, pool="p", block_size=32,
                                             interval=1.0)  # fmt: skip
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--discover", "dns://a.svc:1", "--discover", "srv://b.svc"])
    assert [d.name for d in config_from_args(args).discovery] == ["a.svc", "b.svc"]
    for bad in (
        "http://a.svc",  # not a discovery scheme
        "dns://a.svc:8000?interval=0",  # resolving in a loop
        "dns://a.svc:8000?interval=1e9",
        "dns://a.svc:8000?record=mx",
        "dns://a.svc:8000?scheme=ftp",
        "dns://a.svc:8000?colour=red",
        "dns://a.svc:8000?block_size=-1",
        "dns://a.svc:99999",
        "dns://a b.svc:8000",
    ):
        with pytest.raises(ConfigError):
            discovery_spec(bad, "flag")
    with pytest.raises(ConfigError):
        discovery_spec({"name": "a.svc", "port": True}, "toml")


# -- resolving ------------------------------------------------------------------------


async def test_resolves_a_aaaa_and_srv_and_tells_no_answer_from_no_records(dns):
    dns.set_srv([("_http._tcp.pool.test", "vllm-0.pool.test", 9001),
                 ("_http._tcp.pool.test", "vllm-1.pool.test", 9002)])  # fmt: skip
    dns.set_hosts({
        "engines.test": ["127.0.0.2", "127.0.0.3"], "six.test": ["::1"],
        "vllm-0.pool.test": ["127.0.0.5"], "vllm-1.pool.test": ["127.0.0.6"],
    })  # fmt: skip
    registry = WorkerRegistry(RouterConfig())

    def source(name: str, record: str = "a") -> DnsDiscovery:
        spec = DiscoverySpec(name, record=record, port=8000, nameserver=dns.nameserver)
        return DnsDiscovery(spec, registry, drain_timeout=1.0)

    a = source("engines.test")
    found = await until(a.resolve, what="the A records")
    assert found == {
        Endpoint("engines-127-0-0-2-8000", "http://127.0.0.2:8000"),
        Endpoint("engines-127-0-0-3-8000", "http://127.0.0.3:8000"),
    }
    assert await source("six.test").resolve() == {Endpoint("six---1-8000", "http://[::1]:8000")}
    assert await source("_http._tcp.pool.test", "srv").resolve() == {
        Endpoint("vllm-0-9001", "http://127.0.0.5:9001"),
        Endpoint("vllm-1-9002", "http://127.0.0.6:9002"),
    }
    assert await source("missing.test").resolve() == set()  # NXDOMAIN: an answer
    assert await source("_http._tcp.missing.test", "srv").resolve() == set()
    dns.stop()
    assert await a.resolve() is None  # no server: no answer, not "no engines"


# -- the router -----------------------------------------------------------------------


def router_config(dns: DnsServer, spec: str) -> RouterConfig:
    return RouterConfig(
        admin_token="t",
        health_interval=0.2,
        discovery=[discovery_spec(spec + f"&interval=0.1&nameserver={dns.nameserver}", "t")],
    )


class Traffic:
    """Requests in a loop (streamed and not) from a few clients; every answer counted."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url = url
        self.clients = clients
        self.by_worker: Counter[str] = Counter()
        # answers to requests sent once ``marked``: one sent before can be counted later,
        # its answer read after the router had finished it and removed its engine (CI, once)
        self.since_mark: Counter[str] = Counter()
        self.marked = False
        self.failures: list[str] = []
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> Traffic:
        self.tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        return self

    async def _client(self, i: int) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                body = {"model": MODEL, "prompt": f"client {i} request {n} " * 8,
                        "max_tokens": 4, "stream": n % 2 == 0}  # fmt: skip
                marked = self.marked
                try:
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        text = (await r.aread()).decode()
                    if r.status_code != 200 or ("[DONE]" not in text and body["stream"]):
                        self.failures.append(f"{r.status_code} {text[:200]}")
                    else:
                        self.by_worker[r.headers["x-cache-router-worker"]] += 1
                        if marked:
                            self.since_mark[r.headers["x-cache-router-worker"]] += 1
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))

    async def served_by(self, worker_id: str, n: int = 5) -> None:
        start = self.by_worker[worker_id]
        await until(lambda: self.by_worker[worker_id] >= start + n, timeout=20,
                    what=f"{n} requests on {worker_id}")  # fmt: skip

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


async def test_engines_are_added_and_drained_under_traffic_without_a_failed_request(dns):
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    port = shared_port(hosts)
    ids = {h: "engines-" + h.replace(".", "-") + f"-{port}" for h in hosts}
    dns.set_hosts({"engines.test": hosts[:1]})
    app = RouterApp(router_config(dns, f"dns://engines.test:{port}?model={MODEL}"))
    async with engines(hosts, port) as running:
        served = await Served(app).start()
        registry = app.state.registry
        try:
            await until(lambda: registry.get(ids[hosts[0]]) is not None
                        and registry.get(ids[hosts[0]]).healthy, timeout=10,
                        what="the first engine found")  # fmt: skip
            traffic = Traffic(served.url).start()
            await traffic.served_by(ids[hosts[0]])
            # scale up: two more pods behind the service
            dns.set_hosts({"engines.test": hosts})
            await traffic.served_by(ids[hosts[1]])
            await traffic.served_by(ids[hosts[2]])
            # scale down: the first pod leaves the service, is drained, then removed...
            dns.set_hosts({"engines.test": hosts[1:]})
            await until(lambda: registry.get(ids[hosts[0]]) is None, timeout=10,
                        what="the first engine removed")  # fmt: skip
            traffic.marked = True
            await running[hosts[0]].stop()  # ...and only then does its engine stop
            del running[hosts[0]]
            await traffic.served_by(ids[hosts[1]])
            await traffic.served_by(ids[hosts[2]])
            await traffic.finish()
            assert traffic.since_mark[ids[hosts[0]]] == 0, traffic.since_mark
            assert min(traffic.since_mark[ids[h]] for h in hosts[1:]) >= 1  # 4 clients, 5 each
            assert traffic.failures == []
            assert sum(traffic.by_worker.values()) > 30
            (source,) = app.state.discovery
            assert source.describe()["workers"] == sorted(ids[h] for h in hosts[1:])
        finally:
            await served.stop()


async def test_srv_records_and_a_dns_outage_keeps_the_pool(dns):
    async with engines(["127.0.0.1"], 0) as one:
        e0 = one["127.0.0.1"]
        async with engines(["127.0.0.1"], 0) as two:
            e1 = two["127.0.0.1"]
            dns.set_hosts({"vllm-0.pool.test": ["127.0.0.1"], "vllm-1.pool.test": ["127.0.0.1"]})
            dns.set_srv([("_http._tcp.pool.test", "vllm-0.pool.test", e0.port)])
            app = RouterApp(router_config(dns, "srv://_http._tcp.pool.test?pool=default"))
            served = await Served(app).start()
            registry = app.state.registry
            w0, w1 = f"vllm-0-{e0.port}", f"vllm-1-{e1.port}"
            try:
                await until(lambda: registry.get(w0) and registry.get(w0).models == {MODEL},
                            timeout=10, what="the SRV target found, its model learnt")  # fmt: skip
                traffic = Traffic(served.url, clients=2).start()
                await traffic.served_by(w0)
                dns.stop()  # the DNS server is down: resolutions fail, nothing is removed
                (source,) = app.state.discovery
                failed = source.failures
                await until(lambda: source.failures >= failed + 2, timeout=15,
                            what="failed resolutions")  # fmt: skip
                await traffic.served_by(w0)
                assert [w.id for w in registry] == [w0]
                dns.srv = [("_http._tcp.pool.test", "vllm-0.pool.test", e0.port),
                           ("_http._tcp.pool.test", "vllm-1.pool.test", e1.port)]  # fmt: skip
                dns.start()
                await traffic.served_by(w1)
                await traffic.finish()
                assert traffic.failures == []
                assert {w.id for w in registry} == {w0, w1}
            finally:
                await served.stop()
