"""The capacity forecast: its accuracy against the simulator, and its cost online. JSON out.

Accuracy (``--trace T --sizes 4096,16384 --hosts 0,4``): for each GPU size per engine
(and host size = factor x GPU), ``sim.forecast.forecast`` routes the trace with
``cache_aware`` in the simulator and compares the forecast with what the simulated
engines delivered: pooled (vs the simulator's pooled LRU reference) and per worker.
One JSON line per size.

Overhead (``--overhead --trace T``): the router's ``CapacityWatch`` fed the trace as
8 workers would see it (sessions spread by hash): the request path's ``record`` (ns a
call), the background analysis (CPU us a request, by ``time.process_time``), the
memory the forecasts hold (tracemalloc, plus the native stacks' own heap), at the
router's default sampling, and how late a 1 ms timer on the event loop fires while
``CapacityWatch.run`` drains the whole trace on its thread (``loop_lag_ms``: what the
analysis costs the request path). ``CACHE_ROUTER_INDEX=python`` measures the Python
stacks (index/reuse.py) instead of the native ones.

    flock /work/bench.lock nice -n 5 python3 bench/capacity.py --trace T --sizes 4096,16384
    flock /work/bench.lock nice -n 5 python3 bench/capacity.py --overhead --trace T
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import tracemalloc
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

from index.capacity import Sampling
from router.config import RouterConfig
from router.observe.capacity import CapacityWatch
from router.workers.registry import WorkerRegistry
from sim.forecast import forecast
from sim.simulator import SimConfig
from sim.traces import load_trace


def accuracy(args: argparse.Namespace) -> None:
    trace = load_trace(args.trace, args.block_size, limit=args.limit)
    for l1 in (int(x) for x in args.sizes.split(",")):
        for factor in (float(x) for x in args.hosts.split(",")):
            l2 = int(l1 * factor)
            started = time.perf_counter()
            config = SimConfig(workers=args.workers, l1_blocks=l1, l2_blocks=l2)
            r = forecast(trace, config, policy="cache_aware", samples=Sampling())
            sim = r["simulated"]
            errors = {
                w: v["predicted_hit_rate"] - sim["workers"][w]["hit_rate"]
                for w, v in r["workers"].items()
            }
            line = {
                "trace": Path(args.trace).name,
                "requests": r["requests"],
                "workers": args.workers,
                "l1_blocks": l1,
                "l2_blocks": l2,
                "ceiling": r["ceiling_hit_rate"],
                "pooled_forecast": r["pooled"]["predicted_hit_rate"],
                "pooled_lru_sim": r["pooled_lru_hit_rate"],
                "pooled_error": r["pooled"]["predicted_hit_rate"] - r["pooled_lru_hit_rate"],
                "routed_forecast": r["predicted_routed_hit_rate"],
                "routed_sim": sim["hit_rate"],
                "worker_error_max": max(abs(e) for e in errors.values()),
                "worker_error_mean": sum(errors.values()) / len(errors),
                "gpu_forecast": sum(
                    v["predicted_gpu_hit_rate"] * v["requests"] for v in r["workers"].values()
                )
                / max(1, sum(v["requests"] for v in r["workers"].values())),
                "gpu_sim": sim["hit_rate_gpu"],
                "saturation_blocks": r["pooled"]["saturation_blocks"],
                "working_set_blocks": r["working_set_blocks"],
                "sampling_rate_pooled": r["pooled"]["sampling_rate"],
                "wall_s": time.perf_counter() - started,
            }
            print(orjson.dumps(line).decode(), flush=True)


def overhead(args: argparse.Namespace) -> None:
    trace = load_trace(args.trace, args.block_size, limit=args.limit)
    reqs = [
        (
            f"w{zlib.crc32((r.session or str(i)).encode()) % args.workers}",
            r.router_hashes.tolist(),
            r.input_len,
        )
        for i, r in enumerate(trace.requests)
    ]
    watch = CapacityWatch(WorkerRegistry(RouterConfig()), Sampling(), queue_max=len(reqs) + 1)
    t0 = time.perf_counter_ns()
    for wid, hashes, n in reqs:
        watch.record("m", args.block_size, wid, hashes, n)
    record_ns = (time.perf_counter_ns() - t0) / len(reqs)
    tracemalloc.start()
    cpu = time.process_time()
    watch.drain()
    cpu = time.process_time() - cpu
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # the same analysis untraced: tracemalloc slows allocation-heavy code down
    watch2 = CapacityWatch(WorkerRegistry(RouterConfig()), Sampling(), queue_max=len(reqs) + 1)
    for wid, hashes, n in reqs:
        watch2.record("m", args.block_size, wid, hashes, n)
    fc = watch.forecasts["m"]
    stacks = [fc.pooled, *fc.workers.values()]
    native_bytes = sum(s.bytes() for s in stacks if hasattr(s, "bytes"))  # native stacks
    blocks = sum(len(h) for _, h, _ in reqs)
    half = len(reqs) // 2
    cpu_all = time.process_time()
    while watch2.queued and watch2.analysed < half:
        watch2.drain(0.01)
    cpu_first = time.process_time() - cpu_all
    first_n = watch2.analysed
    watch2.drain()
    cpu_all = time.process_time() - cpu_all
    lag = asyncio.run(loop_lag(reqs, args.block_size))
    print(
        orjson.dumps(
            {
                "trace": Path(args.trace).name,
                "requests": len(reqs),
                "blocks_per_request": blocks / len(reqs),
                "workers": args.workers,
                "sampling": {
                    "max_tracked": fc.sampling.max_tracked,
                    "hot_blocks": fc.sampling.hot_blocks,
                },
                "record_ns_per_request": record_ns,
                "analysis_cpu_us_per_request": cpu_all / len(reqs) * 1e6,
                # the second half: past the start, where every block is still tracked
                "analysis_cpu_us_per_request_steady": (cpu_all - cpu_first)
                / (len(reqs) - first_n)
                * 1e6,
                "analysis_cpu_us_per_request_traced": cpu / len(reqs) * 1e6,
                "implementation": type(fc.pooled).__name__,
                "memory_bytes": current + native_bytes,
                "memory_peak_bytes": peak,
                "stacks": len(stacks),
                "pooled_sampling_rate": fc.pooled.rate,
                "loop_lag_ms": lag,
            }
        ).decode()
    )


async def loop_lag(reqs: list[tuple[str, list[int], int]], block_size: int) -> dict[str, float]:
    """A 1 ms timer's lateness on the loop while the forecast's thread drains ``reqs``."""
    registry = WorkerRegistry(RouterConfig())
    watch = CapacityWatch(registry, Sampling(), queue_max=len(reqs) + 1, queue_max_blocks=1 << 40)
    for wid, hashes, n in reqs:
        watch.record("m", block_size, wid, hashes, n)
    task = asyncio.create_task(watch.run())
    late: list[float] = []
    deadline = time.monotonic() + 600  # a bench must end: a stuck analysis fails it
    try:
        while watch.analysed + watch.errors < len(reqs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{watch.analysed} of {len(reqs)} requests analysed in 600 s")
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append((time.perf_counter() - t0 - 0.001) * 1e3)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    late.sort()
    return {
        "ticks": len(late),
        "p50": statistics.median(late),
        "p99": late[int(0.99 * (len(late) - 1))],
        "max": late[-1],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trace", required=True)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--sizes", default="4096,16384,65536,262144", help="GPU blocks per engine")
    p.add_argument("--hosts", default="0", help="host blocks as multiples of GPU blocks")
    p.add_argument("--limit", type=int)
    p.add_argument("--overhead", action="store_true")
    args = p.parse_args()
    overhead(args) if args.overhead else accuracy(args)


if __name__ == "__main__":
    main()
