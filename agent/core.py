"""The agent's synchronous core: engine seq order, epochs, ring buffer, mirror, replies.

No sockets here. The async shell (``agent.node``) feeds engine batches in, asks the
engine's replay socket when :meth:`AgentCore.classify` reports a gap, and publishes
what :meth:`AgentCore.accept` returns; routers' replay requests are answered by
:meth:`AgentCore.replay` from state that is consistent as of one seq.

An *epoch* is one life of the engine. Engine seqs restart at 0 with the process, so a
seq at or below the last one that is not a byte-identical re-delivery means a new
engine: the agent starts a new epoch and forgets the old one's batches and blocks.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from agent.mirror import EngineMirror
from agent.ring import RingBuffer
from index.codec import CodecError, decode
from index.gapfill import GapFillMessage

log = logging.getLogger(__name__)


def new_epoch() -> str:
    return uuid.uuid4().hex[:16]


class Verdict(StrEnum):
    NEXT = "next"  # the batch right after the last one: accept it
    DUPLICATE = "duplicate"  # already accepted (replay and live stream overlap): drop it
    GAP = "gap"  # batches before it are missing: fetch them from ``expected`` first
    RESTART = "restart"  # a new engine life: call ``restart`` and classify again


@dataclass(slots=True, frozen=True)
class Accepted:
    """A batch to publish on NATS (undecodable batches are never published)."""

    seq: int
    payload: bytes
    epoch: str
    dp_rank: int | None


class AgentCore:
    def __init__(
        self,
        buffer: int = 10_000,
        *,
        dump_chunk_tokens: int = 16384,
        epoch_factory: Callable[[], str] = new_epoch,
    ) -> None:
        self.ring = RingBuffer(buffer)
        self.mirror = EngineMirror()
        self.epoch_factory = epoch_factory
        self.epoch = epoch_factory()
        self.dump_chunk_tokens = dump_chunk_tokens
        self.last_seq: int | None = None
        self.dp_rank: int | None = None
        # False once a batch was lost for good: dumps may then miss blocks.
        self.complete = True
        self.counters: Counter[str] = Counter()

    @property
    def expected(self) -> int:
        return 0 if self.last_seq is None else self.last_seq + 1

    def classify(self, seq: int, payload: bytes) -> Verdict:
        if seq == self.expected:
            return Verdict.NEXT
        if seq > self.expected:
            return Verdict.GAP
        if self.ring.get(seq) == payload:
            return Verdict.DUPLICATE
        return Verdict.RESTART

    def restart(self) -> None:
        """Forget the previous engine life and start a new epoch."""
        self.counters["restarts"] += 1
        log.info("engine restart detected: epoch %s ends at seq %s", self.epoch, self.last_seq)
        self.epoch = self.epoch_factory()
        self.ring.clear()
        self.mirror.clear()
        self.last_seq = None
        self.complete = True

    def accept(self, seq: int, payload: bytes) -> Accepted | None:
        """Take the next batch in order; a seq past ``expected`` records the loss.

        Returns what to publish, or None for a batch that does not decode (counted
        and kept as a hole in the ring, so a replay across it becomes a dump).
        """
        if seq < self.expected:
            raise ValueError(f"seq {seq} is before the expected {self.expected}")
        if seq > self.expected:
            self.counters["lost_batches"] += seq - self.expected
            self.complete = False
            log.warning("engine batches %d..%d are lost for good", self.expected, seq - 1)
        self.last_seq = seq
        try:
            batch = decode(payload)
        except CodecError as exc:
            self.counters["bad_payloads"] += 1
            log.warning("undecodable engine batch at seq %d: %s", seq, exc)
            self.ring.append(seq, payload, ok=False)
            return None
        if batch.errors:
            self.counters["bad_events"] += sum(batch.errors.values())
        self.mirror.apply(batch)
        self.ring.append(seq, payload)
        if batch.dp_rank is not None:
            self.dp_rank = batch.dp_rank
        self.counters["batches"] += 1
        return Accepted(seq, payload, self.epoch, batch.dp_rank)

    def gap_fill(self, from_seq: int) -> list[GapFillMessage]:
        """The reply stream for a router's replay request, ending with ``end``.

        Batches from ``from_seq`` while the ring holds all of them; otherwise a dump of
        the mirror as of ``last_seq``. A ``from_seq`` beyond what this epoch has seen
        comes from another engine life, so it gets a dump too.
        """
        last = self.last_seq
        if last is None:  # nothing seen in this epoch: nothing to replay or dump
            return [GapFillMessage("end", -1, epoch=self.epoch)]
        batches = self.ring.since(from_seq) if from_seq <= last + 1 else None
        if batches is not None:
            self.counters["replays"] += 1
            msgs = [GapFillMessage("batch", s, p) for s, p in batches]
            return [*msgs, GapFillMessage("end", last, epoch=self.epoch)]
        self.counters["dumps"] += 1
        if not self.complete:
            self.counters["incomplete_dumps"] += 1
            log.warning("serving a dump after lost batches: it may miss blocks")
        chunks = self.mirror.dump(dp_rank=self.dp_rank, max_tokens=self.dump_chunk_tokens)
        msgs = [GapFillMessage("dump", last, c) for c in chunks]
        return [*msgs, GapFillMessage("end", last, epoch=self.epoch, dump=True)]
