"""The agent's ring buffer of recent engine batches, exactly as the engine sent them.

It answers "every batch from seq N" while N is still held. Batches that could not be
decoded are kept as holes: a replay across a hole cannot be served batch by batch, so
the caller falls back to a full dump instead of handing the router a batch it cannot
apply (which would make it ask for the same bad batch again).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Entry:
    seq: int
    payload: bytes
    ok: bool  # False: undecodable, never published


class RingBuffer:
    """The last ``capacity`` batches by engine seq, in arrival (= seq) order."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"ring buffer capacity must be positive, got {capacity}")
        self._entries: deque[Entry] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def oldest(self) -> int | None:
        return self._entries[0].seq if self._entries else None

    @property
    def newest(self) -> int | None:
        return self._entries[-1].seq if self._entries else None

    def append(self, seq: int, payload: bytes, *, ok: bool = True) -> None:
        if self._entries and seq <= self._entries[-1].seq:
            raise ValueError(f"seq {seq} is not after {self._entries[-1].seq}")
        self._entries.append(Entry(seq, payload, ok))

    def clear(self) -> None:
        self._entries.clear()

    def get(self, seq: int) -> bytes | None:
        """The payload stored for ``seq`` (good or bad), or None."""
        idx = self._index(seq)
        return None if idx is None else self._entries[idx].payload

    def since(self, seq: int) -> list[tuple[int, bytes]] | None:
        """Every batch from ``seq`` to the newest, or None when that run is not whole.

        Not whole means ``seq`` left the buffer, or a batch in the run is missing or
        undecodable. ``seq`` one past the newest gives an empty list (nothing new).
        """
        newest = self.newest
        if newest is not None and seq == newest + 1:
            return []
        idx = self._index(seq)
        if idx is None:
            return None
        out: list[tuple[int, bytes]] = []
        expected = seq
        for i in range(idx, len(self._entries)):
            entry = self._entries[i]
            if entry.seq != expected or not entry.ok:
                return None
            out.append((entry.seq, entry.payload))
            expected += 1
        return out

    def _index(self, seq: int) -> int | None:
        """Position of ``seq``: direct when seqs are contiguous, else a scan."""
        if not self._entries:
            return None
        guess = seq - self._entries[0].seq
        if 0 <= guess < len(self._entries) and self._entries[guess].seq == seq:
            return guess
        for i, entry in enumerate(self._entries):
            if entry.seq == seq:
                return i
        return None
