"""``cache-router tune``: size the host tier and tune ``cache_aware`` on a trace, before buying.

A small coordinate search, each point one run of the simulator (``sim.simulator``):

1. host (L2) pages per engine: none, and the sizes around the forecast's saturation
   point (``index.capacity``: where one more doubling adds less than a point), with the
   policy's defaults;
2. at the best host size, ``recompute_weight`` (how much the pool's cost of recomputing
   a prefix a peer holds counts) over ``--weights``;
3. at the best of those, ``prefetch_fraction`` (how much of the expected wait a prefetch
   may take) over ``--fractions``.

"Best" is the lowest mean TTFT; a host size within 1 % of the best TTFT and smaller
wins (memory costs money). About 8 runs by default, in parallel processes (fork: the
trace is shared, not pickled). ``--json -`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import multiprocessing as mp
import os
import sys
from typing import Any

from index.capacity import CapacityForecast, Sampling, Tiers
from sim.report import PolicyReport, write_json
from sim.simulator import SimConfig, Simulation
from sim.traces import Trace, TraceError, add_trace_arguments, trace_from

_DEFAULTS = SimConfig()
_TRACE: Trace | None = None  # set before the pool forks
POLICY = "cache_aware"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    parser.add_argument("--workers", type=int, default=_DEFAULTS.workers, help="engines")
    parser.add_argument("--l1-blocks", type=int, default=_DEFAULTS.l1_blocks, help="GPU pages")
    parser.add_argument(
        "--hosts", help="host pages per engine to try, comma-separated (default: from the forecast)"
    )
    parser.add_argument(
        "--weights", default="0,1", help="recompute_weight values besides the default 6"
    )
    parser.add_argument("--fractions", default="0.25,1", help="prefetch_fraction besides 0.5")
    parser.add_argument("--jobs", type=int, help="parallel processes (default: one per core)")
    parser.add_argument("--json", metavar="PATH|-", help="write the search as JSON")


def host_candidates(trace: Trace, workers: int, l1: int) -> list[int]:
    """0 and the host sizes per engine around where the pooled curve saturates."""
    fc = CapacityForecast(trace.block_size, Sampling())
    for req in trace.requests:
        fc.observe(None, req.router_hashes.tolist(), req.input_len)
    report = fc.report({f"w{i}": Tiers(l1) for i in range(workers)})
    # the pool's memory the traffic still gains from, as host pages on each engine
    per_engine = max(0, report["pooled"]["saturation_blocks"] // workers - l1)
    if per_engine == 0:
        return [0]
    top = 1 << (per_engine - 1).bit_length()  # a power of two, like real host pools
    return [0, top // 2, top, top * 2]


def _run(point: tuple[int, dict[str, Any]], config: SimConfig) -> PolicyReport:
    assert _TRACE is not None
    l2, params = point
    cfg = dataclasses.replace(config, l2_blocks=l2)
    return Simulation(_TRACE, POLICY, cfg, policy_params=params).run()


def search(
    trace: Trace,
    config: SimConfig,
    hosts: list[int],
    weights: list[float],
    fractions: list[float],
    jobs: int | None = None,
) -> dict[str, Any]:
    global _TRACE
    _TRACE = trace
    runs: list[dict[str, Any]] = []
    jobs = jobs or os.cpu_count() or 1
    ctx = mp.get_context("fork")

    def batch(points: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
        if jobs <= 1 or len(points) == 1:
            reports = [_run(p, config) for p in points]
        else:
            with cf.ProcessPoolExecutor(max_workers=min(jobs, len(points)), mp_context=ctx) as ex:
                reports = list(ex.map(_run, points, [config] * len(points)))
        rows = [_row(l2, params, rep) for (l2, params), rep in zip(points, reports, strict=True)]
        runs.extend(rows)
        return rows

    try:
        stage = batch([(h, {}) for h in hosts])
        best = min(r["ttft_mean_ms"] for r in stage)
        host = min((r for r in stage if r["ttft_mean_ms"] <= best * 1.01), key=lambda r: r["l2"])
        l2 = host["l2"]
        stage = [host, *batch([(l2, {"recompute_weight": w}) for w in weights])]
        params = dict(min(stage, key=lambda r: r["ttft_mean_ms"])["params"])
        stage = [
            min(stage, key=lambda r: r["ttft_mean_ms"]),
            *batch([(l2, {**params, "prefetch_fraction": f}) for f in fractions]),
        ]
        chosen = min(stage, key=lambda r: r["ttft_mean_ms"])
    finally:
        _TRACE = None
    return {"best": chosen, "runs": runs, "default": runs[hosts.index(0)] if 0 in hosts else None}


def _row(l2: int, params: dict[str, Any], rep: PolicyReport) -> dict[str, Any]:
    keys = (
        "hit_rate", "hit_rate_gpu", "hit_rate_host", "ttft_mean_ms", "ttft_p50_ms",
        "ttft_p90_ms", "ttft_p99_ms", "queue_mean_ms", "prefetch_tokens", "rejected",
    )  # fmt: skip
    return {"l2": l2, "params": params, **{k: rep[k] for k in keys}}


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def table(result: dict[str, Any]) -> str:
    head = ("host pages", "params", "hit", "host hit", "ttft mean", "p50", "p90", "p99")
    rows = [head]
    for r in result["runs"]:
        params = ", ".join(f"{k}={v:g}" for k, v in r["params"].items()) or "defaults"
        rows.append(
            (
                str(r["l2"]),
                params,
                f"{r['hit_rate']:.3f}",
                f"{r['hit_rate_host']:.3f}",
                f"{r['ttft_mean_ms']:.0f}",
                f"{r['ttft_p50_ms']:.0f}",
                f"{r['ttft_p90_ms']:.0f}",
                f"{r['ttft_p99_ms']:.0f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    b = result["best"]
    params = ", ".join(f"{k}={v:g}" for k, v in b["params"].items()) or "the defaults"
    lines.append(
        f"best: {result['workers']} engines x {result['l1_blocks']} GPU pages, "
        f"{b['l2']} host pages each, {POLICY} with {params}: TTFT mean {b['ttft_mean_ms']:.0f} ms, "
        f"hit rate {b['hit_rate']:.3f}"
    )
    return "\n".join(lines)


def _fail(message: str) -> int:
    print(f"cache-router tune: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        weights, fractions = _floats(args.weights), _floats(args.fractions)
        hosts = None if args.hosts is None else [int(x) for x in args.hosts.split(",")]
    except ValueError as exc:
        return _fail(f"--hosts, --weights and --fractions are comma-separated numbers ({exc})")
    if args.block_size < 1 or args.workers < 1 or args.l1_blocks < 1:
        return _fail("--block-size, --workers and --l1-blocks must be >= 1")
    if hosts is not None and (not hosts or min(hosts) < 0):
        return _fail("--hosts must be host page counts >= 0")
    if any(w < 0 for w in weights) or any(not 0 < f <= 1 for f in fractions):
        return _fail("--weights must be >= 0 and --fractions in (0, 1]")
    try:
        trace = trace_from(args)
    except TraceError as exc:
        return _fail(str(exc))
    if hosts is None:
        hosts = host_candidates(trace, args.workers, args.l1_blocks)
    config = SimConfig(
        workers=args.workers, l1_blocks=args.l1_blocks, engine_seed=args.seed, seed=args.seed
    )
    result = {
        "trace": str(args.trace),
        "requests": len(trace.requests),
        "workers": args.workers,
        "l1_blocks": args.l1_blocks,
        "hosts_tried": hosts,
        **search(trace, config, hosts, weights, fractions, args.jobs),
    }
    if args.json:
        write_json(result, args.json)
    if args.json != "-":
        print(table(result))
    return 0
