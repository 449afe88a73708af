"""A client connection's writes of one loop iteration leave as one, in order; ``close``
sends what is held, ``abort`` drops it. Real TCP connections on loopback; the transport
under the wrapper is the loop's own, with its ``write`` calls counted."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import uvicorn
from stack import EngineDouble, until

from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp
from router.http.coalesce import CoalescingTransport
from router.http.serve import server_config


class Counted:
    """The loop's transport, with the writes it was given recorded."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def _pair() -> tuple[asyncio.StreamReader, Counted, CoalescingTransport, asyncio.Server]:
    accepted: asyncio.Queue[asyncio.StreamReader] = asyncio.Queue()

    async def on_client(reader: asyncio.StreamReader, _w: asyncio.StreamWriter) -> None:
        await accepted.put(reader)

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    counted = Counted(transport)  # type: ignore[arg-type]
    wrapped = CoalescingTransport(counted, loop)  # type: ignore[arg-type]
    peer = await asyncio.wait_for(accepted.get(), 5)
    return peer, counted, wrapped, server


async def test_writes_of_one_iteration_leave_as_one_in_order():
    peer, counted, wrapped, server = await _pair()
    try:
        wrapped.write(b"HTTP/1.1 200 OK\r\n\r\n")
        wrapped.write(b"body")
        assert counted.writes == []  # held until the iteration ends
        await asyncio.sleep(0)
        assert counted.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        wrapped.write(b"-next")
        await asyncio.sleep(0)
        assert counted.writes[1:] == [b"-next"]
        got = await asyncio.wait_for(peer.readexactly(len(b"HTTP/1.1 200 OK\r\n\r\nbody-next")), 5)
        assert got == b"HTTP/1.1 200 OK\r\n\r\nbody-next"
    finally:
        wrapped.abort()
        server.close()


async def test_close_sends_what_is_held_and_abort_drops_it():
    peer, _counted, wrapped, server = await _pair()
    try:
        wrapped.write(b"last words")
        wrapped.close()
        assert await asyncio.wait_for(peer.read(), 5) == b"last words"  # then EOF
        peer2, counted2, wrapped2, server2 = await _pair()
        try:
            wrapped2.write(b"never sent")
            wrapped2.abort()
            await asyncio.sleep(0)
            assert counted2.writes == []
            assert await asyncio.wait_for(peer2.read(), 5) == b""
        finally:
            server2.close()
    finally:
        server.close()


async def test_a_routed_answer_leaves_the_router_in_one_write():
    """Under the router's own uvicorn settings (router.http.serve): the second request on a
    keep-alive connection is answered, status line to last body byte, by one write."""
    engine = await EngineDouble("w0").start()
    try:
        cfg = RouterConfig(workers=[WorkerSpec("w0", engine.url)])
        app = RouterApp(cfg)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = server_config(app, cfg, host="127.0.0.1", port=sock.getsockname()[1])
        config.setup_event_loop = lambda: None  # type: ignore[method-assign]
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            await until(lambda: server.started, what="the router listening")
            url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            async with httpx.AsyncClient(timeout=10) as client:
                assert (await client.post(url, json=body)).status_code == 200
                (conn,) = server.server_state.connections
                assert isinstance(conn.transport, CoalescingTransport)
                counted = Counted(conn.transport.transport)
                conn.transport.transport = counted  # type: ignore[assignment]
                r = await client.post(url, json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-cache-router-worker"] == "w0"
            assert len(counted.writes) == 1
            (wire,) = counted.writes
            assert wire.startswith(b"HTTP/1.1 200 OK\r\n")
            assert wire.endswith(r.content)
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)
    finally:
        await engine.stop()
