"""The connection guard: uvicorn's httptools protocol with limits a hostile client meets.

uvicorn (0.54) reads whatever a client sends: an unterminated 100 MB header is
buffered by the parser before any limit can look at it (three such connections took
the router from 136 to 428 MiB), a connection that sends nothing or its headers a byte
at a time stays open for ever, and 260 of them exhaust 256 file descriptors so that
no legitimate client gets in. Its own knobs cover only part of that
(``timeout_keep_alive`` only runs between requests; ``limit_concurrency`` answers 503
but keeps the connection and its descriptor). So the protocol class itself enforces:

- ``max_head_bytes``: request line and headers together, counted as they arrive; over
  it the client gets ``431`` and the connection is closed (no more is read);
- ``header_timeout``: from the connection's start, or the first byte of each later
  request, to the end of its headers; then ``408`` and close;
- ``max_connections``: at the cap a new connection pushes out the oldest one that has
  no request running (idle keep-alive, or still sending its headers: what slowloris
  holds); when every connection is busy the new one gets ``503`` and is closed.
- ``Upgrade`` requests (websocket, h2c) are answered ``400`` and closed: the router
  speaks HTTP/1.1 only, and a request the parser treats as upgraded never gets its body.

Requests that arrive whole in one read (nearly all) pay for none of it: the timer is
armed only when a read ends inside a request head. Idle time between requests is
uvicorn's ``timeout_keep_alive`` (the ``idle_timeout`` setting); the body's own timeout
is the proxy's ``body_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.http.coalesce import CoalescingTransport
from router.http.errors import error_body
from router.observe.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
_refusals = RateLimitedLog(log, interval=10.0)

_REASON = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
           503: b"Service Unavailable"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Limits:
    max_head_bytes: int = 40 * 1024
    header_timeout: float = 10.0
    max_connections: int = 1024


def default_max_connections(reserve: int = 64) -> int:
    """Client connections that leave descriptors for as many engine connections (one per
    proxied request) plus ``reserve`` for NATS, health checks and files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(8, min(65536, (soft - reserve) // 2))


def guarded_protocol(limits: Limits) -> type[HttpToolsProtocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``."""
    return type("GuardedHttpTools", (GuardedHttpTools,), {"limits": limits})


class GuardedHttpTools(HttpToolsProtocol):
    limits = Limits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False  # between a request's first byte and the end of its headers
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._since = time.monotonic()  # connected, or last response done: eviction order
        self._draining = False  # the server is stopping: serve what comes, then close

    # -- connection ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # every write of one iteration in one syscall (router.http.coalesce); reading and flow
        # control stay on the transport itself
        self.transport = CoalescingTransport(transport, self.loop)  # type: ignore[assignment]
        if len(self.connections) > self.limits.max_connections and not self._evict_one():
            _refusals.warning("connection refused: %d connections open", len(self.connections))
            self._refuse(503, "too many connections", "too_many_connections")
            return
        self._arm()  # a connection that never sends a request is closed too

    def _evict_one(self) -> bool:
        """Close the oldest connection with no request running; False if there is none."""
        oldest: GuardedHttpTools | None = None
        for conn in self.connections:
            if conn is self or not isinstance(conn, GuardedHttpTools) or not conn._idle():
                continue
            if oldest is None or conn._since < oldest._since:
                oldest = conn
        if oldest is None:
            return False
        oldest._close()
        return True

    def shutdown(self) -> None:
        """Graceful stop (SIGTERM): uvicorn closes idle connections at once, and a busy one
        the moment its response ends, even when that response's headers promised
        keep-alive. Either cuts a request a client already sent on the connection it holds
        as idle: it reads EOF, and cannot tell that nothing ran (the fault run lost 2-3 per
        router SIGTERM that way). So an idle connection, or one whose response already
        promised keep-alive, stays open until its keep-alive (or header) timer ends it,
        and the next request on it is served with ``connection: close``. A response not
        started yet says ``connection: close`` itself (uvicorn's way). New connections are
        refused already: the listening socket closed first."""
        cycle = self.cycle
        promised = cycle is not None and cycle.response_started and cycle.keep_alive
        if (self._idle() or (promised and not self.pipeline)) and not self.transport.is_closing():
            self._draining = True
            return
        super().shutdown()

    def _idle(self) -> bool:
        cycle = self.cycle
        return (cycle is None or cycle.response_complete) and not self.pipeline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # -- reading -------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._in_head or self.transport.is_closing():
            return
        # the read ended inside a request head: count it, and give it a deadline
        self._head_bytes += len(data)
        if self._head_bytes > self.limits.max_head_bytes:
            _refusals.warning("request head over %d bytes: closed", self.limits.max_head_bytes)
            self._refuse(
                431,
                f"request line and headers over {self.limits.max_head_bytes} bytes",
                "headers_too_large",
            )
        elif self._head_timer is None:
            self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        if self.transport.is_closing():
            return  # refused: the rest of what was read is not a request
        if self.parser.should_upgrade():
            # uvicorn would run it as plain HTTP and then stop parsing: its body never comes
            self._refuse(400, "protocol upgrades (websocket, h2c) are not supported", "upgrade")
            return
        super().on_headers_complete()
        if self._draining and self.cycle is not None:
            self.cycle.keep_alive = False  # the last request on a connection being drained

    def _unsupported_upgrade_warning(self) -> None:
        pass  # refused in on_headers_complete; uvicorn would log two lines per request

    def on_body(self, body: bytes) -> None:
        if self.cycle is not None and not self.transport.is_closing():
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.cycle is not None and not self.transport.is_closing():
            super().on_message_complete()

    def on_response_complete(self) -> None:
        self._since = time.monotonic()
        super().on_response_complete()

    # -- timers and refusals -----------------------------------------------------------
    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_expired)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._idle():
            return
        timeout = self.limits.header_timeout
        self._refuse(408, f"request headers not received within {timeout:g} s", "header_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` (unless a response is under way) and close the connection."""
        self._disarm()
        if self._idle() and not self.transport.is_closing():
            body = error_body(status, message, code)
            head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n" % (
                status,
                _REASON[status],
            )
            head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            self.transport.write(head + body)
        self._close()

    def _close(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()
