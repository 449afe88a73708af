"""What the router consumes from NATS: KV events (with replay on gaps) and load reports.

Events for one worker must be applied in sequence order. A gap (or an unreadable
batch) is not applied: the worker is marked out of sync (its matches are not trusted)
and a resync task asks ``<prefix>.replay.<worker>`` for the missing batches or a dump
(``index/gapfill.py``). Live batches that arrive meanwhile are held in order and fed
after the replay; duplicates are harmless because ingest ignores them. nats-py runs one
subscription's callbacks one at a time, so the live path needs no lock.

Batches arrive either from a core subscription or from the JetStream stream reader
(``router.events.feed`` picks); both hand the same NATS messages, headers intact, to
``on_event``.

With the native index, live batches are applied on ``router.events.ingest_thread`` (decode,
rehash and apply release the GIL), so the event loop only queues them; one lock keeps
that thread and the resync path (which stays on the loop) from applying at once, and a
resync queues behind the batches already on the thread, so their gaps are seen first.
Nothing is lost silently: a full ingest queue, a slow-consumer drop in the NATS client
or a skip in the event stream marks the workers concerned out of sync at once and
resyncs them; ``lag()`` is exported as a metric.

One subject, one seq space. A worker's subject carries one agent's batches, which name
one dp rank (the engine publisher's ``data_parallel_rank``; each DP rank is its own
target and subject, ``router.dp``). The ingest keeps a seq space per rank it is given,
so a header naming a new rank used to open a new space: 2,000 forged ``Kv-Dp-Rank``
values with seq 0 filled the 64 the ingest allows (a worker whose first real batch came
later was refused for good) and a later gap in one of them held the worker out of sync
for good (no agent replays a rank it never had; issue 32). Now the router pins each
subject to one rank (``_rank``): the first batch it takes pins it, the agent's replay
(whose payloads carry the engine's own rank) confirms or corrects it, and a batch naming
any other rank never reaches the ingest (``foreign_rank``). Forged ranks are then no
more than forged seqs, which one replay round heals: a worker is back in sync one
round after the last forged batch is read (``replay_timeout`` + ``max_backoff``, 7 s
at the defaults; 0.1-0.5 s measured), and the flood costs a header parse a message.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import SlowConsumerError
from nats.errors import TimeoutError as NatsTimeout

from index.codec import AllBlocksCleared, CodecError, DecodedBatch, EventBatch, decode, encode
from index.gapfill import GapFillMessage, GapFillRequest
from index.ingest import EventIngest, IngestResult, SeqStatus
from index.wire import (
    DEFAULT_PREFIX,
    DP_RANK_HEADER,
    EPOCH_HEADER,
    EPOCH_START_SEQ,
    SEQ_HEADER,
    Subjects,
)
from router.events.ingest_thread import IngestThread
from router.observe.ratelog import RateLimitedLog
from router.observe.tracing import Tracing
from router.workers.load import parse_load_report
from router.workers.registry import WorkerRegistry

if TYPE_CHECKING:  # both need the native core built
    from index.native_ingest import NativeEventIngest
    from router.events.native_reader import NativeEvents

log = logging.getLogger(__name__)
bad_input = RateLimitedLog(log)  # replay answers come from NATS: at most a line per 10 s

_RETRY = (SeqStatus.GAP, SeqStatus.MALFORMED, SeqStatus.JUMP)
_APPLIED = (SeqStatus.OK, SeqStatus.RESTART)
_CLEAR = encode(EventBatch(0.0, [AllBlocksCleared()]))  # an epoch start's payload
YIELD_EVERY = 8  # live messages between two yields to the loop (on_event)


class _NoRank:
    """An agent's answer that names no rank (nothing replayed or dumped)."""


_NO_RANK = _NoRank()


def _named_rank(batches: list[tuple[int, bytes]], dump: list[DecodedBatch]) -> int | _NoRank | None:
    """The dp rank a replay answer's payloads are stamped with (the engine's own)."""
    if dump:
        return dump[0].dp_rank
    try:
        return decode(batches[0][1]).dp_rank if batches else _NO_RANK
    except CodecError:
        return _NO_RANK  # counted where it is applied


