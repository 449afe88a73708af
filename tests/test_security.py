"""Security: tokens on admin and metrics, API keys on the public API, an upstream no
request can redirect, and NATS credentials and TLS from the config.

Real servers throughout: the router and engine doubles on loopback ports, and
``nats-server`` processes started with authentication or TLS (certificates from a
throwaway CA made by ``trustme``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import openai
import orjson
import pytest
import trustme
from stack import EngineDouble, Served, until
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from router.config import ConfigError, RouterConfig, WorkerSpec, load_config
from router.events.bus import nats_options
from router.http.app import RouterApp
from sim.mock.natsd import EmbeddedNats


@pytest.fixture
async def router() -> AsyncIterator[Any]:
    running: list[Any] = []

    async def make(**cfg_kw: Any) -> tuple[str, EngineDouble]:
        engine = await EngineDouble("w0").start()
        running.append(engine)
        cfg = RouterConfig(workers=[WorkerSpec("w0", engine.url, model="m")], **cfg_kw)
        served = await Served(RouterApp(cfg)).start()
        running.append(served)
        return served.url, engine

    yield make
    for item in reversed(running):
        await item.stop()


async def test_metrics_behind_a_token_when_configured(router):
    open_url, _ = await router()
    locked_url, _ = await router(metrics_token="m-secret")
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(open_url + "/metrics")).status_code == 200
        for auth in (None, "Bearer wrong", "m-secret", "Basic m-secret"):
            headers = {"authorization": auth} if auth else {}
            r = await http.get(locked_url + "/metrics", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", auth
        r = await http.get(locked_url + "/metrics", headers={"authorization": "Bearer m-secret"})
        assert r.status_code == 200 and "cache_router_requests" in r.text
        assert (await http.get(locked_url + "/health")).status_code == 200  # probes stay open


async def test_admin_api_is_off_without_a_token(router):
    url, _ = await router()
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(url + "/admin/workers", json={"id": "x", "url": "http://127.0.0.1:9"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
        r = await http.get(url + "/admin/workers", headers={"authorization": "Bearer x"})
        assert r.status_code == 403


async def test_api_keys_guard_the_public_api(router):
    url, engine = await router(api_keys=["key-one", "key-two"], admin_token="adm")
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        body = {"model": "m", "prompt": "hi"}
        for auth in (None, "Bearer nope", "Bearer key-one-and-more", "key-one", "Bearer key"):
            headers = {"authorization": auth} if auth is not None else {}
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                r = await http.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (auth, path)
                assert r.json()["error"]["type"] == "authentication_error"
        key = {"authorization": "Bearer key-two"}
        r = await http.post("/v1/completions", json=body, headers=key)
        assert r.status_code == 200
        assert (await http.get("/health")).status_code == 200
        # the admin API keeps its own token, whatever the API keys are
        r = await http.get("/admin/workers", headers={"authorization": "Bearer key-one"})
        assert r.status_code == 401
    good = openai.AsyncOpenAI(base_url=url + "/v1", api_key="key-one", max_retries=0)
    bad = openai.AsyncOpenAI(base_url=url + "/v1", api_key="stolen", max_retries=0)
    try:
        comp = await good.completions.create(model="m", prompt="hello", max_tokens=2)
        assert comp.choices[0].text
        with pytest.raises(openai.AuthenticationError):
            await bad.completions.create(model="m", prompt="hello")
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
    finally:
        await good.close()
        await bad.close()
    assert len(engine.requests) == 2  # nothing unauthenticated reached the engine


async def test_no_request_field_or_header_changes_the_upstream(router):
    decoy_hits: list[str] = []

    async def record(request: Request) -> JSONResponse:
        decoy_hits.append(request.url.path)
        return JSONResponse({"decoy": True})

    decoy = Served(Starlette(routes=[Route("/{path:path}", record, methods=["GET", "POST"])]))
    await decoy.start()
    try:
        url, engine = await router()
        host = f"127.0.0.1:{decoy.port}"
        body = {
            "model": "m",
            "prompt": "where do I go?",
            "url": decoy.url,
            "base_url": decoy.url + "/v1",
            "api_base": decoy.url,
            "endpoint": decoy.url + "/v1/completions",
            "worker": {"id": "evil", "url": decoy.url},
            "extra_body": {"base_url": decoy.url},
        }
        headers = {
            "host": host,
            "x-forwarded-host": host,
            "x-forwarded-for": "127.0.0.1",
            "forwarded": f"host={host};proto=http",
            "x-original-url": decoy.url + "/v1/completions",
            "x-rewrite-url": decoy.url,
            "x-cache-router-worker": "evil",
        }
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            r = await http.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200 and r.headers["x-cache-router-worker"] == "w0"
            msgs = [{"role": "user", "content": "hi"}]
            r = await http.post(
                "/v1/chat/completions", json={**body, "messages": msgs}, headers=headers
            )
            assert r.status_code == 200
        # an absolute-form request line names the decoy as its target
        port = int(url.rsplit(":", 1)[1])
        raw = orjson.dumps({"model": "m", "prompt": "absolute"})
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            f"POST {decoy.url}/v1/completions HTTP/1.1\r\nhost: {host}\r\n"
            f"content-length: {len(raw)}\r\nconnection: close\r\n\r\n".encode()
            + raw
        )
        answer = await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and b"x-cache-router-worker: w0" in answer
        assert decoy_hits == []
        assert len(engine.requests) == 3
        # the router's own host header went to the engine, not the client's
        assert engine.requests[0]["headers"]["host"] == engine.url.removeprefix("http://")
    finally:
        await decoy.stop()


# -- NATS credentials and TLS ---------------------------------------------------------


def nats_process(*flags: str) -> EmbeddedNats:
    """``nats-server`` with extra flags (auth, TLS), JetStream off, on a free loopback port."""
    return EmbeddedNats(jetstream=False, args=flags).start()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("router@cache-router")
    d = tmp_path_factory.mktemp("certs")
    paths = {
        "ca": d / "ca.pem",
        "cert": d / "server.pem",
        "key": d / "server.key",
        "client_cert": d / "client.pem",
        "client_key": d / "client.key",
    }
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    client.cert_chain_pems[0].write_to_path(str(paths["client_cert"]))
    client.private_key_pem.write_to_path(str(paths["client_key"]))
    yield {k: str(v) for k, v in paths.items()}


async def connects(cfg: RouterConfig) -> bool:
    """Whether ``nats.connect`` with the router's options gets in (one attempt)."""
    try:
        nc = await nats.connect(
            cfg.nats_url or "",
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=2,
            **nats_options(cfg),
        )
    except Exception:
        return False
    await nc.close()
    return True


