"""Router replicas share their in-flight load and predict-on-route marks over NATS.

Every ``interval`` seconds a replica publishes on ``<prefix>.route.<replica_id>`` what
changed since its last message: per worker, its own in-flight requests, in-flight
prefill tokens and decode streams, and the blocks it predicted on a worker since. Peers
add the numbers to their load counters (``WorkerLoad.add_peer``) and apply the marks to
their index with the sender's TTL, so a burst spread over replicas is counted once and
sibling requests that reach different replicas before any ``BlockStored`` still meet.

Rows carry absolute numbers, not per-request begin/finish events: a lost, duplicated or
late message cannot skew a count for good, since the next row for that worker replaces
it, and a full message every ``peer_ttl / 3`` seconds resends all rows. A peer silent
for ``peer_ttl`` seconds (it died, or NATS is away and each replica routes on its own)
has its rows taken back.

A replica that has heard from no peer sends only its full message every ``peer_ttl / 3``
seconds, and sends at once when a first peer appears (what the peer needs is a full
message either way): polling its rows every 5 ms for nobody cost a router with NATS,
alone (``processes`` 1, the usual case), 27 ms of CPU a second idle on 2 workers (226
wakes a second), ~40 % of its idle burn.

Message, msgpack ``[1, replica_id, full, rows, marks]``:
  rows   ``[[worker_id, requests, prefill_tokens, decode_streams], ...]``; when ``full``
         they cover every worker of the sender, and any left out has nothing from it.
  marks  ``[[worker_id, ttl_seconds, block hashes as little-endian u64 bytes], ...]``
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import sys
import time
from array import array
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgpack
from nats.aio.client import Client
from nats.aio.msg import Msg

from index.wire import DEFAULT_PREFIX, ROUTE_VERSION, Subjects
from router.config import RouterConfig
from router.events.bus import Bus
from router.workers.load import WorkerLoad
from router.workers.registry import WorkerRegistry

log = logging.getLogger(__name__)

VERSION = ROUTE_VERSION
MAX_MARK_BLOCKS = 1 << 16  # longer predictions are cut (a 1M-token prompt at block 16)
MAX_PENDING_MARKS = 10_000  # marks waiting for the next message; older ones are dropped
MAX_TTL = 3600.0
_MAX_COUNT = 1 << 40
_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


def default_replica_id() -> str:
    """``<host>-<pid>-<random>``: unique per process, readable in logs."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:32] or "host"
    return f"{host}-{os.getpid()}-{os.urandom(2).hex()}"


def valid_replica_id(replica_id: str) -> bool:
    """One NATS subject token: no dots, spaces or wildcards."""
    return bool(_TOKEN.fullmatch(replica_id))


def pack_hashes(hashes: Sequence[int]) -> bytes:
    a = array("Q", hashes[:MAX_MARK_BLOCKS])
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack_hashes(data: bytes) -> list[int]:
    if len(data) % 8 or len(data) > 8 * MAX_MARK_BLOCKS:
        raise ValueError(f"hash block of {len(data)} bytes")
    a = array("Q")
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


class _Peer:
    __slots__ = ("rows", "seen")

    def __init__(self, now: float) -> None:
        self.seen = now
        # worker id -> (the WorkerLoad the counts were added to, requests, prefill, decode)
        self.rows: dict[str, tuple[WorkerLoad, int, int, int]] = {}


