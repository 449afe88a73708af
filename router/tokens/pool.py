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

Long texts are encoded in other processes (``EncodeProcesses``): the tokenizer itself
releases the GIL, but its answer is a Python list of ints, built in one C call that
holds it: 5-9 ms for 128K tokens, then 2-6 ms more to pack them into an ``array``. For
that long no other request's code runs, which is what a short request's p99 under a
client sending 128K-token prompts is made of. A process sends the ids back packed.

An encode process leaves with its router. A pool's worker holds both ends of its task
queue's pipe, so it never reads an end of file when the router dies; a router killed
(SIGKILL, the OOM killer, ``--processes`` restarting a child) left its processes behind,
each with its tokenizer loaded, for ever (eight of them after a morning of
``bench/hotpath.py`` runs). Each now watches its parent and exits once it is gone.

Encode processes run at ``nice`` 10: their work is bulk (a 128K prompt is ~70 ms of
CPU), the event loop's is a short request's whole latency, and on 2 cores they compete
for the same CPU. ``bench/hotpath.py --interference-only`` against the same router with
them at 0, short requests' busy p99 (median of the repetitions): 1.60 against 1.78 ms (6
repetitions) and 1.93 against 2.34 ms (8, simulations beside them), with as many 128K
prompts served (28-41 against 25-42 a half). A small gain, in the noise of single runs.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.http.errors import ApiError

log = logging.getLogger(__name__)
T = TypeVar("T")


def timed_out(timeout: float) -> ApiError:
    """The answer to a prompt the tokenize pool or an encode process did not finish."""
    return ApiError(
        503, f"the prompt was not tokenized within {timeout:g} s; retry later", "tokenizer_timeout"
    )


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
            raise timed_out(self.timeout) from None

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


# Texts at least this long (in all, per call) are encoded in a process: below it the ids'
# list costs under ~1 ms of GIL (~30K tokens at 2 characters a token), about what the
# round trip to a process costs in CPU.
PROCESS_CHARS = 1 << 16

_loaded: dict[str, Any] = {}  # a process's tokenizers by path
ENCODE_NICE = 10
ORPHAN_POLL_S = 0.5  # how often an encode process checks that its router still runs


def _watch_parent() -> None:
    """In an encode process, at its start: exit once the router that started it is gone
    (it is then re-parented, so ``getppid`` changes)."""
    parent = os.getppid()
    os.nice(ENCODE_NICE)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL_S)
        os._exit(0)  # nothing to flush: a process holds no state but its tokenizers

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _encode_packed(path: str, texts: list[str], add_special_tokens: bool) -> list[bytes]:
    """In an encode process: ``encode_batch_fast(texts)``, each text's ids packed as
    native u32."""
    from tokenizers import Tokenizer

    tok = _loaded.get(path)
    if tok is None:
        tok = _loaded[path] = Tokenizer.from_file(path)
    encoded = tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
    return [array("I", e.ids).tobytes() for e in encoded]


class EncodeProcesses:
    """Processes that encode long texts (see the module docstring), started at the first
    one; a pool that broke (a process killed) is started again at the next."""

    def __init__(self, processes: int, timeout: float, min_chars: int = PROCESS_CHARS) -> None:
        self.processes = processes
        self.timeout = timeout
        self.min_chars = min_chars
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def encode(
        self, path: str, texts: list[str], add_special_tokens: bool = False
    ) -> list[array[int]] | None:
        """The ids of ``texts`` by the tokenizer at ``path`` (``tokenizer.json``), or None
        when no process can take them now (the caller encodes them itself). Blocks: call
        it from a tokenize thread. ``ApiError`` 503 after ``timeout`` seconds."""
        pool = self._started()
        if pool is None:
            return None
        try:
            future = pool.submit(_encode_packed, path, texts, add_special_tokens)
            packed = future.result(self.timeout)
        except BrokenProcessPool as exc:  # a process was killed: start them again next time
            log.warning("tokenizer process lost (%s); encoding in the router", exc)
            self._drop(pool, closed=False)
            return None
        except RuntimeError as exc:  # shut down, or cannot start (see ``_started``)
            if not self._closed:
                log.warning("tokenizer processes cannot start (%s); encoding in the router", exc)
            self._drop(pool, closed=True)
            return None
        except TimeoutError:
            raise timed_out(self.timeout) from None
        out = []
        for b in packed:
            ids = array("I")
            ids.frombytes(b)
            out.append(ids)
        return out

    def _started(self) -> ProcessPoolExecutor | None:
        with self._lock:
            if self._pool is None and not self._closed:
                # spawn: forking a process that runs threads and an event loop is unsafe.
                # A spawned process imports the main module again: a program that runs
                # the router from a script without a ``__main__`` guard cannot start one
                # (RuntimeError), and encodes in its own threads instead.
                ctx = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(
                    self.processes, mp_context=ctx, initializer=_watch_parent
                )
            return self._pool

    def _drop(self, pool: ProcessPoolExecutor, closed: bool) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
            self._closed = self._closed or closed
        pool.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
