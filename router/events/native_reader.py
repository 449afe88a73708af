"""Live KV events read off the event loop: the compiled core's own core-NATS subscriber.

Why: with nats-py the event loop itself reads and parses every event message (py-spy of
``bench/scale.py --only nats``, session 7: ~16 % + ~12 % of the router's samples), so at
128K blocks/s requests waited behind socket reads of batches and the router fell behind
(31-66K blocks/s applied). ``index._native.EventReader`` reads its own socket on its own
thread with no GIL, frames MSG/HMSG, answers PINGs, and applies a routed worker's plain
in-order live batches itself (the code ``Core.ingest_many`` runs, under the core's
mutex: a match never sees half a batch). ``bench/scale.py --only nats`` (16 workers,
load 1.6-3.1): at 512K blocks/s it applied 504K blocks/s while publishing against
nats-py's 254K, 98.7-99.6 % of the batches on its own thread, and the request p50
under events fell from 70-102 us to 46-76 us (BENCHMARKS.md, "native event reader").

Everything else comes to ``EventSync.take`` as the message, in arrival order, through a
bounded queue and a pipe the loop watches: no route yet, a gap, another epoch, an
unreadable header or payload, a batch Python must decode. A worker is routed once
Python applied one of its live batches in order (``EventSync._applied``) and unrouted
when a resync starts, so holds, replays and counts stay EventSync's. A message the queue
has no room for (or one over ``MAX_PAYLOAD``) is dropped and its worker marked out of
sync and resynced (``lost_native_dropped``); a lost
connection, a server ``-ERR`` or a missing PONG marks every worker out of sync at once
and resyncs them when the reader is subscribed again. ``lag()`` adds the queue's length
and its oldest message's age to the ingest thread's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NamedTuple, Protocol
from urllib.parse import unquote, urlsplit

from index import _native
from index.ingest import EventIngest
from index.native_ingest import NativeEventIngest, Outcome
from router.config import RouterConfig
from router.observe.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
failures = RateLimitedLog(log)  # a server that stays away: a line per 10 s at most

POLL_BATCH = 64  # records handled per loop callback: requests run between two batches
# Batches the reader applied itself wake nobody; their counts (ingest.batches_applied,
# counts["native_applied"]) are collected every COUNT_INTERVAL while batches arrive, and
# the wait doubles up to COUNT_IDLE while none do: a tick every 20 ms was most of an idle
# router's CPU (9 ms a second, session 17); readers that show the counts collect first
# (``collect``), so an idle router's counts are not stale where they are read.
COUNT_INTERVAL = 0.02
COUNT_IDLE = 0.5
MAX_QUEUED = 100_000  # messages waiting for Python
MAX_QUEUED_BYTES = 256 << 20
MAX_PAYLOAD = 64 << 20  # over nats-server's own max_payload ceiling (64 MB)
MAX_CONTROL = 4096  # nats-server's default max_control_line


class NativeMsg(NamedTuple):
    """What ``EventSync.take`` reads of a nats-py ``Msg``."""

    subject: str
    headers: dict[str, str] | None
    data: bytes


def servers_and_auth(cfg: RouterConfig) -> tuple[list[tuple[str, int]], str, str, str]:
    """(host, port) of each server in ``nats_url``, and the user, password and token:
    the config's, else a URL's ``user:pass@`` or ``token@`` (as nats-py reads them)."""
    servers: list[tuple[str, int]] = []
    user, password, token = cfg.nats_user or "", cfg.nats_password or "", cfg.nats_token or ""
    for url in (cfg.nats_url or "").split(","):
        parts = urlsplit(url.strip() if "//" in url else f"nats://{url.strip()}")
        if not parts.hostname:
            raise ValueError(f"nats_url {url!r}: no host")
        servers.append((parts.hostname, parts.port or 4222))
        if parts.username and not (user or token):
            if parts.password is not None:
                user, password = unquote(parts.username), unquote(parts.password)
            else:
                token = unquote(parts.username)
    return servers, user, password, token


class EventSink(Protocol):
    """Where the reader hands what Python must see (``router.events.consumer.EventSync``):
    messages in arrival order, the counts of batches it applied, and losses."""

    def take(self, msg: NativeMsg) -> None: ...
    def native_noted(
        self, worker_id: str, seq: int, payload: bytes, rank: int | None, epoch: str | None,
        out: Outcome,
    ) -> None: ...  # fmt: skip
    def native_applied(self, worker_id: str, batches: int, events: int) -> None: ...
    def lost(self, worker_id: str, why: str, *, resync: bool = True) -> None: ...
    def lost_all(self, why: str, *, resync: bool = True) -> None: ...


class _Route(NamedTuple):
    ingest: NativeEventIngest
    core: _native.Core
    slot: int
    rank: int | None
    quota: int


class NativeEvents:
    """The reader, its wake-up on the loop, and the routes it applies batches for."""

    def __init__(
        self,
        cfg: RouterConfig,
        events: EventSink,
        *,
        on_up: Callable[[], None],
        on_lost: Callable[[str], None],
    ) -> None:
        servers, user, password, token = servers_and_auth(cfg)
        prefix = f"{cfg.subject_prefix}.events."
        self.reader = _native.EventReader(
            servers,
            f"{prefix}>",
            prefix,
            user,
            password,
            token,
            "cache-router-events",
            connect_timeout=2.0,
            ping_interval=2.0,
            max_control=MAX_CONTROL,
            max_payload=MAX_PAYLOAD,
            max_queued=MAX_QUEUED,
            max_queued_bytes=MAX_QUEUED_BYTES,
        )
        self.events = events
        self._on_up = on_up
        self._on_lost = on_lost
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._tick: asyncio.TimerHandle | None = None
        self._interval = COUNT_INTERVAL
        # worker -> its route; holding the core keeps it alive while routed
        self._routes: dict[str, _Route] = {}
        self.failures = 0
        self.losses = 0  # connections lost: a hand-off that saw one starts over
        # What would go to EventSync while the JetStream reader still delivers the live
        # events (router.events.feed): dropped (``ignore``: the stream has them) or, during the
        # hand-off, held in order (``hold``); None: handed on as it comes.
        self._held: list[NativeMsg] | None = None
        self._ignoring = False
        self._held_bytes = 0
        self.held_overflow = False  # the held messages outgrew the bounds and were dropped

    @property
    def up(self) -> bool:
        return self.reader.up

    def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.reader.wake_fd, self._wake)
        self._tick = self._loop.call_later(COUNT_INTERVAL, self._count)
        self.reader.start()

    def close(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
        if self._loop is not None:
            self._loop.remove_reader(self.reader.wake_fd)
        self.reader.close()

    def lag(self) -> tuple[int, float]:
        return self.reader.lag()

    def stats(self) -> dict[str, int]:
        return self.reader.stats()

    # -- routes ------------------------------------------------------------------
    def route(self, worker_id: str, ingest: EventIngest, rank: int | None) -> None:
        """Let the reader apply ``worker_id``'s next in-order live batches of ``rank``."""
        # A hybrid model's other groups are applied by Python (NativeEventIngest.apply).
        if not isinstance(ingest, NativeEventIngest) or ingest._split_groups:
            return
        at = ingest.index.located(worker_id)
        if at is None:
            return
        quota = ingest._limit()  # the quota Core.ingest_many gets from apply_many
        route = _Route(ingest, at[0], at[1], rank, quota)
        known = self._routes.get(worker_id)
        if known == route:
            return
        self.reader.route(worker_id, at[0], at[1], rank, quota)
        self._routes[worker_id] = route
        if known is None:
            # A worker's first route: a worker added since the others were routed
            # shrank the pool's quota (its bound over the workers); its first batch
            # always comes through Python, so the others learn the new quota here.
            for other, r in list(self._routes.items()):
                if r.ingest is ingest and r.quota != quota:
                    self.reader.route(other, r.core, r.slot, r.rank, quota)
                    self._routes[other] = r._replace(quota=quota)

    def unroute(self, worker_id: str) -> None:
        if self._routes.pop(worker_id, None) is not None:
            self.reader.unroute(worker_id)

    # -- the hand-off from the stream (router.events.feed) ----------------------------------
    def ignore(self) -> None:
        """Apply nothing and give Python nothing: the stream reader delivers the live
        events (the connection stays up for the next hand-off)."""
        for worker_id in list(self._routes):
            self.unroute(worker_id)
        self._ignoring = True
        self._held = None

    def hold(self) -> None:
        """Keep the messages Python would take, from now on and in order, until
        ``release``: the stream reader still delivers them meanwhile."""
        self._ignoring = False
        self._held = []
        self._held_bytes = 0
        self.held_overflow = False

    def release(self) -> bool:
        """Hand the held messages to ``EventSync.take`` (the ones the stream delivered too
        are duplicates, which ingest ignores) and stop holding. False: some were dropped
        (over ``MAX_QUEUED`` / ``MAX_QUEUED_BYTES``): the caller marks the workers lost."""
        held, self._held = self._held or [], None
        self._ignoring = False
        for msg in held:
            self.events.take(msg)
        return not self.held_overflow

    def _keep(self, msg: NativeMsg) -> None:
        held = self._held
        assert held is not None
        if self.held_overflow:
            return
        held.append(msg)
        self._held_bytes += len(msg.data)
        if len(held) > MAX_QUEUED or self._held_bytes > MAX_QUEUED_BYTES:
            self.held_overflow = True
            held.clear()

    def collect(self) -> None:
        """Take what the reader has now, its counts included (before they are shown)."""
        self._wake()

    # -- on the loop ---------------------------------------------------------------
    def _wake(self) -> bool:
        """Drain unless a drain is already scheduled; whether anything came."""
        return self._scheduled or self._drain()

    def _count(self) -> None:
        busy = self._wake()
        self._interval = COUNT_INTERVAL if busy else min(2 * self._interval, COUNT_IDLE)
        assert self._loop is not None
        self._tick = self._loop.call_later(self._interval, self._count)

    def _drain(self) -> bool:
        self._scheduled = False
        records, dropped, dropped_all, applied, more = self.reader.poll(POLL_BATCH)
        events = self.events
        for record in records:
            kind = record[0]
            if kind == 0:
                _, subject, headers, data = record
                if self._ignoring:
                    continue
                if self._held is None:
                    events.take(NativeMsg(subject, headers, data))
                else:
                    self._keep(NativeMsg(subject, headers, data))
            elif kind == 1:
                _, worker_id, seq, rank, epoch, payload, out = record
                events.native_noted(worker_id, seq, payload, rank, epoch, out)
            elif kind == 2:
                log.info("native event reader subscribed")
                self._on_up()
            elif kind == 3:
                log.warning("native event reader lost its connection: %s", record[1])
                self.losses += 1
                self._on_lost(str(record[1]))
            else:
                self.failures += 1
                failures.warning("native event reader cannot connect: %s", record[1])
        for worker_id, batches, applied_events in applied:
            events.native_applied(worker_id, batches, applied_events)
        if self._ignoring:
            dropped, dropped_all = [], False  # the stream delivers what the queue dropped
        if dropped_all:
            events.lost_all("native_dropped")
        for worker_id in dropped:
            events.lost(worker_id, "native_dropped")
        if more and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._drain)
        return bool(records or applied or dropped or dropped_all or more)
