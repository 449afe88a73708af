"""Live KV-event batches applied on their own thread, beside the event loop.

With the native index a batch's decode -> rehash -> apply is one call that releases the
GIL, so a thread applies it while the event loop serves requests: the loop only queues
the message (a few microseconds) instead of doing per-block work, and a match never
sees half a batch (the native index applies a batch under its mutex).

The queue is bounded (``max_batches``): past it a batch is refused and the caller marks
the worker out of sync and resyncs it, so nothing is lost silently. ``lag()`` says how
far behind the thread is (batches queued, age of the oldest), for /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class IngestThread:
    """One worker thread that runs submitted calls in order and reports back on the loop.

    ``submit(fn, done)`` queues ``fn()``; once it ran, ``done(result)`` is called on the
    event loop (only when ``done`` is given). A call that raises is reported to
    ``on_error`` on the loop, never lost.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        max_batches: int = 100_000,
        on_error: Callable[[BaseException], None] | None = None,
        name: str = "cache-router-ingest",
    ) -> None:
        self.max_batches = max_batches
        self.applied = 0
        self._loop = loop
        self._on_error = on_error
        self._queue: deque[tuple[float, Callable[[], Any], Callable[[Any], None] | None]] = (
            deque()
        )
        self._wake = threading.Condition()
        self._closed = False
        self._busy_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], done: Callable[[Any], None] | None = None) -> bool:
        """Queue ``fn``; False (not queued) when the queue is full or closed."""
        with self._wake:
            if self._closed or len(self._queue) >= self.max_batches:
                return False
            self._queue.append((time.monotonic(), fn, done))
            if len(self._queue) == 1:
                self._wake.notify()
        return True

    def lag(self) -> tuple[int, float]:
        """(calls queued or running, seconds the oldest of them has waited)."""
        with self._wake:
            n = len(self._queue) + (self._busy_since is not None)
            oldest = self._busy_since if self._busy_since is not None else None
            if oldest is None and self._queue:
                oldest = self._queue[0][0]
        return n, 0.0 if oldest is None else time.monotonic() - oldest

    async def drain(self, timeout: float = 10.0) -> bool:
        """Wait (bounded) until everything queued so far ran; False on timeout."""
        deadline = time.monotonic() + timeout
        while self.lag()[0]:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.001)
        return True

    def close(self, timeout: float = 5.0) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return  # closed and drained
                queued, fn, done = self._queue.popleft()
                self._busy_since = queued
            try:
                result = fn()
            except BaseException as exc:
                if self._on_error is not None:
                    self._report(self._on_error, exc)
            else:
                self.applied += 1
                if done is not None:
                    self._report(done, result)
            finally:
                with self._wake:
                    self._busy_since = None

    def _report(self, cb: Callable[[Any], None], value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: shutting down
            self._loop.call_soon_threadsafe(cb, value)
