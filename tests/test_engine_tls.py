"""TLS to the engines: a mock engine serving HTTPS that demands a client certificate (as
vLLM does with ``--ssl-ca-certs --ssl-cert-reqs 2``), the router configured with
``engine_tls_ca/cert/key``: health checks and requests pass; without the router's
certificate the engine refuses the handshake and the request is answered with a clear
error, not a hang. A renewed client certificate reaches new connections."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest
import trustme
from stack import Served, until

from router.config import ConfigError, RouterConfig, WorkerSpec
from router.http.app import RouterApp
from router.http.tls import engine_tls
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.scheduler import Timing

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _pem(cert: trustme.LeafCert, tmp: Path, name: str) -> tuple[str, str]:
    chain, key = tmp / f"{name}.pem", tmp / f"{name}.key"
    cert.private_key_pem.write_to_path(str(key))
    chain.write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
    return str(chain), str(key)


@pytest.fixture
async def https_engine(tmp_path):
    ca = trustme.CA()
    certfile, keyfile = _pem(ca.issue_cert("127.0.0.1"), tmp_path, "engine")
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    engine = await MockEngine(
        MockEngineConfig(
            block_size=4,
            timing=Timing(speed=200.0),
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
            ssl_ca_certs=str(ca_file),
        )
    ).start()
    try:
        yield ca, str(ca_file), engine
    finally:
        await engine.stop()


async def _router(cfg: RouterConfig) -> tuple[RouterApp, Served]:
    app = RouterApp(cfg)
    return app, await Served(app).start()


async def test_mutual_tls_to_an_engine(https_engine, tmp_path):
    ca, ca_file, engine = https_engine
    assert engine.url.startswith("https://")
    cert, key = _pem(ca.issue_cert("cache-router"), tmp_path, "router")
    cfg = RouterConfig(
        block_size=4, health_interval=0.2, engine_tls_ca=ca_file, engine_tls_cert=cert,
        engine_tls_key=key, workers=[WorkerSpec("w0", engine.url, model="mock-model")],
    )  # fmt: skip
    app, served = await _router(cfg)
    try:
        await until(lambda: all(w.healthy for w in app.state.registry), 10, "healthy engine")
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            for stream in (False, True):
                r = await http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
                assert r.status_code == 200, r.text
                assert ("[DONE]" in r.text) if stream else r.json()["choices"]
    finally:
        await served.stop()


async def test_without_the_routers_certificate_the_engine_refuses(https_engine):
    _ca, ca_file, engine = https_engine
    cfg = RouterConfig(
        block_size=4, health_interval=0.2, engine_tls_ca=ca_file,
        workers=[WorkerSpec("w0", engine.url, model="mock-model")],
    )  # fmt: skip
    app, served = await _router(cfg)
    try:
        async with httpx.AsyncClient(base_url=served.url, timeout=15) as http:
            r = await http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code in (502, 503), r.text  # a clear error, no engine answered
        assert r.json()["error"]["message"]
        await until(lambda: not any(w.healthy for w in app.state.registry), 10, "checks fail")
    finally:
        await served.stop()


def test_a_renewed_client_certificate_is_loaded(tmp_path):
    ca = trustme.CA()
    cert, key = _pem(ca.issue_cert("cache-router"), tmp_path, "router")
    tls = engine_tls(None, cert, key)
    assert tls.context.verify_mode == ssl.CERT_REQUIRED and tls.context.check_hostname
    assert not tls.check()  # nothing changed
    _pem(ca.issue_cert("cache-router-renewed"), tmp_path, "router")
    assert tls.check() and tls.reloads == 1
    Path(key).write_text("not a key")  # a half-written renewal keeps the previous pair
    assert not tls.check() and tls.failures == 1
    assert not engine_tls(None, None, None, check_hostname=False).context.check_hostname


def test_engine_tls_settings_are_checked(tmp_path):
    from router.config.checks import validate

    with pytest.raises(ConfigError, match="engine_tls_ca: no such file"):
        validate(RouterConfig(engine_tls_ca=str(tmp_path / "missing.pem")))
    key = tmp_path / "k.pem"
    key.write_text("x")
    with pytest.raises(ConfigError, match="engine_tls_key needs engine_tls_cert"):
        validate(RouterConfig(engine_tls_key=str(key)))
