"""TLS on the listener (router/http/tls.py): a certificate renewed in place is served to new
connections without a restart; a broken renewal keeps the old one; mutual TLS."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest
import trustme
import uvicorn
from stack import until

from router.http.tls import ReloadingTls


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def write(cert: trustme.LeafCert, tmp: Path) -> tuple[str, str]:
    crt, key = tmp / "tls.crt", tmp / "tls.key"
    # as a renewal lands: a new file moved over the old one
    for path, blob in ((crt, cert.cert_chain_pems[0]), (key, cert.private_key_pem)):
        staged = path.with_suffix(".new")
        blob.write_to_path(str(staged))
        staged.replace(path)
    return str(crt), str(key)


class Listener:
    def __init__(self, tls: ReloadingTls) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off",
            ssl_context_factory=tls.factory,
        )  # fmt: skip
        self.server = uvicorn.Server(config)

    async def __aenter__(self) -> Listener:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        await self.task


async def serial(port: int, ca: trustme.CA, client: trustme.LeafCert | None = None) -> int:
    """The serial number of the certificate a new connection is served."""
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    if client is not None:
        client.configure_cert(ctx)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    try:
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        cert = writer.get_extra_info("peercert")
        return int(cert["serialNumber"], 16)
    finally:
        writer.close()


def serial_of(cert: trustme.LeafCert) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert.cert_chain_pems[0].bytes()).serial_number


async def test_a_renewed_certificate_reaches_new_connections(tmp_path):
    ca = trustme.CA()
    first, second = ca.issue_cert("127.0.0.1"), ca.issue_cert("127.0.0.1")
    tls = ReloadingTls(*write(first, tmp_path), interval=0.05)
    async with Listener(tls) as listener:
        assert await serial(listener.port, ca) == serial_of(first)
        write(second, tmp_path)
        await until(lambda: tls.reloads == 1, what="the renewal loaded")
        assert await serial(listener.port, ca) == serial_of(second)
        # a renewal whose key does not match its certificate: the last good pair serves
        (tmp_path / "tls.crt").write_bytes(ca.issue_cert("127.0.0.1").cert_chain_pems[0].bytes())
        await until(lambda: tls.failures == 1, what="the broken pair refused")
        assert await serial(listener.port, ca) == serial_of(second)


async def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path):
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    tls = ReloadingTls(*write(ca.issue_cert("127.0.0.1"), tmp_path), str(tmp_path / "ca.pem"))
    async with Listener(tls) as listener:
        assert await serial(listener.port, ca, ca.issue_cert("client@example.com")) > 0
        with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
            await serial(listener.port, ca)


def test_the_flags_make_the_listener_https(tmp_path):
    import argparse

    from router.config import ConfigError
    from router.http import serve

    ca = trustme.CA()
    crt, key = write(ca.issue_cert("127.0.0.1"), tmp_path)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--tls-cert", crt, "--tls-key", key])
    cfg = serve.config_from_args(args, env={})
    assert (cfg.tls_cert, cfg.tls_key) == (crt, key)
    config = serve.server_config(app, cfg)
    assert config.is_ssl and config.ssl_context_factory is not None
    with pytest.raises(ConfigError, match="tls_key and tls_client_ca need tls_cert"):
        serve.config_from_args(parser.parse_args(["--tls-key", key]), env={})
    with pytest.raises(ConfigError, match="no such file"):
        serve.config_from_args(parser.parse_args(["--tls-cert", str(tmp_path / "no")]), env={})