class ReplicaShare:
    """Publishes this replica's load and marks; applies its peers'."""

    def __init__(
        self,
        registry: WorkerRegistry,
        bus: Bus,
        *,
        prefix: str = DEFAULT_PREFIX,
        replica_id: str | None = None,
        interval: float = 0.005,
        peer_ttl: float = 3.0,
        accept_marks: bool = True,
    ) -> None:
        self.registry = registry
        self.bus = bus
        self.id = replica_id or default_replica_id()
        if not valid_replica_id(self.id):
            raise ValueError(f"replica_id {self.id!r}: use letters, digits, '-' and '_' only")
        self.subject = Subjects(prefix).route(self.id)
        self.wildcard = Subjects(prefix).all_routes
        self.interval = interval
        self.peer_ttl = peer_ttl
        self.accept_marks = accept_marks  # a replica that does not predict takes no marks
        self.counts: Counter[str] = Counter()
        self._peers: dict[str, _Peer] = {}
        self._sent: dict[str, tuple[int, int, int]] = {}
        self._marks: list[list[Any]] = []
        self._next_full = 0.0
        self._task: asyncio.Task[None] | None = None
        self._peer_came = asyncio.Event()  # wakes a sender that has no peer to tell

    @classmethod
    def from_config(
        cls, cfg: RouterConfig, registry: WorkerRegistry, bus: Bus | None
    ) -> ReplicaShare | None:
        """The configured sharing, or None without NATS or with ``share_interval`` 0."""
        if bus is None or cfg.share_interval <= 0:
            return None
        return cls(
            registry,
            bus,
            prefix=cfg.subject_prefix,
            replica_id=cfg.replica_id,
            interval=cfg.share_interval,
            peer_ttl=cfg.peer_ttl,
            accept_marks=cfg.predict_ttl > 0,
        )

    # -- wiring ------------------------------------------------------------------
    async def attach(self, nc: Client) -> None:
        """Bus on-connect hook: listen to the peers and start publishing."""
        await nc.subscribe(self.wildcard, cb=self._on_message)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="replica-share")

    async def on_reconnect(self, _nc: Client) -> None:
        self._next_full = 0.0  # peers may have dropped our rows meanwhile

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for peer_id in list(self._peers):
            self._drop_peer(peer_id)

    def mark(self, worker_id: str, hashes: Sequence[int], ttl: float) -> None:
        """Share a predict-on-route mark with the next message."""
        if len(self._marks) >= MAX_PENDING_MARKS:
            self._marks.pop(0)
            self.counts["route_marks_dropped"] += 1
        self._marks.append([worker_id, ttl, pack_hashes(hashes)])

    def peers(self) -> dict[str, dict[str, tuple[int, int, int]]]:
        """Per live peer, the counts it has on each worker (for admin and tests)."""
        return {
            pid: {w: row[1:] for w, row in peer.rows.items()} for pid, peer in self._peers.items()
        }

    # -- publishing --------------------------------------------------------------
    async def _run(self) -> None:
        heartbeat = self.peer_ttl / 3
        while True:
            if self._peers:
                await asyncio.sleep(self.interval)
            else:  # nobody hears the changes: the next full message, or a first peer
                self._peer_came.clear()
                wait = max(self._next_full - time.monotonic(), self.interval)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._peer_came.wait()
                if not self._peers:
                    self._marks.clear()  # no peer would apply them
            now = time.monotonic()
            if now >= self._next_full:
                self._expire(now)
            if not self.bus.connected:
                self._next_full = 0.0
                self._marks.clear()  # stale by the time NATS is back
                continue
            full = now >= self._next_full
            rows = self._rows(full)
            if not (rows or self._marks or full):
                continue
            marks, self._marks = self._marks, []
            payload = msgpack.packb([VERSION, self.id, full, rows, marks])
            try:
                sent = await self.bus.publish(self.subject, payload)
            except Exception as exc:  # connection closing under us: resend all next time
                log.debug("route message not sent: %s", exc)
                sent = False
            if sent:
                self.counts["route_published"] += 1
                if full:
                    self._next_full = now + heartbeat
            else:
                self.counts["route_unsent"] += 1
                self._next_full = 0.0

    def _rows(self, full: bool) -> list[list[Any]]:
        rows: list[list[Any]] = []
        present = set()
        for worker in self.registry:
            # a DP worker's load is per rank (router/workers/dp.py), each row one target
            loads = zip(worker.targets, worker.rank_loads or [worker.load], strict=True)
            for tid, load in loads:
                present.add(tid)
                own = load.own()
                if full or self._sent.get(tid) != own:
                    self._sent[tid] = own
                    rows.append([tid, *own])
        for wid in [w for w in self._sent if w not in present]:
            del self._sent[wid]
            if not full:
                rows.append([wid, 0, 0, 0])
        return rows

    # -- receiving ---------------------------------------------------------------
    async def _on_message(self, msg: Msg) -> None:
        try:
            version, sender, full, rows, marks = msgpack.unpackb(msg.data)
            if version != VERSION or not isinstance(sender, str):
                raise ValueError(f"version {version!r}")
            if sender == self.id:
                return
            parsed_rows = [_row(r) for r in rows]
            parsed_marks = [_mark(m) for m in marks]
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            self.counts["route_malformed"] += 1
            log.debug("bad route message on %s: %s", msg.subject, exc)
            return
        now = time.monotonic()
        peer = self._peers.get(sender)
        if peer is None:
            peer = self._peers[sender] = _Peer(now)
            log.info("replica %s: sharing load with peer %s", self.id, sender)
            self._next_full = 0.0  # it has none of our rows yet
            self._peer_came.set()
        peer.seen = now
        for wid, counts in parsed_rows:
            self._set(peer, wid, counts)
        if full:
            listed = {wid for wid, _ in parsed_rows}
            for wid in [w for w in peer.rows if w not in listed]:
                self._set(peer, wid, (0, 0, 0))
        self.counts["route_received"] += 1
        if self.accept_marks:
            self._apply_marks(parsed_marks)

    def _set(self, peer: _Peer, wid: str, counts: tuple[int, int, int]) -> None:
        old = peer.rows.pop(wid, None)
        if old is not None:
            old[0].add_peer(-old[1], -old[2], -old[3])
        found = self.registry.target(wid)
        if found is not None and any(counts):
            load = found[0].rank_load(found[1])
            load.add_peer(*counts)
            peer.rows[wid] = (load, *counts)

    def _apply_marks(self, marks: list[tuple[str, float, list[int]]]) -> None:
        for wid, ttl, hashes in marks:
            worker = self.registry.source(wid)
            if worker is None or not hashes:
                self.counts["route_marks_unknown_worker"] += 1
                continue
            worker.pool.index.predict(wid, hashes, ttl)
            self.counts["route_marks_applied"] += 1

    def _expire(self, now: float) -> None:
        for peer_id in [p for p, peer in self._peers.items() if now - peer.seen > self.peer_ttl]:
            log.warning("replica %s: peer %s went silent; dropping its load", self.id, peer_id)
            self.counts["route_peers_expired"] += 1
            self._drop_peer(peer_id)

    def _drop_peer(self, peer_id: str) -> None:
        peer = self._peers.pop(peer_id)
        for wid in list(peer.rows):
            self._set(peer, wid, (0, 0, 0))


def _row(raw: Any) -> tuple[str, tuple[int, int, int]]:
    wid, requests, prefill, decode = raw
    counts = (requests, prefill, decode)
    if not isinstance(wid, str) or not all(
        isinstance(c, int) and not isinstance(c, bool) and 0 <= c < _MAX_COUNT for c in counts
    ):
        raise ValueError(f"bad row {raw!r}")
    return wid, counts


def _mark(raw: Any) -> tuple[str, float, list[int]]:
    wid, ttl, hashes = raw
    if not (isinstance(wid, str) and isinstance(ttl, int | float) and isinstance(hashes, bytes)):
        raise ValueError("bad mark")
    if not 0 < ttl <= MAX_TTL:
        raise ValueError(f"mark ttl {ttl!r}")
    return wid, float(ttl), unpack_hashes(hashes)