async def router_on_nats(cfg: RouterConfig) -> None:
    """A router with ``cfg`` connects and receives a load report over that NATS."""
    engine = await EngineDouble("w0").start()
    cfg = dataclasses.replace(cfg, workers=[WorkerSpec("w0", engine.url, model="m")])
    served = await Served(RouterApp(cfg)).start()
    try:
        state = served.server.config.app.state
        await until(lambda: state.bus.connected, timeout=10, what="router on NATS")
        nc = await nats.connect(cfg.nats_url or "", **nats_options(cfg))
        report = orjson.dumps({"running": 3, "waiting": 7, "kv_usage": 0.5, "ts": 0})

        async def delivered() -> bool:
            await nc.publish("kv.load.w0", report)
            await nc.flush()
            return state.registry.get("w0").load.engine.waiting == 7

        await until(delivered, timeout=10, what="load report through the secured NATS")
        await nc.close()
    finally:
        await served.stop()
        await engine.stop()


async def test_nats_user_and_password():
    server = nats_process("--user", "router", "--pass", "s3cret")
    try:
        good = RouterConfig(nats_url=server.url, nats_user="router", nats_password="s3cret")
        assert await connects(good)
        for user, password in (("router", "wrong"), ("other", "s3cret")):
            bad = RouterConfig(nats_url=server.url, nats_user=user, nats_password=password)
            assert not await connects(bad)
        assert not await connects(RouterConfig(nats_url=server.url))
        await router_on_nats(good)
    finally:
        server.stop()


