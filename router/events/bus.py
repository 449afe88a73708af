"""The router's NATS connection: connect with backoff, reconnect forever, never block routing.

nats-py reconnects and re-subscribes on its own once a first connection succeeded;
the first connection is retried here with exponential backoff, so the router can start
before NATS does. While NATS is away routing goes on (on load alone for workers whose
events it misses) and publishes are dropped and counted instead of queued unbounded.

nats-py also gives a client up for good on a server ``-ERR`` (a protocol error such as
"maximum control line exceeded": the server closes the connection). That is a lost
connection like any other, not our own close: the disconnect hooks run and a new client
connects with the same backoff, its ``on_connect`` hooks subscribing again.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import nats
from nats.aio.client import Client

log = logging.getLogger(__name__)


class NatsSettings(Protocol):
    """The connection settings the router config and the agent config both carry (read
    only: the router's config is frozen)."""

    @property
    def nats_url(self) -> str | None: ...
    @property
    def nats_user(self) -> str | None: ...
    @property
    def nats_password(self) -> str | None: ...
    @property
    def nats_token(self) -> str | None: ...
    @property
    def nats_credentials(self) -> str | None: ...
    @property
    def nats_tls_ca(self) -> str | None: ...
    @property
    def nats_tls_cert(self) -> str | None: ...
    @property
    def nats_tls_key(self) -> str | None: ...


def nats_options(cfg: NatsSettings) -> dict[str, Any]:
    """Credentials and TLS for ``nats.connect`` (nothing set: a plain connection)."""
    opts: dict[str, Any] = {}
    if cfg.nats_user is not None:
        opts["user"] = cfg.nats_user
        opts["password"] = cfg.nats_password or ""
    if cfg.nats_token is not None:
        opts["token"] = cfg.nats_token
    if cfg.nats_credentials is not None:
        opts["user_credentials"] = cfg.nats_credentials
    tls = cfg.nats_tls_ca or cfg.nats_tls_cert
    if tls or (cfg.nats_url or "").startswith("tls://"):
        ctx = ssl.create_default_context(cafile=cfg.nats_tls_ca)
        if cfg.nats_tls_cert is not None:
            ctx.load_cert_chain(cfg.nats_tls_cert, cfg.nats_tls_key)
        opts["tls"] = ctx
    return opts


Hook = Callable[[Client], Awaitable[None]]
LostHook = Callable[[], Awaitable[None]]
ErrorHook = Callable[[Exception], Awaitable[None]]


class Bus:
    def __init__(
        self,
        url: str,
        *,
        name: str = "cache-router",
        max_backoff: float = 5.0,
        options: Mapping[str, Any] | None = None,  # credentials and TLS for nats.connect
    ) -> None:
        self.url = url
        self.options = dict(options or {})
        self.name = name
        self.max_backoff = max_backoff
        self.nc: Client | None = None
        self.dropped_publishes = 0
        self.reconnects = 0
        self._on_connect: list[Hook] = []  # run on every new client (subscribe there)
        self._on_reconnect: list[Hook] = []  # run after the client reconnected by itself
        self._on_disconnect: list[LostHook] = []  # run when the connection drops
        self._on_error: list[ErrorHook] = []  # run on every async error the client reports
        self._task: asyncio.Task[None] | None = None
        self._closing = False  # close() called: a closed client is no loss

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def on_connect(self, hook: Hook) -> None:
        self._on_connect.append(hook)

    def on_reconnect(self, hook: Hook) -> None:
        self._on_reconnect.append(hook)

    def on_disconnect(self, hook: LostHook) -> None:
        self._on_disconnect.append(hook)

    def on_error(self, hook: ErrorHook) -> None:
        """E.g. a slow-consumer drop: the client lost a message it had no room for."""
        self._on_error.append(hook)

    def start(self) -> None:
        self._task = asyncio.create_task(self._connect_loop(), name="nats-connect")

    async def _connect_loop(self) -> None:
        delay = 0.05
        while not self._closing:
            try:
                nc = await nats.connect(
                    self.url,
                    name=self.name,
                    connect_timeout=2,
                    reconnect_time_wait=0.25,
                    max_reconnect_attempts=-1,
                    allow_reconnect=True,
                    reconnected_cb=self._reconnected,
                    disconnected_cb=self._disconnected,
                    closed_cb=self._closed,
                    error_cb=self._error,
                    **self.options,
                )
            except Exception as exc:  # nats-py raises several types when no server answers
                log.warning("NATS %s unreachable (%s); retrying in %.2fs", self.url, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
                continue
            if self.nc is not None:  # a client given up on before: this is a reconnection
                self.reconnects += 1
            self.nc = nc
            log.info("connected to NATS %s", self.url)
            for hook in self._on_connect:
                await hook(nc)
            return

    async def _reconnected(self) -> None:
        self.reconnects += 1
        log.info("reconnected to NATS %s", self.url)
        if self.nc is not None:
            for hook in self._on_reconnect:
                await hook(self.nc)

    async def _disconnected(self) -> None:
        if self._closing:
            return  # our own close, not a lost server
        log.warning("disconnected from NATS %s; routing on what is known", self.url)
        for hook in self._on_disconnect:
            await hook()

    async def _closed(self) -> None:
        if self._closing or (self._task is not None and not self._task.done()):
            return
        err = self.nc.last_error if self.nc is not None else None
        log.warning("NATS client closed by the server (%s); connecting a new one", err)
        self._task = asyncio.create_task(self._connect_loop(), name="nats-connect")

    async def _error(self, exc: Exception) -> None:
        log.debug("NATS error: %s", exc)
        for hook in self._on_error:
            await hook(exc)

    async def publish(self, subject: str, data: bytes) -> bool:
        """Publish if connected; otherwise drop and count (a stale hint is worse than none)."""
        if not self.connected:
            self.dropped_publishes += 1
            return False
        assert self.nc is not None
        await self.nc.publish(subject, data)
        return True

    async def close(self) -> None:
        self._closing = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=2)
            except Exception:  # closing anyway
                await self.nc.close()


async def subscriptions_in_place(nc: Client, timeout: float = 10.0) -> None:
    """Every subscription made on ``nc`` so far is in place on the server (bounded).

    nats-py 2.16's ``flush()`` writes its PING ahead of the commands still queued, so a
    SUB it "flushed" can reach the server after another client's next publish (a probe lost
    that first message 19 times in 300 under load). The server takes one client's commands
    in order: the echo of a message published after the SUBs proves them."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(inbox, b"")
        await sub.next_msg(timeout=timeout)
    finally:
        await sub.unsubscribe()
