"""No silent event loss: a batch the router could not take (ingest queue full, dropped by
the NATS client as a slow consumer) marks its worker out of sync at once, and a resync
from the agent's replay brings the index back to the engine's.

Uses the engine double, router and real NATS of test_faults_events.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from nats.aio.msg import Msg
from nats.errors import SlowConsumerError
from stack import until
from test_faults_events import Feed, feed

from index.backend import NATIVE
from index.wire import EPOCH_HEADER, SEQ_HEADER
from router.events.ingest_thread import IngestThread

__all__ = ["feed"]  # the fixture, shared


async def test_a_slow_consumer_drop_is_out_of_sync_at_once_then_resynced(feed: Feed) -> None:
    ingest = feed.pool.ingest
    events = feed.app.state.events
    [s0] = await feed.make_batches(1)
    await feed.deliver(s0)
    await until(feed.index_is_engine, timeout=15, what="clean start")

    # The client dropped the next batch (what nats-py reports then): nothing after it
    # shows the gap, yet the worker must not read "in sync".
    await feed.make_batches(1)
    await events.on_nats_error(SlowConsumerError(subject="kv.events.w0", reply="", sid=1, sub=None))
    assert not ingest.in_sync("w0")
    assert events.counts["lost_slow_consumer"] == 1
    await until(feed.index_is_engine, timeout=15, what="resynced from the agent")


async def test_a_full_ingest_queue_loses_nothing(feed: Feed) -> None:
    ingest = feed.pool.ingest
    events = feed.app.state.events
    [s0] = await feed.make_batches(1)
    await feed.deliver(s0)
    await until(feed.index_is_engine, timeout=15, what="clean start")
    if not ingest.native:
        return  # the Python index applies on the loop: there is no queue to fill
    thread = events._ingest_thread()  # started by the first live batch, if not yet
    thread.max_batches = 0  # every batch is refused from here
    if events.native is not None:  # the reader would apply s1 itself, not queue it
        events.native.unroute("w0")
    [s1] = await feed.make_batches(1)
    await feed.deliver(s1)
    await until(lambda: events.counts["lost_ingest_queue_full"] >= 1, what="refusal counted")
    thread.max_batches = 100
    await until(feed.index_is_engine, timeout=15, what="refused batch fed after the resync")
    assert ingest.last_seq("w0") == s1


async def test_a_batch_arriving_as_a_resync_ends_is_applied(
    feed: Feed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent answered "nothing after s0"; the engine's next batch comes in live in the
    same loop turn as the resync finds the worker in sync. It was held for a resync that
    had just ended, and nothing ever fed it (test_dp_ranks waited for it under load)."""
    ingest = feed.pool.ingest
    events = feed.app.state.events
    [s0] = await feed.make_batches(1)
    await feed.deliver(s0)
    await until(feed.index_is_engine, timeout=15, what="clean start")
    [s1] = await feed.make_batches(1)
    s1_batch = feed.engine.ring.pop()  # made after the agent's answer: not in it
    live = Msg(
        feed.nc,
        subject="kv.events.w0",
        data=s1_batch[1],
        headers={SEQ_HEADER: str(s1), EPOCH_HEADER: feed.engine.epoch},
    )
    arrivals: list[asyncio.Task[None]] = []
    in_sync = ingest.in_sync

    def in_sync_then_a_batch(worker_id: str) -> bool:
        task = asyncio.current_task()
        if not arrivals and task is not None and task.get_name() == "resync-w0":
            arrivals.append(asyncio.ensure_future(events.on_event(live)))  # runs next turn
        return in_sync(worker_id)

    monkeypatch.setattr(ingest, "in_sync", in_sync_then_a_batch)
    events.resync("w0")
    await until(lambda: arrivals and arrivals[0].done(), what="the batch came in")
    feed.engine.ring.append(s1_batch)
    await until(feed.index_is_engine, what="the batch applied")
    assert ingest.last_seq("w0") == s1


async def test_pools_get_the_native_index_when_it_is_built(feed: Feed) -> None:
    assert feed.pool.ingest.native == NATIVE


# -- the thread itself -------------------------------------------------------------------


