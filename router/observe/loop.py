"""How late the router's event loop runs, and whether the machine or the router is why.

Every request's decision, every streamed chunk and every shed answer waits for the one
event-loop thread. When it runs late, TTFT grows by as much, and nothing else in
``/metrics`` says so: the router's own timers measure from when the loop got to them.
Session 19 found exactly this on a 2-core machine beside two vLLM engines (issue 31): sheds
the router answered 0.1 ms after deciding reached clients 1-2.5 s after they were sent,
because the loop waited ~10 s runnable for a CPU over one run. Two causes look alike from
outside and need opposite fixes, so both are measured:

- **lag**: a task sleeps ``EVERY`` seconds and records how much later than asked it wakes
  (``cache_router_event_loop_lag_seconds``, a histogram). A callback that holds the loop
  (a long tokenization on it, a big JSON) and a starved thread both show here.
- **CPU wait**: the loop thread's time spent runnable but not running, from the kernel's
  ``/proc/thread-self/schedstat`` run delay (``cache_router_event_loop_cpu_wait_seconds``;
  Linux only, 0 elsewhere). Lag with as much CPU wait is the machine (engines or other
  processes on the router's cores: give the router its own CPU); lag without it is the
  router's own work blocking its loop.

The watch wakes every ``EVERY`` (0.5 s) for a timer and one file read: ~0.9 ms of CPU a
second on this project's sandboxed 2-core machine, where a wake-up and a read cost
~0.2 ms each (at 0.1 s it was 4.6 ms/s, more than the idle router's own 3). So it samples:
a stall shorter than ``EVERY`` shows with a chance of about its length over ``EVERY``,
while starvation, which lasts, always shows, and the CPU-wait counter misses nothing
(it is the kernel's running total). The last ``WINDOW`` seconds are kept (bounded:
``WINDOW / EVERY`` samples) for ``GET /admin/index`` and ``cache-router doctor``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram

EVERY = 0.5  # seconds between wake-ups (the cost and the chance of a short stall, above)
WINDOW = 60.0  # seconds of recent samples kept for the admin API and doctor
SLOW = 0.05  # a wake-up this late counts as a late one in the recent summary
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def cpu_wait() -> float:
    """Seconds the calling thread has waited runnable for a CPU since it started (the
    kernel's run delay; 0.0 where the kernel does not tell)."""
    try:
        return int(_SCHEDSTAT.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class LoopWatch:
    """Samples the running loop's lateness and its thread's CPU wait (see the module)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lag = Histogram(
            "cache_router_event_loop_lag_seconds",
            f"How much later than asked the router's event loop woke a task sleeping {EVERY} s "
            "(every request waits as long; sampled, see router.observe.loop)",
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self.waited = Counter(
            "cache_router_event_loop_cpu_wait_seconds",
            "Time the event-loop thread waited runnable for a CPU (kernel run delay): lag "
            "with as much of it is a machine short of CPU, not the router's own work",
            registry=registry,
        )
        # (monotonic time, lateness, CPU wait since the previous sample)
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=int(WINDOW / EVERY))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        waited = cpu_wait()
        while True:
            asked = loop.time()
            await asyncio.sleep(EVERY)
            now_waited = cpu_wait()
            self.sample(loop.time() - asked - EVERY, now_waited - waited, time.monotonic())
            waited = now_waited

    def sample(self, late: float, waited: float, now: float) -> None:
        """One wake-up: ``late`` seconds after it was due, ``waited`` seconds of CPU wait
        since the last one."""
        late, waited = max(0.0, late), max(0.0, waited)
        self.lag.observe(late)
        self.waited.inc(waited)
        self._recent.append((now, late, waited))

    def recent(self, now: float | None = None) -> dict[str, float | int]:
        """The last ``WINDOW`` seconds: the worst lag and the lags' sum, how many wake-ups
        were late, and the CPU wait over the same time."""
        since = (time.monotonic() if now is None else now) - WINDOW
        rows = [r for r in self._recent if r[0] >= since]
        return {
            "window_s": WINDOW,
            "samples": len(rows),
            "lag_max_s": round(max((r[1] for r in rows), default=0.0), 4),
            "lag_total_s": round(sum(r[1] for r in rows), 4),
            "late_wakeups": sum(r[1] > SLOW for r in rows),
            "cpu_wait_s": round(sum(r[2] for r in rows), 4),
        }


def verdict(recent: dict[str, float | int]) -> tuple[bool, str]:
    """Whether the loop ran late in ``recent`` (a ``LoopWatch.recent``), and why in words."""
    late, total, waited = recent["late_wakeups"], recent["lag_total_s"], recent["cpu_wait_s"]
    head = (
        f"{late} wake-up(s) over {SLOW * 1000:.0f} ms late in the last {recent['window_s']:.0f} s, "
        f"the worst {float(recent['lag_max_s']) * 1000:.0f} ms"
    )
    if not late:
        return False, f"on time: {head}"
    if waited >= 0.5 * float(total):  # most of the lateness was spent waiting for a CPU
        why = "the machine is short of CPU: give the router cores the engines do not use"
    else:
        why = "the router's own work held its loop (tokenize_threads, processes)"
    return True, f"{head}; it waited {float(waited):.2f} s for a CPU: {why}"