def last_seq(ingest: EventIngest, worker_id: str) -> int | None:
    """A worker's last applied seq over its dp ranks (the agent replays one seq space)."""
    return max(ingest.last_seqs(worker_id).values(), default=None)


class EventMsg(Protocol):
    """What a live batch's message carries: a nats-py ``Msg`` or the native reader's."""

    @property
    def subject(self) -> str: ...
    @property
    def headers(self) -> dict[str, str] | None: ...
    @property
    def data(self) -> bytes: ...


class Live(NamedTuple):
    seq: int
    payload: bytes
    dp_rank: int | None
    epoch: str | None
    arrival: int = 0  # ``take``'s count when it came: held batches are fed in this order


class EventSync:
    """Keeps every pool's index in step with its workers' KV events."""

    def __init__(
        self,
        registry: WorkerRegistry,
        prefix: str = DEFAULT_PREFIX,
        *,
        replay_timeout: float = 2.0,
        max_pending: int = 10_000,
        max_pending_bytes: int = 64 << 20,
        max_backoff: float = 5.0,
        max_queued: int = 100_000,
        tracing: Tracing | None = None,
    ) -> None:
        self.registry = registry
        self.prefix = prefix
        self.replay_timeout = replay_timeout
        self.max_pending = max_pending  # batches held per worker during a resync
        self.max_pending_bytes = max_pending_bytes  # and their payload bytes
        self._pending_bytes: Counter[str] = Counter()
        self.max_backoff = max_backoff
        self.counts: Counter[str] = Counter()
        self.tracing = tracing  # None: off
        self._nc: Client | None = None
        self._pending: dict[str, list[Live]] = {}
        self._resync: dict[str, asyncio.Task[None]] = {}
        # The dp rank each worker's subject is pinned to (its one seq space: see the
        # module's docstring); replayed batches carry no header, so they land in it too.
        # Pinned by the first batch taken, confirmed (``_confirmed``) or corrected by
        # what the agent's replay payloads name.
        self._rank: dict[str, int | None] = {}
        self._confirmed: set[str] = set()
        self.subjects = Subjects(prefix)
        self._events_prefix = self.subjects.events("")
        self._load_prefix = self.subjects.load("")
        self.max_queued = max_queued  # live batches waiting for the ingest thread
        self._thread: IngestThread | None = None  # started with the first native batch
        self._apply_lock = threading.Lock()  # the ingest thread vs the resync path
        self._since_yield = 0  # messages taken since on_event last yielded to the loop
        self._arrivals = 0  # live batches taken so far (``Live.arrival``)
        # The native reader (router.events.native_reader) when it reads the live events: it
        # applies a worker's in-order batches itself once routed here (``_applied``).
        self.native: NativeEvents | None = None

    # -- wiring ------------------------------------------------------------------
    async def attach(self, nc: Client) -> None:
        """Take load reports (and send replay requests) on ``nc``; nats-py re-subscribes
        by itself after reconnects."""
        self._nc = nc
        await nc.subscribe(self.subjects.all_loads, cb=self._on_load)

    async def subscribe_events(self, nc: Client) -> None:
        """Live events from core NATS (when no stream reader delivers them)."""
        await nc.subscribe(self.subjects.all_events, cb=self.on_event)

    def resync_all(self) -> None:
        """Once events flow again: ask every worker's agent for what this router has not seen."""
        for source in self.registry.sources():
            self.resync(source)

    def resync(self, worker_id: str) -> None:
        """Fetch a worker's batches after the last one applied (all of them if none was).

        Ends after one round when nothing was missing or no agent answers; keeps trying
        only while the worker is out of sync.
        """
        # Behind the batches already queued for the ingest thread: what they show (a
        # gap, a restart) is known before the replay is asked for, as without a thread.
        if self._thread is not None and self._thread.submit(
            lambda: None, lambda _: self._resync_now(worker_id)
        ):
            return
        self._resync_now(worker_id)

    def _resync_now(self, worker_id: str) -> None:
        worker = self.registry.source(worker_id)
        if worker is not None:
            last = last_seq(worker.pool.ingest, worker_id)
            self._start_resync(worker_id, 0 if last is None else last + 1)

    async def close(self) -> None:
        tasks = list(self._resync.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._resync.clear()  # a task cancelled before its first step never ran its finally
        if self._thread is not None:
            self._thread.close()

    def lag(self) -> tuple[int, float]:
        """(live batches queued for the ingest thread or the native reader's queue,
        seconds the oldest has waited)."""
        n, age = (0, 0.0) if self._thread is None else self._thread.lag()
        if self.native is not None:
            queued, oldest = self.native.lag()
            n, age = n + queued, max(age, oldest)
        return n, age

    async def drain(self, timeout: float = 10.0) -> bool:
        """Wait (bounded) until the batches queued so far are applied."""
        return True if self._thread is None else await self._thread.drain(timeout)

    # -- loss ----------------------------------------------------------------------
    def lost(self, worker_id: str, why: str, *, resync: bool = True) -> None:
        """Batches of ``worker_id`` were lost on the way: stop trusting its index at once
        and fetch what it missed (``resync=False``: the caller resyncs once it can, e.g.
        when its connection is back)."""
        worker = self.registry.source(worker_id)
        if worker is None:
            return
        self.counts[f"lost_{why}"] += 1
        worker.pool.ingest.mark_out_of_sync(worker_id)
        if resync:
            self.resync(worker_id)

    def lost_all(self, why: str, *, resync: bool = True) -> None:
        """Batches of unknown workers were lost (the event stream skipped): all of them."""
        for source in self.registry.sources():
            self.lost(source, why, resync=resync)

    async def on_nats_error(self, exc: Exception) -> None:
        """The NATS client dropped a message it had no room for (slow consumer)."""
        if not isinstance(exc, SlowConsumerError):
            return
        subject = exc.subject or ""
        if subject.startswith(self._events_prefix):
            self.lost(subject[len(self._events_prefix) :], "slow_consumer")
        elif subject:
            # A stream delivery (its inbox names no worker): any worker may miss one.
            self.lost_all("slow_consumer")

    # -- live path ---------------------------------------------------------------
    async def _on_load(self, msg: Msg) -> None:
        worker = self.registry.get(msg.subject[len(self._load_prefix) :])
        if worker is None:
            self.counts["load_unknown_worker"] += 1
            return
        try:
            worker.load.report(parse_load_report(msg.data))
        except ValueError:
            self.counts["load_malformed"] += 1

    async def on_event(self, msg: Msg) -> None:
        """One batch on ``<prefix>.events.<worker>`` with its ``Kv-Seq``/``Kv-Epoch`` headers.

        nats-py hands a subscription's queued messages over without yielding to the loop
        (its queue ``get`` and this callback never suspend), so a request that arrives
        behind a socket read's worth of batches waited for all of them; every
        ``YIELD_EVERY`` messages the loop runs what else is ready.
        """
        self.take(msg)
        self._since_yield += 1
        if self._since_yield >= YIELD_EVERY:
            self._since_yield = 0
            await asyncio.sleep(0)

    def native_applied(self, worker_id: str, batches: int, events: int) -> None:
        """The native reader applied ``batches`` in-order live batches of the worker."""
        self.counts["messages"] += batches
        self.counts["native_applied"] += batches
        worker = self.registry.source(worker_id)
        if worker is not None:
            worker.pool.ingest.events_applied += events
            worker.pool.ingest.batches_applied += batches

    def native_noted(
        self,
        worker_id: str,
        seq: int,
        payload: bytes,
        rank: int | None,
        epoch: str | None,
        out: tuple[int, int | None, int, dict[str, int] | None, dict[str, int] | None, int],
    ) -> None:
        """The native reader applied a batch whose outcome has counts for Python (errors,
        quota cuts): they are counted as for a batch applied on the ingest thread."""
        self.counts["messages"] += 1
        worker = self.registry.source(worker_id)
        if worker is None or not worker.pool.ingest.native:
            return
        ingest = cast("NativeEventIngest", worker.pool.ingest)
        self._arrivals += 1
        live = Live(seq, payload, rank, epoch, self._arrivals)
        with self._apply_lock:  # a hybrid model's first groups are applied here
            result = ingest.outcome(worker_id, seq, payload, rank, epoch, out)
        self._applied(worker_id, live, result)

    def take(self, msg: EventMsg) -> None:
        """One live batch's message: nats-py's (``on_event``) or the native reader's."""
        self.counts["messages"] += 1
        worker_id = msg.subject[len(self._events_prefix) :]
        worker = self.registry.source(worker_id)
        if worker is None:
            self.counts["unknown_worker"] += 1
            return
        headers = msg.headers or {}
        try:
            seq = int(headers[SEQ_HEADER])
            rank_text = headers.get(DP_RANK_HEADER)
            rank = int(rank_text) if rank_text else None
            # EPOCH_START_SEQ (-1): the agent's "new engine life" announcement
            if not EPOCH_START_SEQ <= seq < 1 << 63 or not (rank is None or 0 <= rank < 1 << 16):
                raise ValueError("seq or dp rank out of range")
            self._arrivals += 1
            live = Live(seq, msg.data, rank, headers.get(EPOCH_HEADER), self._arrivals)
        except (KeyError, ValueError):
            self.counts["bad_headers"] += 1
            return
        if not self._pinned(worker_id, live):
            return
        if worker_id in self._resync:
            self._hold(worker_id, live)
            return
        ingest = worker.pool.ingest
        known = ingest.epoch(worker_id)
        if known is not None and live.epoch != known:
            # A new engine life clears the worker. Anyone who can publish could claim one
            # (one forged Kv-Epoch + AllBlocksCleared wiped a worker), so the agent confirms
            # it first: its replay carries its epoch; meanwhile the worker is not trusted.
            self.counts["epoch_unconfirmed"] += 1
            self._hold(worker_id, live)
            self._start_resync(worker_id, 0)
            return
        if ingest.native:
            thread = self._ingest_thread()
            if not thread.submit_run(
                self._apply_live,
                (ingest, worker_id, live),
                lambda result: self._applied(worker_id, live, result),
            ):
                self._hold(worker_id, live)  # fed after the resync's replay
                self.lost(worker_id, "ingest_queue_full")
            return
        self._applied(worker_id, live, self._apply(ingest, worker_id, live))

    def _pinned(self, worker_id: str, live: Live) -> bool:
        """Whether a live batch belongs to the worker's seq space (its rank is the one
        pinned); the first one pins it. A batch of another rank is dropped (forged, or
        the pin came from a forged first batch): while the agent has not confirmed the
        pin, it is asked for the last batch applied, whose payload names the real rank;
        one of another engine life has the agent asked from seq 0.

        A first batch without ``Kv-Epoch`` (agents always send one) is checked with the
        agent at once: a forged seq 0 with no epoch, on a worker whose engine has
        published nothing yet, passes every seq rule, and the engine's own seq 0 would
        be dropped as its duplicate (with an epoch, the engine's first batch names
        another life, which the agent confirms)."""
        rank = live.dp_rank
        if worker_id not in self._rank:
            self._rank[worker_id] = rank
            if live.epoch is None:
                self._start_resync(worker_id, max(0, live.seq))
            return True
        if self._rank[worker_id] == rank:
            return True
        self.counts["foreign_rank"] += 1
        worker = self.registry.source(worker_id)
        if worker is None or worker_id in self._resync:
            return False
        ingest = worker.pool.ingest
        if live.epoch is not None and live.epoch != ingest.epoch(worker_id):
            # another engine life may publish another rank (an engine restarted with
            # another DP layout): its agent names the rank of its payloads
            self._start_resync(worker_id, 0)
        elif worker_id not in self._confirmed:
            last = ingest.last_seq(worker_id, self._rank[worker_id])
            self._start_resync(worker_id, 0 if last is None else max(0, last))
        return False

    def _ingest_thread(self) -> IngestThread:
        if self._thread is None:
            self._thread = IngestThread(
                asyncio.get_running_loop(), max_batches=self.max_queued, on_error=self._failed
            )
        return self._thread

    def _failed(self, exc: BaseException) -> None:
        self.counts["ingest_errors"] += 1
        log.error("applying a KV-event batch failed", exc_info=exc)

    def _apply(self, ingest: EventIngest, worker_id: str, live: Live) -> IngestResult:
        with self._apply_lock:
            if self.tracing is None:
                return ingest.apply(
                    worker_id, live.seq, live.payload, dp_rank=live.dp_rank, epoch=live.epoch
                )
            with self.tracing.ingest(worker_id, live.seq, len(live.payload)) as span:
                result = ingest.apply(
                    worker_id, live.seq, live.payload, dp_rank=live.dp_rank, epoch=live.epoch
                )
                span.set_attribute("cache_router.seq_status", str(result.status))
                return result

    def _apply_live(self, run: list[tuple[EventIngest, str, Live]]) -> list[IngestResult | None]:
        """On the ingest thread, a run of live batches in order, one native call per pool
        (``EventIngest.apply_many``); None (not applied) where a resync began meanwhile."""
        results: list[IngestResult | None] = [None] * len(run)
        if self.tracing is not None:
            for i, (ingest, worker_id, live) in enumerate(run):
                if worker_id not in self._resync:
                    results[i] = self._apply(ingest, worker_id, live)
            return results
        todo = [i for i, (_, worker_id, _) in enumerate(run) if worker_id not in self._resync]
        with self._apply_lock:
            start = 0
            while start < len(todo):
                ingest = run[todo[start]][0]
                end = start + 1
                while end < len(todo) and run[todo[end]][0] is ingest:
                    end += 1
                part = todo[start:end]
                batches = [
                    (w, live.seq, live.payload, live.dp_rank, live.epoch)
                    for _, w, live in (run[i] for i in part)
                ]
                for i, result in zip(part, ingest.apply_many(batches), strict=True):
                    results[i] = result
                start = end
        return results

    def _applied(self, worker_id: str, live: Live, result: IngestResult | None) -> None:
        """On the loop: what a live batch's ingest said."""
        if result is None:
            if worker_id in self._resync:
                self._hold(worker_id, live)
                return
            worker = self.registry.source(worker_id)
            if worker is None:
                return
            result = self._apply(worker.pool.ingest, worker_id, live)
        if result.status in _APPLIED:
            if self.native is not None and self.tracing is None:
                worker = self.registry.source(worker_id)
                if worker is not None:
                    self.native.route(worker_id, worker.pool.ingest, live.dp_rank)
        elif result.status in _RETRY:
            self.counts[str(result.status)] += 1
            if result.status is SeqStatus.GAP:
                self._hold(worker_id, live)
            self._start_resync(worker_id, result.expected_seq or 0)
        elif result.status is SeqStatus.REFUSED:
            self.counts["refused"] += 1

    def _hold(self, worker_id: str, live: Live) -> None:
        pending = self._pending.setdefault(worker_id, [])
        pending.append(live)
        self._pending_bytes[worker_id] += len(live.payload)
        if (
            len(pending) > self.max_pending
            or self._pending_bytes[worker_id] > self.max_pending_bytes
        ):
            # Too far behind to catch up batch by batch: drop the backlog; the replay
            # after this one starts from the next expected seq (or a dump).
            self.counts["pending_dropped"] += len(pending)
            pending.clear()
            self._pending_bytes[worker_id] = 0

    def _take_pending(self, worker_id: str) -> list[Live]:
        """The held batches in the order they came: a batch on the ingest thread when a
        resync began is held when the thread hands it back, after later ones ``take``
        held at once; fed in that order, the first later one was a gap and every round
        held them so again (with no agent to answer, the worker stayed out of sync for
        good with every batch in hand: tests/test_native_events.py's hand-off test)."""
        self._pending_bytes.pop(worker_id, None)
        return sorted(self._pending.pop(worker_id, []), key=lambda live: live.arrival)

    # -- resync ------------------------------------------------------------------
    def _start_resync(self, worker_id: str, from_seq: int) -> None:
        if self.native is not None:
            self.native.unroute(worker_id)  # its live batches are held from here
        if worker_id in self._resync or self._nc is None:
            return
        task = asyncio.create_task(
            self._resync_loop(worker_id, from_seq), name=f"resync-{worker_id}"
        )
        self._resync[worker_id] = task

    async def _resync_loop(self, worker_id: str, from_seq: int) -> None:
        try:
            await self._resync_rounds(worker_id, from_seq)
        finally:
            # Left in the step the rounds end in, not by a done callback a loop turn later:
            # a live batch in between was held for this finished resync and never fed
            # (test_dp_ranks timed out so under load).
            self._resync.pop(worker_id, None)

    async def _resync_rounds(self, worker_id: str, from_seq: int) -> None:
        delay = 0.1
        while True:
            worker = self.registry.source(worker_id)
            if worker is None:
                self._pending.pop(worker_id, None)
                return
            ingest = worker.pool.ingest
            before = last_seq(ingest, worker_id)
            replied = await self._gap_fill(worker_id, from_seq)
            # No await from here to the end of the feed: live batches cannot interleave.
            worker = self.registry.source(worker_id)
            if worker is None:
                self._take_pending(worker_id)
                return
            if replied:
                ingest.forget_unconfirmed(worker_id)
            pending = self._take_pending(worker_id)
            for i, live in enumerate(pending):
                if live.dp_rank != self._rank.get(worker_id, live.dp_rank):
                    self.counts["held_rank_dropped"] += 1  # the agent named another rank
                    continue
                if replied and self._forged(ingest, worker_id, live):
                    continue
                result = self._apply(ingest, worker_id, live)
                if result.status in (SeqStatus.GAP, SeqStatus.MALFORMED):
                    from_seq = result.expected_seq or 0
                    rest = pending[i:] if result.status is SeqStatus.GAP else pending[i + 1 :]
                    for held in rest:
                        self._hold(worker_id, held)
                    break
            else:
                if ingest.in_sync(worker_id):
                    self.counts["resynced"] += 1
                    return
                last = last_seq(ingest, worker_id)
                from_seq = 0 if last is None else last + 1
            if not replied or last_seq(ingest, worker_id) == before:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff)

    def _forged(self, ingest: EventIngest, worker_id: str, live: Live) -> bool:
        """Whether a batch held during a resync the agent fully answered cannot be real:
        another engine life than the one the agent just confirmed, or a seq the agent,
        which replayed all it has, never had (a gap right after its answer), or a jump."""
        last = ingest.last_seq(worker_id, live.dp_rank)
        reason = None
        if live.epoch != ingest.epoch(worker_id) and ingest.epoch(worker_id) is not None:
            reason = "held_epoch_dropped"
        elif live.seq > (-1 if last is None else last) + 1:
            reason = "held_gap_dropped"
        if reason is not None:
            self.counts[reason] += 1
            return True
        return False

    @staticmethod
    def _new_empty_life(
        ingest: EventIngest, worker_id: str, end: GapFillMessage, batches: list[tuple[int, bytes]]
    ) -> bool:
        """Whether the agent's answer vouches for an engine life with no batch yet: only
        ``end`` (seq -1) under another epoch than the one the router knows (a worker
        never seen has nothing to clear). An agent answers that right after it saw the
        engine restart and published an epoch start; the router, which held that epoch
        start as unconfirmed, must clear the worker now, not at the engine's next batch.
        A quiet engine may send none: behind real vLLM the router kept the old life's
        blocks (and predicted their hits) until the test's 60 s bound ran out."""
        return (
            not batches
            and not end.dump
            and end.seq == EPOCH_START_SEQ
            and end.epoch is not None
            and ingest.epoch(worker_id) not in (None, end.epoch)
        )

    def _agent_rank(
        self,
        worker_id: str,
        rank: int | None,
        batches: list[tuple[int, bytes]],
        dump: list[DecodedBatch],
        end: GapFillMessage,
    ) -> int | None:
        """The rank the agent's answer names (its payloads are the engine's own, stamped
        with its rank), pinned as the worker's seq space and confirmed. When that is not
        the rank pinned so far (a forged batch pinned it first), the worker is reset (an
        epoch start under the agent's rank clears every seq space and block) and rebuilt
        from what the agent sends: this answer if it starts at seq 0 or is a dump, else
        the next round's, asked from 0."""
        named = _named_rank(batches, dump)
        if isinstance(named, _NoRank):
            return rank
        self._confirmed.add(worker_id)
        self._rank[worker_id] = named
        worker = self.registry.source(worker_id)
        if named != rank and worker is not None and worker.pool.ingest.last_seqs(worker_id):
            self.counts["rank_repinned"] += 1
            self._forget(worker.pool.ingest, worker_id, named, end.epoch)
        return named

    @staticmethod
    def _ahead(ingest: EventIngest, worker_id: str, rank: int | None, end: GapFillMessage) -> bool:
        """Whether the router applied batches past the agent's last (``end.seq``, -1 for
        none) in the life the agent names (or in none: the batches named no epoch): the
        agent saw every batch its engine published before it answered, so those were
        forged (a seq 0 on a worker whose engine had published nothing yet passes every
        seq rule)."""
        last = ingest.last_seq(worker_id, rank)
        return (
            end.epoch is not None
            and ingest.epoch(worker_id) in (None, end.epoch)
            and last is not None
            and last > end.seq
        )

    def _forget(
        self, ingest: EventIngest, worker_id: str, rank: int | None, epoch: str | None
    ) -> None:
        """Clear all the router knows of a worker (its seq spaces and blocks), keeping
        the engine life the agent named: the agent's batches from seq 0, or its dump,
        rebuild it (the resync's next round asks from 0). ``load_dump`` keeps the highest
        seq seen in the same life (batches newer than a dump still need a replay), here a
        forged one that no replay would ever fill: an empty dump under a life of no name
        first, then one under the agent's, leaves none."""
        with self._apply_lock:
            ingest.load_dump(worker_id, EPOCH_START_SEQ, [], dp_rank=rank, epoch="")
            ingest.load_dump(worker_id, EPOCH_START_SEQ, [], dp_rank=rank, epoch=epoch)

    async def _gap_fill(self, worker_id: str, from_seq: int) -> bool:
        """Fetch and apply batches from ``from_seq`` (or a dump); False if no full answer."""
        nc = self._nc
        assert nc is not None
        worker = self.registry.source(worker_id)
        if worker is None:
            return False
        ingest = worker.pool.ingest
        # the seq space the subject is pinned to; the answer's payloads may correct it
        rank = self._rank.get(worker_id)
        self.counts["replay_requests"] += 1
        dump: list[DecodedBatch] = []
        dump_seq: int | None = None
        # Batches are applied at the end message, with its epoch: a router that lost a
        # worker's state (it was down) must learn the epoch, or the next engine life's
        # seq 0.. would look like duplicates of the old one.
        batches: list[tuple[int, bytes]] = []
        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            try:
                subject = self.subjects.gap_fill(worker_id)
                await nc.publish(subject, GapFillRequest(from_seq).encode(), reply=inbox)
                while True:
                    msg = await sub.next_msg(timeout=self.replay_timeout)
                    if msg.headers and msg.headers.get("Status") == "503":
                        self.counts["replay_no_responders"] += 1
                        return False
                    m = GapFillMessage.decode(msg.data)
                    if m.kind == "batch":
                        self.counts["replayed_batches"] += 1
                        batches.append((m.seq, m.payload))
                    elif m.kind == "dump":
                        dump.append(decode(m.payload))
                        dump_seq = m.seq
                    else:
                        rank = self._agent_rank(worker_id, rank, batches, dump, m)
                        with self._apply_lock:
                            if self._new_empty_life(ingest, worker_id, m, batches):
                                ingest.apply(
                                    worker_id, EPOCH_START_SEQ, _CLEAR, dp_rank=rank, epoch=m.epoch
                                )
                            for seq, payload in batches:
                                ingest.apply(worker_id, seq, payload, dp_rank=rank, epoch=m.epoch)
                            if m.dump:
                                seq = m.seq if dump_seq is None else dump_seq
                                ingest.load_dump(worker_id, seq, dump, dp_rank=rank, epoch=m.epoch)
                        if m.dump:
                            self.counts["dumps_loaded"] += 1
                        elif self._ahead(ingest, worker_id, rank, m):
                            self.counts["ahead_of_agent"] += 1
                            self._forget(ingest, worker_id, rank, m.epoch)
                        return True
            finally:
                await sub.unsubscribe()
        except NatsTimeout:
            self.counts["replay_timeouts"] += 1
        except (CodecError, ValueError, KeyError, TypeError) as exc:
            self.counts["replay_malformed"] += 1
            bad_input.warning("replay for %s: bad message: %s", worker_id, exc)
        except Exception as exc:  # connection lost mid-replay: retried by the loop
            self.counts["replay_errors"] += 1
            bad_input.warning("replay for %s failed: %s", worker_id, exc)
        return False
