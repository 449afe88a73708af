"""The event-loop watch (router.observe.loop): lateness and CPU wait, and what they mean."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from router.observe.loop import EVERY, WINDOW, LoopWatch, cpu_wait, verdict


def test_recent_keeps_the_window_and_sums_it() -> None:
    watch = LoopWatch(CollectorRegistry())
    watch.sample(0.5, 0.4, now=0.0)  # outside the window seen from WINDOW + 10
    watch.sample(0.2, 0.0, now=WINDOW + 1)
    watch.sample(0.01, 0.003, now=WINDOW + 2)
    watch.sample(-0.002, -1.0, now=WINDOW + 3)  # a clock's jitter is not negative lag
    r = watch.recent(now=WINDOW + 10)
    assert r["samples"] == 3 and r["late_wakeups"] == 1
    assert r["lag_max_s"] == 0.2 and r["lag_total_s"] == 0.21 and r["cpu_wait_s"] == 0.003
    sums = [x.value for x in watch.lag.collect()[0].samples if x.name.endswith("_sum")]
    assert sums == [0.71]  # every sample reaches the histogram, a negative one as 0


def test_the_window_is_bounded() -> None:
    watch = LoopWatch(CollectorRegistry())
    for i in range(3 * int(WINDOW / EVERY)):
        watch.sample(0.0, 0.0, now=i * EVERY)
    assert len(watch._recent) == int(WINDOW / EVERY)


def test_verdict_tells_the_machine_from_the_router() -> None:
    base = {"window_s": WINDOW, "samples": 600, "lag_max_s": 0.4}
    late, text = verdict({**base, "late_wakeups": 0, "lag_total_s": 0.01, "cpu_wait_s": 0.0})
    assert not late and text.startswith("on time")
    late, text = verdict({**base, "late_wakeups": 5, "lag_total_s": 1.0, "cpu_wait_s": 0.9})
    assert late and "short of CPU" in text and "400 ms" in text
    late, text = verdict({**base, "late_wakeups": 5, "lag_total_s": 1.0, "cpu_wait_s": 0.1})
    assert late and "own work" in text


async def test_a_blocked_loop_is_seen() -> None:
    """A callback holding the loop past the watch's due time by 0.3 s (at least) makes
    its wake-up at least that late (a lower bound: a slow machine only makes it later)."""
    watch = LoopWatch(CollectorRegistry())
    task = asyncio.create_task(watch.run())
    try:
        await asyncio.sleep(0.05)  # the watch is asleep, due at EVERY after it began
        time.sleep(EVERY + 0.3)  # the point: a callback that blocks the loop
        while not watch.recent()["samples"]:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert watch.recent()["lag_max_s"] >= 0.3
    assert watch.recent()["late_wakeups"] == 1


def test_cpu_wait_is_a_growing_number() -> None:
    first = cpu_wait()
    sum(range(200_000))
    assert 0.0 <= first <= cpu_wait()