async def test_nats_token():
    server = nats_process("--auth", "t0ken")
    try:
        assert await connects(RouterConfig(nats_url=server.url, nats_token="t0ken"))
        assert not await connects(RouterConfig(nats_url=server.url, nats_token="nope"))
    finally:
        server.stop()


async def test_nats_tls_and_mutual_tls(certs, tmp_path: Path):
    server = nats_process("--tls", "--tlscert", certs["cert"], "--tlskey", certs["key"])
    try:
        url = server.url
        assert await connects(RouterConfig(nats_url=url, nats_tls_ca=certs["ca"]))
        assert not await connects(RouterConfig(nats_url=url))  # no TLS: refused
        other_ca = trustme.CA()
        other = tmp_path / "other-ca.pem"
        other_ca.cert_pem.write_to_path(str(other))
        assert not await connects(RouterConfig(nats_url=url, nats_tls_ca=str(other)))
        await router_on_nats(RouterConfig(nats_url=url, nats_tls_ca=certs["ca"]))
    finally:
        server.stop()
    # the server requires a client certificate from the same CA
    server = nats_process(
        "--tlsverify", "--tlscert", certs["cert"], "--tlskey", certs["key"],
        "--tlscacert", certs["ca"],
    )  # fmt: skip
    try:
        url = server.url
        assert not await connects(RouterConfig(nats_url=url, nats_tls_ca=certs["ca"]))
        mutual = RouterConfig(
            nats_url=url,
            nats_tls_ca=certs["ca"],
            nats_tls_cert=certs["client_cert"],
            nats_tls_key=certs["client_key"],
        )
        assert await connects(mutual)
    finally:
        server.stop()


def test_nats_credential_settings_are_checked(tmp_path: Path):
    with pytest.raises(ConfigError, match="nats_credentials: no such file"):
        load_config(env={"CACHE_ROUTER_NATS_CREDENTIALS": str(tmp_path / "none.creds")})
    with pytest.raises(ConfigError, match="go together"):
        cert = tmp_path / "c.pem"
        cert.write_text("x")
        load_config(env={"CACHE_ROUTER_NATS_TLS_CERT": str(cert)})
    creds = tmp_path / "router.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n...\n")
    cfg = load_config(
        env={
            "CACHE_ROUTER_NATS_URL": "nats://127.0.0.1:4222",
            "CACHE_ROUTER_NATS_CREDENTIALS": str(creds),
            "CACHE_ROUTER_NATS_USER": "u",
            "CACHE_ROUTER_NATS_PASSWORD": "p",
            "CACHE_ROUTER_API_KEYS": "k1, k2",
        }
    )
    assert nats_options(cfg) == {"user": "u", "password": "p", "user_credentials": str(creds)}
    assert cfg.api_keys == ["k1", "k2"]


async def test_agent_takes_the_same_nats_credentials() -> None:
    """The node agent's --nats-* flags reach nats.connect: with them its events arrive."""
    import argparse

    from agent import main as agent_main
    from agent.node import NodeAgent
    from index.codec import BlockStored
    from sim.mock.publisher import KvEventPublisher

    server = nats_process("--user", "agent", "--pass", "s3cret")
    engine = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    engine.start()
    parser = argparse.ArgumentParser()
    agent_main.add_arguments(parser)
    args = parser.parse_args(
        [
            "--worker-id",
            "w-auth",
            "--zmq-endpoint",
            engine.endpoint,
            "--replay-endpoint",
            engine.replay_endpoint or "",
            "--nats-url",
            server.url,
            "--load-interval",
            "0",
            "--nats-user",
            "agent",
            "--nats-password",
            "s3cret",
        ]
    )
    cfg = agent_main.config_from_args(args)
    cfg.events_stream = None  # this server runs without JetStream
    assert (cfg.nats_user, cfg.nats_password) == ("agent", "s3cret")
    nc = await nats.connect(server.url, user="agent", password="s3cret")
    try:
        sub = await nc.subscribe("kv.events.w-auth")
        async with NodeAgent(cfg):
            engine.publish([BlockStored([1], None, [1] * 16, 16, medium="GPU")])
            msg = await sub.next_msg(timeout=10)
            assert msg.headers is not None and msg.headers["Kv-Seq"] == "0"
    finally:
        await nc.close()
        await engine.close()
        server.stop()
