"""The hot path's HTTP/1.1 client: keep-alive connections to the engines, httptools parsing.

Why not httpx here: in ``bench/proxy.py`` the shared ``httpx.AsyncClient`` alone cost
about 2.5 ms of CPU per proxied request at 32 concurrent requests (anyio layers, a
connection pool that rescans every connection per request), 15x SGLang's whole Rust
router. A raw asyncio protocol per connection with the C ``httptools`` parser (the one
uvicorn uses) costs a small fraction of that. Health checks and load scrapes use it too
(``router.workers.registry``); httpx still serves the engines' model lists (``/v1/models``).

Semantics the proxy relies on:

- ``ConnectFailed``: nothing was sent (refused, unreachable, connect timeout), so the
  request may go to another engine;
- any other ``UpstreamError``: the request may have reached the engine: never retried;
- body chunks come as the engine sends them (chunked transfer de-chunked, content
  encoding untouched); reading pauses while the consumer is behind (back pressure);
- ``close()`` before the end aborts the connection, so the engine sees the client leave;
- an idle connection is reused only within ``keepalive_idle`` seconds (below the 5 s
  after which uvicorn, and so vLLM and SGLang, close idle connections): a request
  written on a connection the engine is closing at that moment would fail after
  it may have been sent, and so could not be retried;
- that race still happens when the engine's clock jumps (a SIGSTOPped engine runs its
  overdue keep-alive timers first when it resumes and closes the connection under the
  waiting request, which the kernel answers with a reset because the request is still
  unread in its buffer). A reset before one byte of the response means exactly that:
  the engine never read the request. On a reused connection it is sent once more on a
  new one; on a new connection (the engine was killed with the request queued) it is a
  ``ConnectFailed``: the proxy tries the next worker. An EOF is never retried: an engine
  killed after reading a request ends the connection with one too;
- ``stalled(url)``: the health checker gave the engine up while requests wait on it;
  if the engine sent no byte on any connection for ``stall_after`` seconds (a hung
  process, not a slow one: a busy engine streams to somebody) they fail now with
  ``UpstreamStalled`` instead of after ``request_timeout``, and their connections are
  closed (the engine aborts them when it wakes): one waiting for its response headers
  (the proxy sends it to another engine: nothing reached the client) and one in the
  middle of its body (a stream the proxy continues elsewhere, ``router.forward.migrate``).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 256 * 1024  # buffered body bytes before reading from the engine pauses


class UpstreamError(Exception):
    """The exchange with the engine failed after the request may have reached it."""


class ConnectFailed(UpstreamError):
    """No connection to the engine: the request was not sent."""


class UpstreamTimeout(UpstreamError):
    """The engine sent nothing for ``timeout`` seconds."""


class UpstreamStalled(UpstreamTimeout):
    """The engine is down by its health checks and silent on every connection."""


class _Unread(ConnectFailed):
    """The engine closed the connection with the request unread: nothing ran."""


class Origin:
    """Scheme, host and port of one engine, with its idle keep-alive connections."""

    __slots__ = ("busy", "heard", "host", "host_header", "idle", "max_idle", "port", "ssl")

    def __init__(self, url: str, max_idle: int = 512, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: the context for an ``https`` origin (the system's CAs without it)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url}")
        https = parts.scheme == "https"
        self.ssl = (tls or ssl.create_default_context()) if https else None
        self.host = parts.hostname
        self.port = parts.port or (443 if self.ssl else 80)
        self.host_header = parts.netloc.encode()
        self.idle: list[_Connection] = []
        self.busy: set[_Connection] = set()  # carrying a request
        self.heard = time.monotonic()  # last byte from the engine on any connection
        self.max_idle = max_idle


class Response:
    """One engine response: status and headers first, then the body as it arrives."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_error",
        "_headers_done",
        "_size",
        "_wake",
        "complete",
        "headers",
        "status",
        "written_ns",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.written_ns = 0  # when the request was on the wire (epoch ns), for traces
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._error: Exception | None = None
        self._headers_done = False
        self._wake: asyncio.Future[None] | None = None

    @property
    def drained(self) -> bool:
        """The engine sent everything and every chunk was handed out."""
        return self.complete and not self._chunks

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    async def _wait(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake = loop.create_future()
        timer = loop.call_later(timeout, _expire, wake)
        try:
            await wake
        finally:
            timer.cancel()
            self._wake = None

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def chunks(self, timeout: float) -> AsyncIterator[bytes]:
        """The body, chunk by chunk; ``UpstreamError`` if the engine breaks it off."""
        conn = self._conn
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._size -= len(chunk)
                if conn.paused and self._size < _HIGH_WATER // 2:
                    conn.resume()
                yield chunk
            if self.complete:
                conn.release(self)
                return
            if self._error is not None:
                raise self._error
            await self._wait(timeout)

    async def settle(self, timeout: float) -> None:
        """Wait (each wait within ``timeout``) until the engine sent the whole body, which
        stays to be read by ``chunks``; ``UpstreamError`` if it breaks first. Reading is
        not paused meanwhile: a whole answer is held to be sent again elsewhere if its
        engine breaks before its end (``router.forward.migrate``)."""
        while not self.complete:
            self._conn.resume()
            if self._error is not None:
                raise self._error
            await self._wait(timeout)

    async def read(self, timeout: float, limit: int, what: str) -> bytes:
        """The whole body, each wait within ``timeout``; ``UpstreamError`` past ``limit``
        bytes (``what`` names the answer in it)."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in self.chunks(timeout):
            size += len(chunk)
            if size > limit:
                raise UpstreamError(f"{what} over {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        """Give up on the rest: the connection cannot carry another request."""
        if not self.complete:
            self._conn.abort()


def _expire(wake: asyncio.Future[None]) -> None:
    if not wake.done():
        wake.set_exception(UpstreamTimeout("the engine sent nothing in time"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.paused = False
        self.keep_alive = False
        self.idle_since = 0.0
        self.reused = False  # carried a request before the current one
        self.got_bytes = False  # of the current response

    # -- asyncio.Protocol --------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.origin.heard = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"bad response from the engine: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self in self.origin.idle:
            self.origin.idle.remove(self)
        self.origin.busy.discard(self)
        # Before any response byte, a reset means the engine closed with our request still
        # in its socket buffer (a full read leaves nothing to reset): it never ran. A plain
        # EOF is not that: an engine killed after reading the request ends with one too.
        unread = not self.got_bytes and isinstance(exc, ConnectionResetError)
        kind = _Unread if unread else UpstreamError
        self._fail(kind(f"the engine closed the connection ({exc or 'EOF'})"))

    # -- httptools callbacks -----------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.response
        if resp is not None:
            resp.status = self.parser.get_status_code()
            # llhttp only answers this before the message completes
            self.keep_alive = self.parser.should_keep_alive()
            resp._headers_done = True
            resp._notify()

    def on_body(self, body: bytes) -> None:
        resp = self.response
        if resp is not None:
            resp._chunks.append(body)
            resp._size += len(body)
            if resp._size > _HIGH_WATER and not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()
            resp._notify()

    def on_message_complete(self) -> None:
        resp = self.response
        if resp is not None:
            resp.complete = True
            resp._notify()

    # -- use ---------------------------------------------------------------------
    def _fail(self, exc: Exception) -> None:
        resp = self.response
        if resp is not None and not resp.complete and resp._error is None:
            resp._error = exc
            resp._notify()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        self.closed = True
        self.origin.busy.discard(self)
        if self.transport is not None:
            self.transport.abort()

    def release(self, resp: Response) -> None:
        """Back to the idle list once ``resp`` is fully read (if the engine keeps it open)."""
        if self.response is resp:
            self.response = None
            self.origin.busy.discard(self)
            idle = self.origin.idle
            reusable = not self.closed and self.keep_alive
            if reusable and len(idle) < self.origin.max_idle:
                self.idle_since = time.monotonic()
                idle.append(self)
            else:
                self.abort()


class Upstream:
    """Keep-alive connections per engine origin; ``send`` one request, stream the answer."""

    def __init__(
        self, connect_timeout: float = 2.0, max_idle: int = 512, keepalive_idle: float = 4.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        """``tls``: the context ``https`` engines are reached with (``engine_tls``)."""
        self.connect_timeout = connect_timeout
        self.tls = tls
        self.max_idle = max_idle
        self.keepalive_idle = keepalive_idle
        self._origins: dict[str, Origin] = {}

    def origin(self, base_url: str) -> Origin:
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = Origin(base_url, self.max_idle, self.tls)
        return origin

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(origin), origin.host, origin.port, ssl=origin.ssl
                ),
                self.connect_timeout,
            )
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        return conn

    async def send(
        self,
        base_url: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeout: float,
        method: bytes = b"POST",
    ) -> Response:
        """Send ``body`` (a POST unless ``method`` says otherwise) and wait for the
        response headers (not the body)."""
        origin = self.origin(base_url)
        conn = self._reuse(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, path, headers, body, timeout, method)
            except _Unread:
                pass  # the engine closed it unread: nothing ran, a new connection may
        conn = await self._connect(origin)
        return await self._exchange(conn, path, headers, body, timeout, method)

    def _reuse(self, origin: Origin) -> _Connection | None:
        conn = None
        idle = origin.idle
        while idle:
            candidate = idle.pop()
            if candidate.closed:
                continue
            if time.monotonic() - candidate.idle_since > self.keepalive_idle:
                # the newest idle one is too old, so are all below it (a LIFO list)
                candidate.abort()
                for old in idle:
                    old.abort()
                idle.clear()
                break
            conn = candidate
            conn.reused = True
            break
        return conn

    async def _exchange(
        self,
        conn: _Connection,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeout: float,
        method: bytes,
    ) -> Response:
        origin = conn.origin
        resp = conn.response = Response(conn)
        conn.got_bytes = False
        origin.busy.add(conn)
        head = [method, b" ", path.encode(), b" HTTP/1.1\r\nhost: ", origin.host_header]
        head.append(b"\r\ncontent-length: %d\r\n" % len(body))
        for key, value in headers:
            head += (key, b": ", value, b"\r\n")
        head.append(b"\r\n")
        assert conn.transport is not None
        conn.transport.write(b"".join(head) + body)
        resp.written_ns = time.time_ns()
        try:
            while not resp._headers_done:
                if resp._error is not None:
                    raise resp._error
                await resp._wait(timeout)
        except BaseException:
            conn.abort()
            raise
        return resp

    def stalled(self, base_url: str, stall_after: float) -> int:
        """Fail the requests waiting on ``base_url`` (for their headers or the rest of
        their body) if it has been silent ``stall_after`` seconds (see the module
        docstring); how many failed."""
        origin = self._origins.get(base_url)
        if origin is None or time.monotonic() - origin.heard < stall_after:
            return 0
        failed = 0
        for conn in list(origin.busy):
            resp = conn.response
            if resp is not None and not resp.complete:
                conn._fail(UpstreamStalled("the engine stopped answering (health checks fail)"))
                conn.abort()
                failed += 1
        return failed

    def close(self) -> None:
        for origin in self._origins.values():
            for conn in origin.idle:
                conn.abort()
            origin.idle.clear()
