"""An ordered reader of the KV-event stream that outlives reconnects and lost servers.

A replica that starts, restarts or reconnects reads the stream from the first batch it
has not seen: an ephemeral push consumer (no acks, flow control, idle heartbeats) that
starts at stream seq ``last + 1``, or at the beginning of the stream on the first
attach. Delivery is checked in order: a consumer seq that skips, a heartbeat that names
a later message, or silence for three heartbeats re-creates the consumer from the last
delivered stream seq. Messages from a replaced consumer are ignored by generation.

Why not nats-py's ``ordered_consumer``: it resumes from the last stream seq it saw even
when the stream itself is new (a NATS server restarted without its store numbers from 1
again, so the resume point skips the new stream's first batches), and it re-creates its
consumer once, in the background, with no retry while the server is still away. Here
every attach compares the stream's creation time and reads a new stream from its start.

Once the consumer is up to date (``num_pending`` 0, or a batch stored less than
``LIVE_AGE`` seconds ago: under steady traffic the pending count need not touch 0),
``on_caught_up`` runs: the caller then asks the agents for what the stream never had
(batches published while the server was down).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from router.events.jetstream import StreamSpec, ensure_stream

log = logging.getLogger(__name__)

LIVE_AGE = 1.0  # seconds: a batch this fresh means the reader is up to date
HANDOFF_WAIT = 5.0  # seconds ``read_past_now`` waits for the stream to deliver its backlog

Deliver = Callable[[Msg], Awaitable[None]]


class StreamReader:
    def __init__(
        self,
        spec: StreamSpec,
        deliver: Deliver,
        *,
        on_caught_up: Callable[[], None],
        on_lost: Callable[[], None],
        on_skip: Callable[[int], None] = lambda _n: None,
        counts: Counter[str],
        heartbeat: float = 1.0,
        max_backoff: float = 5.0,
    ) -> None:
        self.spec = spec
        self.deliver = deliver
        self.on_caught_up = on_caught_up
        self.on_lost = on_lost
        self.on_skip = on_skip
        self.pending = 0  # messages the stream holds past the last delivered one (lag)
        self._exclusive = False  # the stream holds our event subjects only
        self.counts = counts
        self.heartbeat = heartbeat
        self.max_backoff = max_backoff
        self.caught_up = False
        self._nc: Client | None = None
        self._sub: Subscription | None = None
        self._gen = 0  # bumped per consumer; messages of older ones are ignored
        self._stream: str | None = None
        self._created: datetime.datetime | None = None  # the stream's identity
        self._sseq = 0  # last stream seq delivered
        self._dseq = 1  # next consumer seq expected
        self._delivered = 0  # batches handed to ``deliver``
        self._active = 0.0  # monotonic time of the last message or heartbeat
        self._lock = asyncio.Lock()
        self._retry: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None

    @property
    def stream_seq(self) -> int:
        """The last stream seq handed to ``deliver`` (0 before the first)."""
        return self._sseq

    async def read_past_now(self) -> bool:
        """Wait until every event batch the stream holds now has been delivered; False
        when it did not happen within ``HANDOFF_WAIT`` seconds or the reader lost its
        consumer meanwhile. The stream's last seq names a batch only when the stream
        holds nothing else; otherwise a delivery with nothing pending after it says so."""
        nc = self._nc
        if nc is None or self._stream is None:
            return False
        gen = self._gen
        info = await nc.jsm().stream_info(self._stream)
        last, delivered = info.state.last_seq, self._delivered
        deadline = time.monotonic() + HANDOFF_WAIT
        while gen == self._gen and time.monotonic() < deadline:
            if self._sseq >= last or (
                not self._exclusive and self._delivered > delivered and self.pending == 0
            ):
                return True
            await asyncio.sleep(0.005)
        return False

    async def start(self, nc: Client) -> None:
        """First attach; raises what JetStream said (the caller may fall back to core NATS)."""
        self._nc = nc
        await self._attach()

    def reattach(self) -> None:
        """Re-create the consumer from the last delivered seq, retrying until it works.

        A retry already waiting out its backoff starts over at once (called on reconnect).
        """
        if self._nc is None:
            return
        if self._retry is not None and not self._retry.done():
            self._retry.cancel()
        self._gen += 1  # whatever the old consumer still pushes is stale from now on
        self.caught_up = False
        self.on_lost()
        self._retry = asyncio.create_task(self._reattach_loop(), name="stream-reattach")

    async def close(self) -> None:
        """Stop reading for good: the consumer, its watchdog and any retry."""
        self._gen += 1  # what the consumer still pushes is dropped
        tasks = [t for t in (self._retry, self._watch) if t is not None]
        self._retry = self._watch = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.pending = 0
        await self._unsubscribe()

    # -- attach ------------------------------------------------------------------
    async def _reattach_loop(self) -> None:
        delay = 0.1
        while True:
            try:
                await self._attach()
                return
            except Exception as exc:  # server still starting, JetStream not ready, timeouts
                self.counts["stream_attach_failed"] += 1
                log.warning("event stream: attach failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff)

    async def _attach(self) -> None:
        nc = self._nc
        assert nc is not None
        async with self._lock:
            self._gen += 1
            gen = self._gen
            self.caught_up = False
            await self._unsubscribe()
            info = await ensure_stream(nc, self.spec)
            # Only then is a jump in stream seq a lost batch (not another subject's).
            self._exclusive = list(info.config.subjects or []) == [self.spec.subject]
            if (info.config.name, info.created) != (self._stream, self._created):
                if self._created is not None:
                    self.counts["stream_new"] += 1
                    log.warning("event stream %s is a new stream: reading it from the start",
                                info.config.name)  # fmt: skip
                self._stream, self._created, self._sseq = info.config.name, info.created, 0
            inbox = nc.new_inbox()
            self._sub = await nc.subscribe(inbox, cb=functools.partial(self._on_msg, gen))
            self._dseq = 1
            self._active = time.monotonic()
            start = self._sseq + 1
            config = api.ConsumerConfig(
                deliver_subject=inbox,
                filter_subject=self.spec.subject,
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE
                if start > 1
                else api.DeliverPolicy.ALL,
                opt_start_seq=start if start > 1 else None,
                ack_policy=api.AckPolicy.NONE,
                flow_control=True,
                idle_heartbeat=self.heartbeat,
                mem_storage=True,
                num_replicas=1,
                # the server drops it once our inbox is gone for this long
                inactive_threshold=max(5.0, 5 * self.heartbeat),
            )
            consumer = await nc.jsm().add_consumer(self._stream or self.spec.name, config)
            self.counts["stream_attached"] += 1
            log.info("event stream %s: reading from seq %d", self._stream, start)
            if self._watch is None:
                self._watch = asyncio.create_task(self._watchdog(), name="stream-watchdog")
            if consumer.num_pending == 0 and gen == self._gen:
                self._caught_up()

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # connection closed or lost: nothing left to undo
                log.debug("event stream: unsubscribe failed: %s", exc)

    # -- delivery ----------------------------------------------------------------
    async def _on_msg(self, gen: int, msg: Msg) -> None:
        if gen != self._gen:
            return
        self._active = time.monotonic()
        headers = msg.headers
        if headers and "Status" in headers:
            await self._control(msg, headers)
            return
        try:
            meta = msg.metadata
        except Exception:  # not a JetStream delivery: nothing to order it by
            self.counts["stream_bad_messages"] += 1
            return
        if meta.sequence.consumer != self._dseq:
            self._lost("consumer seq skipped")
            return
        self._dseq += 1
        skipped = meta.sequence.stream - self._sseq - 1
        if self._exclusive and self._sseq and skipped > 0:
            # The stream let batches go (limits) before this reader got them: whose is
            # unknown, so every worker is out of sync until its agent fills the gap.
            self.counts["stream_skipped"] += skipped
            self.on_skip(skipped)
        self._sseq = meta.sequence.stream
        self.pending = meta.num_pending
        self._delivered += 1
        await self.deliver(msg)
        if not self.caught_up and (
            meta.num_pending == 0 or time.time() - meta.timestamp.timestamp() < LIVE_AGE
        ):
            self._caught_up()

    async def _control(self, msg: Msg, headers: dict[str, str]) -> None:
        nc = self._nc
        assert nc is not None
        if headers.get("Status") != "100":
            self._lost(f"status {headers.get('Status')}")
            return
        if msg.reply:  # flow control: everything before it is handled, send more
            await nc.publish(msg.reply, b"")
            return
        stalled = headers.get("Nats-Consumer-Stalled")
        if stalled:
            await nc.publish(stalled, b"")
        last = headers.get("Nats-Last-Consumer")
        if last is not None and last.isdigit() and int(last) != self._dseq - 1:
            self._lost("heartbeat names a message never received")

    def _caught_up(self) -> None:
        self.caught_up = True
        self.counts["stream_caught_up"] += 1
        self.on_caught_up()

    def _lost(self, why: str) -> None:
        self.counts["stream_lost"] += 1
        log.warning("event stream: %s; re-reading from seq %d", why, self._sseq + 1)
        self.reattach()

    async def _watchdog(self) -> None:
        """Heartbeats stopped (consumer gone with a restarted server): attach again."""
        nc = self._nc
        assert nc is not None
        while True:
            await asyncio.sleep(self.heartbeat)
            idle = time.monotonic() - self._active
            retrying = self._retry is not None and not self._retry.done()
            if nc.is_connected and not retrying and idle > 3 * self.heartbeat:
                self._lost(f"no heartbeat for {idle:.1f}s")
