"""Hung and half-closing engines: what the client sees when an engine stops answering.

Issue 10: with an engine SIGSTOPped for 20 s, three requests waited the whole 20 s and
then got ``502 connection reset by peer`` although the engine never read them (it
resumed by running its overdue keep-alive timers, which closed the pooled connections
the requests had been written on).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import struct
import subprocess
import sys
import time

import httpx
import pytest
from stack import Served, until

from router.config import RouterConfig, WorkerSpec
from router.forward.upstream import ConnectFailed, Upstream, UpstreamError
from router.http.app import RouterApp
from sim.demo import wait_healthy
from sim.mock.natsd import free_port

RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok"


def half_closing_engine(listener: socket.socket, served: list[bytes], n: int) -> None:
    """Answers the first request on each connection; when the next one arrives it resets
    the connection with that request unread (what an engine's overdue keep-alive timer
    does: the kernel resets a socket closed with data queued)."""
    listener.settimeout(5)
    for _ in range(n):
        conn, _ = listener.accept()
        served.append(conn.recv(65536))  # the whole (small) request
        conn.sendall(RESPONSE)
        conn.recv(65536, socket.MSG_PEEK)  # the next request arrived, never read
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()


async def test_a_pooled_connection_reset_unread_is_retried_on_a_new_one() -> None:
    served: list[bytes] = []
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    engine = asyncio.get_running_loop().run_in_executor(
        None, half_closing_engine, listener, served, 4
    )
    upstream = Upstream(keepalive_idle=30)
    try:
        for i in range(4):
            resp = await upstream.send(url, "/v1/completions", [], b'{"i": %d}' % i, 5)
            assert resp.status == 200
            assert b"".join([c async for c in resp.chunks(5)]) == b"ok"
        # each request after the first met a pooled connection reset unread, and went once
        # more on a new connection: every one reached the engine exactly once
        assert [s.endswith(b'{"i": %d}' % i) for i, s in enumerate(served)] == [True] * 4
    finally:
        upstream.close()
        with contextlib.suppress(Exception):  # its accept times out if a request went missing
            await asyncio.wait_for(engine, 10)
        listener.close()


async def test_a_connection_closed_before_an_answer_is_not_retried() -> None:
    """An EOF says nothing about whether the engine read the request (one killed after
    reading ends the same way): it must not run twice."""
    reads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reads.append(await reader.read(65536))
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    upstream = Upstream()
    try:
        with pytest.raises(UpstreamError, match="closed"):
            await upstream.send(url, "/v1/completions", [], b"{}", 5)
        assert len(reads) == 1
    finally:
        upstream.close()
        server.close()


class MockEngine:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "mock-engine", "--port", str(self.port),
             "--worker-id", worker_id, "--model", "mock-model", "--speed", "200",
             "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


async def test_requests_on_a_sigstopped_engine_fail_fast_or_go_elsewhere() -> None:
    engines = [MockEngine("w0"), MockEngine("w1")]
    served = None
    try:
        for e in engines:
            await wait_healthy(e.url, e.proc)
        cfg = RouterConfig(
            workers=[WorkerSpec(e.worker_id, e.url, model="mock-model") for e in engines],
            policy="round_robin",
            health_interval=0.2,
            health_timeout=0.3,
            stall_after=1.0,
        )
        app = RouterApp(cfg)
        served = await Served(app).start()
        body = {"model": "mock-model", "prompt": "hello there", "max_tokens": 4}
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
            for _ in range(4):  # pooled connections to both engines
                assert (await http.post("/v1/completions", json=body)).status_code == 200
            engines[0].proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()

            async def one() -> tuple[int, str, float]:
                r = await http.post("/v1/completions", json=body)
                code = r.json()["error"]["code"] if r.status_code != 200 else ""
                return r.status_code, code, time.monotonic() - t0

            results = await asyncio.gather(*(one() for _ in range(6)))
            w0 = app.state.registry.get("w0")
            await until(lambda: not w0.healthy, what="w0 down")
            later = [await one() for _ in range(4)]  # while it is still stopped
            engines[0].proc.send_signal(signal.SIGCONT)
            await until(lambda: w0.healthy, timeout=10, what="w0 back")
            after = [await one() for _ in range(4)]
        for status, _code, took in results:
            # w1's share is served; w0's is failed there within seconds (stall_after) and
            # sent to w1 (issue 32; before, a 504 upstream_timeout)
            assert status == 200, results
            assert took < 8, results
        assert [s for s, _, _ in later] == [200] * 4
        assert [s for s, _, _ in after] == [200] * 4
    finally:
        if served is not None:
            await served.stop()
        for e in engines:
            e.stop()


async def test_a_reset_before_any_answer_is_a_connect_failure() -> None:
    """An engine killed with the request still in its socket buffer resets the connection:
    it never read the request, so the proxy may send it to another worker."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def reset_one() -> bytes:
        conn, _ = listener.accept()
        peeked = conn.recv(65536, socket.MSG_PEEK)  # arrived, never read by the "engine"
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # linger 0: a reset, as the kernel sends for a killed process's queue
        return peeked

    upstream = Upstream()
    try:
        peek = asyncio.get_running_loop().run_in_executor(None, reset_one)
        with pytest.raises(ConnectFailed):
            await upstream.send(f"http://127.0.0.1:{port}", "/v1/completions", [], b"{}", 5)
        assert (await peek).startswith(b"POST /v1/completions")
    finally:
        upstream.close()
        listener.close()
