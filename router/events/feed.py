"""Where the router's KV events come from, and whether it can trust its index meanwhile.

Transport ``jetstream`` reads the event stream (``router.events.stream_reader``): a replica that
starts late or comes back replays what it missed from the stream. ``core`` subscribes to
the live subjects and relies on agents' replays alone. ``auto`` (the default) takes the
stream when the server has JetStream and falls back to core NATS when it has none.

The live events of core NATS are read by the native core's own thread
(``router.events.native_reader``) where it can (``events_reader``): it has its own connection,
which reconnects by itself; its loss marks every worker out of sync at once.

With the stream, the native reader takes the live events over once the stream is read up
to date (the hand-off): its subscription starts, what it would give Python is held, the
stream reader delivers every batch the stream held by then and stops, the held messages
follow (the ones the stream delivered too are duplicates, which ingest ignores), and the
agents are asked once for anything after the last batch applied. Why: nats-py reads the
stream on the event loop, so at 512K blocks/s (``bench/scale.py --only nats``, 16
workers) it applied 196K blocks/s while the native reader applied 505K, and requests
waited behind its reads (p99 1.24 ms against 0.46 at 128K blocks/s). From the hand-off
on, a lost connection is repaired as with core NATS (agents' replays); a router that
starts, or gets a new NATS client, reads the stream again first.

After every (re)connection, once the stream is read up to its end (or at once with core
NATS), every worker's agent is asked for batches after the last one applied: that closes
what no stream holds (batches published while NATS was down).

Blind: from ``blind_after`` seconds after the event feed broke until it is read up to
date again, routing treats every worker as out of sync (no hits, load only). A short
blip keeps the index: it is still mostly right, and hits are worth keeping. A replica
that is still reading the stream after its start is blind at once: its index is the
past, with stores that were evicted since.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

from nats.aio.client import Client

from router.config import RouterConfig, native_reader_problem
from router.events.consumer import EventSync
from router.events.jetstream import StreamSpec, jetstream_missing
from router.events.stream_reader import StreamReader

if TYPE_CHECKING:
    from router.events.native_reader import NativeEvents

log = logging.getLogger(__name__)

TRANSPORTS: tuple[str, ...] = ("auto", "jetstream", "core")


class EventFeed:
    """Bus hooks that keep events flowing into ``EventSync`` and say when they do not."""

    def __init__(
        self,
        events: EventSync,
        spec: StreamSpec,
        *,
        transport: str = "auto",
        blind_after: float = 2.0,
        heartbeat: float = 1.0,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"events_transport must be one of {TRANSPORTS}, not {transport!r}")
        self.events = events
        self.transport = transport
        self.blind_after = blind_after
        self.using: str | None = None  # "jetstream" or "core" once connected
        self.native: NativeEvents | None = None  # reads core NATS when set (from_config)
        self.native_live = False  # the native reader carries the live events (not nats-py)
        self._handoff: asyncio.Task[None] | None = None
        self._broken_since: float | None = -math.inf  # blind until first up to date
        self.reader = StreamReader(
            spec,
            events.on_event,
            on_caught_up=self._stream_caught_up,
            on_lost=self._lost,
            on_skip=lambda _n: events.lost_all("stream_skipped"),
            counts=events.counts,
            heartbeat=heartbeat,
        )

    @classmethod
    def from_config(cls, cfg: RouterConfig, events: EventSync) -> EventFeed:
        spec = StreamSpec(
            cfg.events_stream, cfg.subject_prefix, cfg.events_max_age, cfg.events_max_bytes
        )
        feed = cls(events, spec, transport=cfg.events_transport, blind_after=cfg.blind_after)
        if cfg.events_reader != "python" and native_reader_problem(cfg) is None:
            from router.events.native_reader import NativeEvents  # needs the native core built

            feed.native = NativeEvents(
                cfg, events, on_up=feed._native_up, on_lost=feed._native_lost
            )
        return feed

    @property
    def up_to_date(self) -> bool:
        """Connected and read up to date: what the index lacks, the resyncs are fetching."""
        return self._broken_since is None

    def blind(self, now: float) -> bool:
        """Whether the index is too stale to route on (see the module docstring)."""
        since = self._broken_since
        return since is not None and now - since >= self.blind_after

    # -- Bus hooks ---------------------------------------------------------------
    async def on_connect(self, nc: Client) -> None:
        await self.events.attach(nc)
        if self.transport != "core":
            self._stop_live_native()  # a new client reads the stream first again
            try:
                await self.reader.start(nc)
                self.using = "jetstream"
                return
            except Exception as exc:
                if self.transport == "jetstream" or not jetstream_missing(exc):
                    log.warning("event stream unavailable (%s); retrying", exc)
                    self.using = "jetstream"
                    self.reader.reattach()
                    return
                log.warning("NATS has no JetStream: live events only (core NATS)")
        self.using = "core"
        if self.native is not None:
            self._go_native()
            return
        await self.events.subscribe_events(nc)
        self._caught_up()

    async def on_reconnect(self, _nc: Client) -> None:
        if self.native_live:
            if self.native is not None and self.native.up:
                self._caught_up()
        elif self.using == "jetstream":
            self._cancel_handoff()
            self.reader.reattach()  # resyncs (and hands off) once read up to date
        else:
            self._caught_up()

    async def on_disconnect(self) -> None:
        self._lost()

    async def close(self) -> None:
        self._cancel_handoff()
        await self.reader.close()
        if self.native is not None:
            self.native.close()

    # -- the native reader ---------------------------------------------------------
    def _go_native(self) -> None:
        """The native reader carries the live events from now on."""
        native = self.native
        assert native is not None
        self.native_live = True
        self.events.native = native
        native.release()  # nothing held: it hands everything on from now
        native.start()  # once: it reconnects by itself, then resyncs (on_up)
        if native.up:  # a new nats-py client while the reader stayed up
            self._caught_up()

    def _stop_live_native(self) -> None:
        """Back to nats-py for the live events (the stream is read again): the native
        reader keeps its connection but applies nothing itself until the next hand-off."""
        self.native_live = False
        self.events.native = None
        self._cancel_handoff()

    def _cancel_handoff(self) -> None:
        if self._handoff is not None:
            self._handoff.cancel()
            self._handoff = None
        if self.native is not None and not self.native_live:
            self.native.ignore()

    async def _hand_off(self) -> None:
        """From the stream reader to the native one (see the module docstring)."""
        native = self.native
        assert native is not None
        while True:
            native.hold()
            native.start()
            losses = native.losses
            while not native.up:
                await asyncio.sleep(0.01)  # it retries by itself; the stream still reads
            try:
                done = await self.reader.read_past_now()
            except Exception as exc:  # NATS away: try again on the next catch-up
                log.warning("event stream: hand-off to the native reader failed (%s)", exc)
                native.ignore()
                self._handoff = None
                return
            if done and native.losses == losses and native.up:
                break
            log.info("event stream: hand-off to the native reader starts over")
            await asyncio.sleep(0.1)
        await self.reader.close()
        self.native_live = True
        self.events.native = native
        self._handoff = None
        if not native.release():
            self.events.lost_all("native_held_dropped", resync=False)
        self.events.counts["native_handoffs"] += 1
        log.info("event stream read up to date: the native reader carries the live events")
        self._caught_up()  # the agents close any gap between the two readers

    # -- reader hooks ------------------------------------------------------------
    def _caught_up(self) -> None:
        self._broken_since = None
        self.events.resync_all()

    def _stream_caught_up(self) -> None:
        self._caught_up()
        if self.native is not None and not self.native_live and self._handoff is None:
            self._handoff = asyncio.create_task(self._hand_off(), name="events-handoff")

    def _native_up(self) -> None:
        if self.native_live:
            self._caught_up()

    def _native_lost(self, _why: str) -> None:
        """The native reader's connection ended: what it did not read is unknown. The
        resyncs start once it is subscribed again (``_caught_up``): one before would not
        cover what is published until then, and would back off while NATS is away.
        During a hand-off the stream still reads: the hand-off starts over."""
        if not self.native_live:
            return
        self._lost()
        self.events.lost_all("native_disconnect", resync=False)

    def _lost(self) -> None:
        if self._broken_since is None:
            self._broken_since = time.monotonic()
