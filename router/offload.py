"""The tokenize pool: threads that tokenize large prompts off the event loop, bounded.

A 128K-token prompt takes ~0.5 s of tokenizer CPU; two threads on a 2-core machine
finish about four of them a second. Without a bound, a client sending them faster
piles up requests (and their bodies) without limit and every later request waits
behind the pile. So the pool counts the prompts it holds (waiting or being
tokenized) and refuses one past ``tokenize_queue`` at once with 429
(``tokenizer_busy``), and a request whose prompt is not tokenized within
``tokenize_timeout`` seconds gets 503 (``tokenizer_timeout``) instead of waiting on.

A prompt that timed out while a thread was already tokenizing it keeps its place in
the count until the thread is done: the thread is busy either way, and counting it
free would let the pile grow behind a bound that only looks held.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.errors import ApiError

T = TypeVar("T")


class TokenizePool(Collector):
    """A thread pool that holds at most ``limit`` prompts and waits ``timeout`` seconds
    for each; also the collector of its ``cache_router_tokenize_*`` gauges."""

    def __init__(self, threads: int, limit: int, timeout: float) -> None:
        self.threads = threads
        self.limit = limit
        self.timeout = timeout
        self.held = 0  # prompts submitted and not finished (cancelled ones are finished)
        self._lock = threading.Lock()  # ``held`` drops on the worker threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a pool thread; ``ApiError`` 429 when the pool is full, 503
        when it has not finished within ``timeout`` seconds."""
        with self._lock:
            if self.held >= self.limit:
                full = True
            else:
                full = False
                self.held += 1
        if full:
            raise ApiError(
                429,
                f"the router is tokenizing {self.limit} prompts already; retry later",
                "tokenizer_busy",
            )
        try:
            future = self._executor.submit(fn, *args)
        except RuntimeError:  # shut down: the router is stopping
            self._release(None)
            raise ApiError(503, "the router is shutting down", "tokenizer_timeout") from None
        future.add_done_callback(self._release)
        try:
            async with asyncio.timeout(self.timeout):
                # cancelling the wrapper (timeout, client gone) cancels a prompt still waiting
                return await asyncio.wrap_future(future)
        except TimeoutError:
            raise ApiError(
                503,
                f"the prompt was not tokenized within {self.timeout:g} s; retry later",
                "tokenizer_timeout",
            ) from None

    def _release(self, _future: Future[Any] | None) -> None:
        with self._lock:
            self.held -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "cache_router_tokenize_held",
            "Prompts waiting for or on the tokenize pool",
            value=self.held,
        )
        yield GaugeMetricFamily(
            "cache_router_tokenize_limit",
            "Prompts the tokenize pool holds before refusing one (tokenize_queue)",
            value=self.limit,
        )
