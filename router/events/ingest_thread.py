"""Live KV-event batches applied on their own thread, beside the event loop.

With the native index a batch's decode -> rehash -> apply is one call that releases the
GIL, so a thread applies it while the event loop serves requests: the loop only queues
the message (a few microseconds) instead of doing per-block work, and a match never
sees half a batch (the native index applies a batch under its mutex).

Batches queued back to back go to the native ingest as one run (``submit_run``): the
thread's Python, its GIL round trip and its report to the loop come once per run, not
once per batch. Per batch they cost the loop as much as the batch's apply: at 128K
blocks/s (8K batches/s) ``call_soon_threadsafe`` alone was ~9 % of the router's samples
(py-spy, bench/scale.py's nats section), and every report woke the loop.

The queue is bounded (``max_batches``): past it a batch is refused and the caller marks
the worker out of sync and resyncs it, so nothing is lost silently. ``lag()`` says how
far behind the thread is (batches queued, age of the oldest), for /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

Report = Callable[[Any], None]
RunFn = Callable[[list[Any]], list[Any]]


class _Item(NamedTuple):
    queued: float
    run: RunFn | None  # None: ``arg`` is a plain call
    arg: Any
    done: Report | None


class IngestThread:
    """One worker thread that runs submitted work in order and reports back on the loop.

    ``submit(fn, done)`` queues ``fn()``. ``submit_run(run, arg, done)`` queues ``arg``
    for ``run``, which takes a list of args and returns one result each: consecutive
    queued args of the same ``run`` reach it as one list (at most ``max_run``). Once
    work ran, ``done(result)`` is called on the event loop (only when ``done`` is
    given), in submission order, one loop wake-up per run. Work that raises is reported
    to ``on_error`` on the loop, never lost; a run that raises is retried arg by arg,
    so only the args that raise alone are reported.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        max_batches: int = 100_000,
        max_run: int = 64,
        on_error: Callable[[BaseException], None] | None = None,
        name: str = "cache-router-ingest",
    ) -> None:
        self.max_batches = max_batches
        self.max_run = max_run
        self.applied = 0
        self._loop = loop
        self._on_error = on_error
        self._queue: deque[_Item] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._busy_since: float | None = None
        self._running = 0  # items of the run in progress
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], done: Report | None = None) -> bool:
        """Queue ``fn``; False (not queued) when the queue is full or closed."""
        return self._put(None, fn, done)

    def submit_run(self, run: RunFn, arg: Any, done: Report | None = None) -> bool:
        """Queue ``arg`` for ``run``; False (not queued) when the queue is full or closed."""
        return self._put(run, arg, done)

    def _put(self, run: RunFn | None, arg: Any, done: Report | None) -> bool:
        with self._wake:
            if self._closed or len(self._queue) >= self.max_batches:
                return False
            self._queue.append(_Item(time.monotonic(), run, arg, done))
            if len(self._queue) == 1:
                self._wake.notify()
        return True

    def lag(self) -> tuple[int, float]:
        """(calls queued or running, seconds the oldest of them has waited)."""
        with self._wake:
            n = len(self._queue) + self._running
            oldest = self._busy_since
            if oldest is None and self._queue:
                oldest = self._queue[0].queued
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
                items = [self._queue.popleft()]
                run = items[0].run
                if run is not None:
                    # ==, not is: a bound method is a new object at every attribute read
                    while self._queue and len(items) < self.max_run and self._queue[0].run == run:
                        items.append(self._queue.popleft())
                self._busy_since = items[0].queued
                self._running = len(items)
            reports: list[tuple[Report, Any]] = []
            try:
                self._work(run, items, reports)
            finally:
                with self._wake:
                    self._busy_since = None
                    self._running = 0
            if reports:
                with contextlib.suppress(RuntimeError):  # the loop is closed: shutting down
                    self._loop.call_soon_threadsafe(_deliver, reports)

    def _work(
        self, run: RunFn | None, items: list[_Item], reports: list[tuple[Report, Any]]
    ) -> None:
        if run is not None and len(items) > 1:
            try:
                results = run([item.arg for item in items])
            except BaseException:
                pass  # retried one by one below: each arg's error is reported
            else:
                for item, result in zip(items, results, strict=True):
                    self._ran(item, result, reports)
                return
        for item in items:
            try:
                result = item.arg() if run is None else run([item.arg])[0]
            except BaseException as exc:
                if self._on_error is not None:
                    reports.append((self._on_error, exc))
            else:
                self._ran(item, result, reports)

    def _ran(self, item: _Item, result: Any, reports: list[tuple[Report, Any]]) -> None:
        self.applied += 1
        if item.done is not None:
            reports.append((item.done, result))


def _deliver(reports: list[tuple[Report, Any]]) -> None:
    """On the loop: one run's reports, in order; one that raises does not stop the rest
    (as separate loop callbacks would not)."""
    for cb, value in reports:
        try:
            cb(value)
        except Exception:
            log.exception("an ingest report failed")
