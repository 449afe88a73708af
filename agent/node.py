"""The node agent's I/O shell: engine ZMQ -> ``AgentCore`` -> NATS, and back.

One task reads the engine's PUB socket and, on a gap, asks the engine's replay socket
for the missing batches before going on, so batches reach NATS in seq order. NATS
callbacks answer replay requests from the core, queue prefetch hints and tell peer
agents the tokens of blocks their engines want to prefetch (``<prefix>.blocks.<id>``);
another task scrapes ``/metrics`` into load reports. Nothing here raises out of a loop: bad frames,
failed publishes and unreachable engines are counted and logged.

Batches go out as plain NATS publishes; the JetStream stream on ``<prefix>.events.>``
(``router.events.jetstream``), which the agent creates when missing, keeps them for routers
that start later. No publish waits for a stream ack: a batch the stream misses is
replayed to the router that notices the ``Kv-Seq`` gap, so an ack would only slow the
engine's event path (and a server without JetStream works the same).

A restarted engine is found again on any endpoint, ``ipc://`` included: vLLM's new
process unlinks the socket file and binds a new one (a new inode), and libzmq retries
``connect()`` on the path every reconnect interval (100 ms), which reaches the new
listener. Measured with vLLM 0.32 (CPU): connected again before its HTTP server was up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
import nats
import orjson
import zmq
import zmq.asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from zmq.utils.monitor import parse_monitor_message

from agent.core import Accepted, AgentCore, Verdict
from agent.engine_zmq import fetch_replay, parse_live
from agent.load import parse_load
from agent.prefetch import PrefetchForwarder
from index.codec import AllBlocksCleared, EventBatch, encode, hash_from_json
from index.gapfill import GapFillMessage, GapFillRequest
from index.wire import (
    DEFAULT_MAX_AGE,
    DEFAULT_MAX_BYTES,
    DEFAULT_PREFIX,
    DEFAULT_STREAM,
    DP_RANK_HEADER,
    EPOCH_HEADER,
    EPOCH_START_SEQ,
    SEQ_HEADER,
    Subjects,
    worker_id_error,
)
from router.events.bus import nats_options, subscriptions_in_place
from router.events.jetstream import StreamSpec
from router.events.jetstream import ensure_stream as ensure_event_stream
from router.observe.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
bad_input = RateLimitedLog(log)  # what peers send: one line per 10 s, with a count


@dataclass(slots=True)
class AgentConfig:
    worker_id: str
    zmq_endpoint: str
    nats_url: str
    engine_url: str | None = None  # for /metrics and (mock engine) /prefetch
    replay_endpoint: str | None = None
    subject_prefix: str = DEFAULT_PREFIX
    prefetch_hook: str | None = None  # a real engine's prefetch endpoint
    load_interval: float = 1.0
    buffer: int = 10_000
    topic: str = ""
    replay_timeout: float = 1.0  # seconds without a reply before a replay gives up
    connect_warn_after: float = 10.0  # seconds unconnected to the engine's PUB before a warning
    # NATS credentials and TLS, as the router's config has them (router.events.bus.nats_options)
    nats_user: str | None = None
    nats_password: str | None = None
    nats_token: str | None = None
    nats_credentials: str | None = None
    nats_tls_ca: str | None = None
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None
    events_stream: str | None = DEFAULT_STREAM  # created if missing; None: leave streams alone
    events_max_age: float = DEFAULT_MAX_AGE
    events_max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        # the router refuses such an id (router.config): an agent publishing under it would
        # speak on other workers' subjects or be cut off by the server's control-line limit
        problem = worker_id_error(self.worker_id)
        if problem is not None:
            raise ValueError(problem)


class NodeAgent:
    """Runs beside one engine. ``async with NodeAgent(cfg):`` or ``start``/``stop``."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.core = AgentCore(cfg.buffer)
        self.counters: Counter[str] = Counter()
        hook = cfg.prefetch_hook or (cfg.engine_url and cfg.engine_url.rstrip("/") + "/prefetch")
        self.prefetch = PrefetchForwarder(hook or None, resolve=self._resolve_tokens)
        self.nc: NATS | None = None
        self._ctx = zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._http: httpx.AsyncClient | None = None
        self._suspect_restart = False
        self.engine_connected = False  # the SUB socket reaches the engine's PUB socket
        self._engine_lock = asyncio.Lock()  # one engine-event handler at a time
        self._stopping = False
        self._last: Accepted | None = None  # the newest batch, published or not
        self.subjects = subjects = Subjects(cfg.subject_prefix)
        self.events_subject = subjects.events(cfg.worker_id)
        self.replay_subject = subjects.gap_fill(cfg.worker_id)
        self.prefetch_subject = subjects.prefetch(cfg.worker_id)
        self.load_subject = subjects.load(cfg.worker_id)
        self.blocks_subject = subjects.blocks(cfg.worker_id)

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> NodeAgent:
        """Connect to NATS (waiting for it to come up) and the engine, then run."""
        self._http = httpx.AsyncClient(timeout=5.0)
        await self.prefetch.start()
        self.nc = await self._connect_nats()
        await self._ensure_stream()
        await self.nc.subscribe(self.replay_subject, cb=self._on_replay)
        await self.nc.subscribe(self.prefetch_subject, cb=self._on_prefetch)
        await self.nc.subscribe(self.blocks_subject, cb=self._on_blocks)
        # not flush(): it can return before the SUBs reach the server (see the helper)
        await subscriptions_in_place(self.nc)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop here: the engine's replay is bounded
        sub.setsockopt(zmq.SUBSCRIBE, self.cfg.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        sub.connect(self.cfg.zmq_endpoint)
        self._sub = sub
        self._spawn(self._zmq_loop(), "zmq-events")
        self._spawn(self._monitor_loop(monitor), "zmq-monitor")
        self._spawn(self._watch_connection(), "zmq-watch")
        if self.cfg.engine_url and self.cfg.load_interval > 0:
            self._spawn(self._load_loop(), "load-report")
        return self

    async def stop(self) -> None:
        self._stopping = True
        if self._sub is not None:
            # First, while the monitor socket is still open and read: see _monitor_loop.
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.prefetch.stop()
        if self.nc is not None:
            with contextlib.suppress(Exception):  # closing a half-dead connection
                await self.nc.drain()
            self.nc = None
        self._sub = None
        if self._http is not None:
            await self._http.aclose()
        self._ctx.destroy(linger=0)
        log.info("agent %s stopped: %s", self.cfg.worker_id, dict(self.stats()))

    async def __aenter__(self) -> NodeAgent:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def stats(self) -> Counter[str]:
        """Every counter: core (batches, restarts, lost...), I/O and prefetch."""
        out = Counter(self.core.counters)
        out.update(self.counters)
        out.update({f"prefetch_{k}": v for k, v in self.prefetch.counters.items()})
        return out

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def _connect_nats(self) -> NATS:
        # nats-py keeps retrying the first connection too (every ``reconnect_time_wait``
        # seconds, each failure reported to ``error_cb``), and reconnects and
        # re-subscribes after a lost connection; a bad URL still fails at once.
        return await nats.connect(
            self.cfg.nats_url,
            name=f"cache-router-agent-{self.cfg.worker_id}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=1,
            error_cb=self._on_nats_error,
            disconnected_cb=self._on_nats_disconnect,
            reconnected_cb=self._on_nats_reconnect,
            **nats_options(self.cfg),
        )

    async def _on_nats_reconnect(self) -> None:
        """A server that lost its store lost the stream too; and a router that resynced
        before we were back missed what we could not publish: the newest batch again
        shows it the gap (a router that has it ignores the duplicate)."""
        await self._ensure_stream()
        last = self._last
        if last is not None:
            await self._publish(last)
            self.counters["republished"] += 1

    async def _ensure_stream(self) -> None:
        cfg = self.cfg
        if cfg.events_stream is None or self.nc is None:
            return
        spec = StreamSpec(
            cfg.events_stream, cfg.subject_prefix, cfg.events_max_age, cfg.events_max_bytes
        )
        try:
            await ensure_event_stream(self.nc, spec)
        except Exception as exc:  # no JetStream, or not ready yet: live events still flow
            self.counters["stream_unavailable"] += 1
            log.warning("event stream %s not ensured: %s", cfg.events_stream, exc)

    async def _on_nats_error(self, exc: Exception) -> None:
        self.counters["nats_errors"] += 1
        log.warning("NATS error: %s", exc)

    async def _on_nats_disconnect(self) -> None:
        if self._stopping:
            return
        self.counters["nats_disconnects"] += 1
        log.warning("NATS disconnected; reconnecting")

    # -- engine events -------------------------------------------------------------
    async def _zmq_loop(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            parsed = parse_live(frames)
            if parsed is None:
                self.counters["bad_frames"] += 1
                bad_input.warning("not a KV-event message: %d frames", len(frames))
                continue
            try:
                await self._on_batch(*parsed)
            except Exception:  # one bad batch must not stop the stream
                self.counters["internal_errors"] += 1
                log.exception("failed to handle engine batch %d", parsed[0])

    async def _monitor_loop(self, monitor: zmq.asyncio.Socket) -> None:
        """Whatever the engine published before a (re)connect is lost to the SUB socket
        (PUB/SUB slow joiner), and a dropped connection may be a restart, maybe one that
        keeps seqs rising. So on every connect, ask the engine's replay socket rather
        than wait for a next batch that a quiet engine may never send.

        The monitor socket stays open and read until ``stop`` has disabled the monitor.
        libzmq's I/O thread sends each monitor event with a blocking send, holding the
        socket's monitor lock: with this end closed, the next connect or disconnect
        blocks that thread for good, and with it every socket of the context; then
        ``disable_monitor`` waits for the lock while holding the GIL, and the process
        hangs where no timeout can fire (pyzmq #1020; seen here in ``stop`` after an
        engine restart, about 1 run in 8 of tests/test_quiet_restart.py, and it hung
        CI). So one bad event is counted, never the end of this loop, and the socket is
        closed by the context's ``destroy`` in ``stop``, after the monitor is disabled."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            try:
                await self._on_monitor_event(event["event"])
            except Exception:
                self.counters["internal_errors"] += 1
                log.exception("failed to handle engine connection event %s", event)

    async def _on_monitor_event(self, kind: int) -> None:
        if kind == zmq.EVENT_DISCONNECTED:
            self._suspect_restart = True
            self.engine_connected = False
        elif kind == zmq.EVENT_CONNECTED:
            self.engine_connected = True
            async with self._engine_lock:
                await self._check_restart()
                await self._catch_up()

    async def _watch_connection(self) -> None:
        """Two things a quiet engine would never bring up by itself, checked each second.

        A restart suspected at a reconnect whose replay check got no answer (the new
        engine's replay socket was not serving yet) is asked again until it is answered.
        And an engine PUB socket that cannot be reached is reported: otherwise no event
        ever arrives and nothing tells. vLLM binds its PUB socket only for a wildcard
        (``tcp://*:P``) or ``ipc://`` endpoint and *connects* to any other, so with
        ``tcp://127.0.0.1:P`` on both sides nobody listens."""
        wait = self.cfg.connect_warn_after
        unconnected = 0.0
        while True:
            await asyncio.sleep(1.0)
            if self.engine_connected:
                unconnected = 0.0
                wait = self.cfg.connect_warn_after
                if self._suspect_restart:
                    async with self._engine_lock:
                        await self._check_restart()
                        await self._catch_up()
                continue
            unconnected += 1.0
            if unconnected < wait:
                continue
            self.counters["engine_unreachable_warnings"] += 1
            log.warning(
                "agent %s: no connection to the engine's KV-event endpoint %s after %.0f s; "
                "no events will arrive. Is the engine up, with KV events on? vLLM binds "
                "its publisher only for a wildcard endpoint (tcp://*:PORT) or ipc://: with "
                "tcp://HOST:PORT it connects too, and nobody listens",
                self.cfg.worker_id,
                self.cfg.zmq_endpoint,
                unconnected,
            )
            wait = min(wait * 2, 300.0)

    async def _check_restart(self) -> None:
        """After a reconnect: a new engine life starts a new epoch."""
        if not self._suspect_restart or self.core.last_seq is None:
            self._suspect_restart = False
            return
        restarted = await self._engine_restarted()
        if restarted is None:
            return  # no answer yet: the next batch asks again
        self._suspect_restart = False
        if restarted:
            self.counters["restarts_found_by_replay"] += 1
            self.core.restart()
            await self._publish_epoch_start()

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        async with self._engine_lock:
            await self._on_batch_locked(seq, payload)

    async def _on_batch_locked(self, seq: int, payload: bytes) -> None:
        core = self.core
        if core.last_seq is not None and seq > core.last_seq:
            await self._check_restart()
        self._suspect_restart = False
        verdict = core.classify(seq, payload)
        if verdict is Verdict.RESTART:
            core.restart()
            verdict = core.classify(seq, payload)
        if verdict is Verdict.GAP:
            self.counters["engine_gaps"] += 1
            await self._catch_up()
            verdict = core.classify(seq, payload)
        if verdict is Verdict.DUPLICATE:
            self.counters["duplicates"] += 1
            return
        if verdict is Verdict.RESTART:  # the engine's replay disagreed with its live stream
            core.restart()
        await self._publish(core.accept(seq, payload))

    async def _catch_up(self) -> None:
        """Accept every batch the engine's replay socket holds from ``expected`` on."""
        if not self.cfg.replay_endpoint:
            return
        batches, _ = await fetch_replay(
            self._ctx,
            self.cfg.replay_endpoint,
            self.core.expected,
            idle_timeout=self.cfg.replay_timeout,
        )
        for seq, payload in batches:
            if seq >= self.core.expected:
                await self._publish(self.core.accept(seq, payload))

    async def _engine_restarted(self) -> bool | None:
        """After a reconnect: does the engine still hold our last batch, byte for byte?
        None when the engine's replay socket does not answer (cannot tell)."""
        last = self.core.last_seq
        if not self.cfg.replay_endpoint or last is None:
            return False
        batches, complete = await fetch_replay(
            self._ctx, self.cfg.replay_endpoint, last, idle_timeout=self.cfg.replay_timeout
        )
        if not complete:
            return None
        return not batches or batches[0] != (last, self.core.ring.get(last))

    async def _publish_epoch_start(self) -> None:
        """Tell routers now that the engine restarted (its next batch may be far off): an
        ``AllBlocksCleared`` under the new epoch, ``Kv-Seq`` ``EPOCH_START_SEQ``."""
        core = self.core
        payload = encode(EventBatch(time.time(), [AllBlocksCleared()], core.dp_rank))
        await self._publish(Accepted(EPOCH_START_SEQ, payload, core.epoch, core.dp_rank))
        self.counters["epoch_starts_published"] += 1

    async def _publish(self, acc: Accepted | None) -> None:
        if acc is None:
            return
        self._last = acc
        headers = {SEQ_HEADER: str(acc.seq), EPOCH_HEADER: acc.epoch}
        if acc.dp_rank is not None:
            headers[DP_RANK_HEADER] = str(acc.dp_rank)
        try:
            assert self.nc is not None
            await self.nc.publish(self.events_subject, acc.payload, headers=headers)
            self.counters["published"] += 1
        except Exception as exc:  # disconnected with a full buffer, payload too big...
            self.counters["publish_failed"] += 1
            log.warning("batch %d not published (%s); routers can replay it", acc.seq, exc)

    # -- NATS requests -------------------------------------------------------------
    async def _on_replay(self, msg: Msg) -> None:
        if not msg.reply:
            self.counters["bad_replay_requests"] += 1
            return
        try:
            request = GapFillRequest.decode(msg.data)
        except (ValueError, orjson.JSONDecodeError) as exc:
            self.counters["bad_replay_requests"] += 1
            bad_input.warning("bad replay request: %s", exc)
            replies = [GapFillMessage("end", -1, epoch=self.core.epoch)]
        else:
            try:
                replies = self.core.gap_fill(request.from_seq)  # one consistent snapshot
            except Exception:  # a bug must still answer, or the router waits out a timeout
                self.counters["replay_errors"] += 1
                log.exception("replay from seq %d failed", request.from_seq)
                replies = [GapFillMessage("end", -1, epoch=self.core.epoch)]
        try:
            assert self.nc is not None
            for reply in replies:
                await self.nc.publish(msg.reply, reply.encode())
        except Exception as exc:
            self.counters["replay_publish_failed"] += 1
            log.warning("replay reply failed: %s", exc)

    async def _on_prefetch(self, msg: Msg) -> None:
        self.prefetch.submit(msg.data)

    async def _on_blocks(self, msg: Msg) -> None:
        """A peer agent asks for the tokens of blocks (to hand a prefetch to its engine)."""
        try:
            hashes = orjson.loads(msg.data)["block_hashes"]
            if not isinstance(hashes, list):
                raise ValueError("block_hashes must be a list of ints or hex strings")
            tokens = self.core.mirror.tokens_of([hash_from_json(h) for h in hashes])
        except (ValueError, KeyError, TypeError) as exc:
            self.counters["bad_blocks_requests"] += 1
            bad_input.warning("bad blocks request: %s", exc)
            tokens = []
        if msg.reply:
            with contextlib.suppress(Exception):  # the asker gave up or NATS is down
                await self.nc.publish(msg.reply, orjson.dumps({"token_ids": tokens}))  # type: ignore[union-attr]

    async def _resolve_tokens(self, hint: dict[str, object]) -> bool:
        """Add ``token_ids`` to a hint from the source worker's agent (its mirror)."""
        source = hint.get("source_worker")
        hashes = hint["block_hashes"]
        if not isinstance(source, str) or not isinstance(hashes, list) or self.nc is None:
            return False
        if source == self.cfg.worker_id:
            tokens = self.core.mirror.tokens_of([hash_from_json(h) for h in hashes])
        else:
            subject = self.subjects.blocks(source)
            reply = await self.nc.request(subject, orjson.dumps({"block_hashes": hashes}), 1.0)
            tokens = orjson.loads(reply.data).get("token_ids") or []
        if not tokens:
            return False
        hint["token_ids"] = tokens
        return True

    # -- load ----------------------------------------------------------------------
    async def _load_loop(self) -> None:
        assert self._http is not None and self.cfg.engine_url
        url = self.cfg.engine_url.rstrip("/") + "/metrics"
        while True:
            try:
                resp = await self._http.get(url)
                resp.raise_for_status()
                report = parse_load(resp.text)
            except (httpx.HTTPError, ValueError) as exc:
                self.counters["load_scrape_failed"] += 1
                log.debug("load scrape of %s failed: %s", url, exc)
            else:
                try:
                    assert self.nc is not None
                    await self.nc.publish(self.load_subject, orjson.dumps(report.to_json()))
                    self.counters["load_published"] += 1
                except Exception as exc:
                    self.counters["publish_failed"] += 1
                    log.warning("load report not published: %s", exc)
            await asyncio.sleep(self.cfg.load_interval)