async def test_ingest_thread_runs_in_order_and_reports_on_the_loop() -> None:
    loop = asyncio.get_running_loop()
    thread = IngestThread(loop, max_batches=1000)
    seen: list[int] = []
    done: list[tuple[int, bool]] = []
    try:
        for i in range(200):
            assert thread.submit(
                lambda i=i: seen.append(i) or i,
                lambda r: done.append((r, asyncio.get_running_loop() is loop)),
            )
        assert await thread.drain(10)
        await until(lambda: len(done) == 200, what="results on the loop")
        assert seen == list(range(200))
        assert [r for r, _ in done] == list(range(200)) and all(on for _, on in done)
        assert thread.lag() == (0, 0.0)
    finally:
        thread.close()


async def test_ingest_thread_is_bounded_and_reports_errors() -> None:
    loop = asyncio.get_running_loop()
    errors: list[BaseException] = []
    release, started = threading.Event(), threading.Event()
    thread = IngestThread(loop, max_batches=2, on_error=errors.append)
    try:
        assert thread.submit(lambda: (started.set(), release.wait()))  # blocks the thread
        await until(started.is_set, what="first call running")
        assert thread.submit(lambda: 1 / 0)
        assert thread.submit(lambda: None)
        assert not thread.submit(lambda: None)  # full: refused, the caller must act
        queued, age = thread.lag()
        assert queued == 3 and age >= 0
        release.set()
        assert await thread.drain(10)
        await until(lambda: len(errors) == 1, what="the error reported")
        assert isinstance(errors[0], ZeroDivisionError)
    finally:
        release.set()
        thread.close()
    assert not thread.submit(lambda: None)  # closed


async def test_ingest_thread_hands_queued_args_over_in_runs() -> None:
    """Args queued back to back for one ``run`` reach it as one list (at most
    ``max_run``), in order; a plain call in between ends the run; a run that raises is
    retried arg by arg, so only the arg that fails alone is reported as an error."""
    loop = asyncio.get_running_loop()
    errors: list[BaseException] = []
    release, started = threading.Event(), threading.Event()
    thread = IngestThread(loop, max_batches=1000, max_run=4, on_error=errors.append)
    runs: list[list[int]] = []

    class Sync:  # EventSync submits a bound method: a new object at every read
        def run(self, args: list[int]) -> list[int]:
            runs.append(list(args))
            if 13 in args:
                raise ValueError("13")
            return [a * 10 for a in args]

    sync = Sync()

    done: list[object] = []
    try:
        assert thread.submit(lambda: (started.set(), release.wait()))  # holds the queue
        await until(started.is_set, what="first call running")
        for a in range(6):
            assert thread.submit_run(sync.run, a, done.append)
        assert thread.submit(lambda: "call", done.append)
        for a in (11, 12, 13, 14):
            assert thread.submit_run(sync.run, a, done.append)
        assert thread.lag()[0] == 12
        release.set()
        assert await thread.drain(10)
        await until(lambda: len(done) == 10 and len(errors) == 1, what="all reported")
        assert done == [0, 10, 20, 30, 40, 50, "call", 110, 120, 140]
        assert runs == [[0, 1, 2, 3], [4, 5], [11, 12, 13, 14], [11], [12], [13], [14]]
        assert isinstance(errors[0], ValueError)
        assert thread.applied == 1 + 6 + 1 + 3
    finally:
        release.set()
        thread.close()


async def test_live_batches_let_the_loop_run_between_them() -> None:
    """nats-py feeds a subscription's queued messages to ``on_event`` without yielding;
    ``on_event`` yields every ``YIELD_EVERY`` messages, so a request that arrives behind
    a socket read's worth of batches waits for a few of them, not for all."""
    from router.config import RouterConfig
    from router.events.consumer import YIELD_EVERY, EventSync
    from router.workers.registry import WorkerRegistry

    events = EventSync(WorkerRegistry(RouterConfig()))
    seen: list[int] = []

    async def request() -> None:
        seen.append(events.counts["messages"])

    task = asyncio.ensure_future(request())  # ready: runs at the loop's next turn
    for _ in range(3 * YIELD_EVERY):
        await events.on_event(Msg(None, subject="kv.events.nobody", data=b"", headers={}))
    await asyncio.wait_for(task, 5)
    assert seen == [YIELD_EVERY]
    assert events.counts["unknown_worker"] == 3 * YIELD_EVERY
