"""Response affinity: which engine stored which Responses-API response.

vLLM keeps a stored response (and the messages behind it) in the memory of the engine
that made it, so a request with ``previous_response_id`` can only be served there: any
other engine answers 404. The router remembers ``response id -> worker`` for every
response it passed through (bounded, least recently used dropped first) and sends the
follow-up back; a response id it does not know (a restart, an eviction) is routed like
any request and the engine decides.

Replicas share what they learn: each new id goes out on
``<prefix>.responses.<replica_id>`` as msgpack ``[1, replica_id, [[response_id,
worker_id], ...]]`` (batched per ``interval``), so a follow-up that reaches another
replica still finds its engine. A follow-up sent within that interval of the first
answer may reach a replica that has not heard yet; it is routed normally.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from index.wire import Subjects

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from router.events.bus import Bus

log = logging.getLogger(__name__)

VERSION = 1
MAX_ENTRIES = 200_000  # ~40 MB at worst; an agent session is a handful of ids
MAX_ID = 256  # bytes of a response id kept; longer ones are not remembered
MAX_BATCH = 1000  # ids per message
_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')
_WORKER = re.compile(r"[A-Za-z0-9_-]{1,128}")


def response_id(head: bytes) -> str | None:
    """The response id at the start of a Responses body (its first ``"id"``: the JSON
    object's own, or the ``response.created`` event's ``response.id``)."""
    found = _ID.search(head)
    return found.group(1).decode("utf-8", "replace") if found else None


class ResponseAffinity:
    """``response id -> worker id``, bounded, optionally shared with peer replicas."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._where: OrderedDict[str, str] = OrderedDict()
        self._pending: list[list[str]] = []
        self.counts: Counter[str] = Counter()
        self.bus: Bus | None = None
        self.subject = ""
        self.wildcard = ""
        self.replica_id = ""
        self.interval = 0.005
        self._task: asyncio.Task[None] | None = None
        # set when an id waits to be shared: the sender sleeps on it, not on a 5 ms poll
        # (200 wake-ups a second, idle or not, in every replica)
        self._wake = asyncio.Event()

    def __len__(self) -> int:
        return len(self._where)

    def remember(self, rid: str, worker_id: str, share: bool = True) -> None:
        if len(rid) > MAX_ID:
            self.counts["affinity_id_too_long"] += 1
            return
        self._where[rid] = worker_id
        self._where.move_to_end(rid)
        while len(self._where) > self.max_entries:
            self._where.popitem(last=False)
            self.counts["affinity_evicted"] += 1
        if share and self.bus is not None:
            if len(self._pending) >= 10 * MAX_BATCH:
                self._pending.pop(0)
                self.counts["affinity_unshared"] += 1
            self._pending.append([rid, worker_id])
            self._wake.set()

    def remembers(self, worker_id: str) -> Callable[[bytes], None]:
        """What the proxy calls with an answer's first bytes: their response id is
        remembered as stored on ``worker_id``."""

        def found(head: bytes) -> None:
            rid = response_id(head)
            if rid is not None:
                self.remember(rid, worker_id)
            else:
                self.counts["affinity_no_id"] += 1

        return found

    def lookup(self, rid: str) -> str | None:
        worker = self._where.get(rid)
        if worker is not None:
            self._where.move_to_end(rid)
        return worker

    # -- sharing ---------------------------------------------------------------------
    def share(self, bus: Bus, prefix: str, replica_id: str, interval: float) -> None:
        """Publish new ids to peers and take theirs (wired by the app when NATS is on)."""
        subjects = Subjects(prefix)
        self.bus = bus
        self.replica_id = replica_id
        self.subject = subjects.responses(replica_id)
        self.wildcard = subjects.all_responses
        self.interval = max(interval, 0.001)

    async def attach(self, nc: Client) -> None:
        await nc.subscribe(self.wildcard, cb=self._on_message)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="response-affinity")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        assert self.bus is not None
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.interval)  # the interval's later ids go in this message
            self._wake.clear()
            if not self._pending:
                continue
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            if self._pending:
                self._wake.set()  # the rest in the next message, an interval later
            payload = msgpack.packb([VERSION, self.replica_id, batch])
            try:
                sent = await self.bus.publish(self.subject, payload)
            except Exception as exc:  # closing under us: these ids stay local
                log.debug("response affinity not shared: %s", exc)
                sent = False
            self.counts["affinity_published" if sent else "affinity_unshared"] += 1

    async def _on_message(self, msg: Msg) -> None:
        try:
            version, sender, entries = msgpack.unpackb(msg.data)
            if version != VERSION or not isinstance(entries, list):
                raise ValueError(f"version {version!r}")
            if sender == self.replica_id:
                return
            parsed = [_entry(e) for e in entries[:MAX_BATCH]]
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            self.counts["affinity_malformed"] += 1
            log.debug("bad response-affinity message on %s: %s", msg.subject, exc)
            return
        for rid, wid in parsed:
            self.remember(rid, wid, share=False)
        self.counts["affinity_received"] += 1


def _entry(raw: Any) -> tuple[str, str]:
    rid, wid = raw
    if not (isinstance(rid, str) and 0 < len(rid) <= MAX_ID and isinstance(wid, str)):
        raise ValueError("bad entry")
    if not _WORKER.fullmatch(wid):
        raise ValueError("bad worker id")
    return rid, wid
