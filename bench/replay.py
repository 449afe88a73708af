"""Trace replay, side by side: our policies in our simulator, Dynamo's mocker as reference.

Prints one JSON object: per trace, our per-policy reports, Dynamo's own
``run_mocker_trace_replay`` (router_mode round_robin and kv_router) when
``ai-dynamo-runtime`` is importable, and ratios. Asserts nothing. ``--markdown PATH``
also writes the tables used in BENCHMARKS.md.

    python3 bench/replay.py --quick
    /tmp/dynvenv/bin/python bench/replay.py --workers 8 --markdown /tmp/tables.md \\
        --trace ../shared/data/traces/conversation_trace.jsonl \\
        --trace ../shared/data/traces/synthetic_trace.jsonl

Dynamo's mocker has its own engine model (timings, 16384 pages of 64 tokens by default),
so its TTFT is a reference, not a like-for-like number; its hit rate
(``prefix_cache_reused_ratio``) is comparable. Both sides get the same trace, worker
count, arrival speed-up and KV event lag.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

from policies import POLICY_NAMES
from sim.simulator import SimConfig
from sim.trace_replay import replay_trace
from sim.traces import MOONCAKE_BLOCK, load_trace

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "traces"
QUICK_LIMIT = 400


def dynamo_rows(
    trace: Path, workers: int, speedup: float, lag_ms: float, limit: int | None
) -> dict[str, dict[str, float]] | None:
    """Dynamo's mocker on the same trace: round_robin and kv_router (default config)."""
    os.environ.setdefault("DYN_LOG", "warn")  # read once, when the module loads
    try:
        from dynamo._core import KvRouterConfig, run_mocker_trace_replay
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = trace
        if limit is not None:
            path = Path(tmp) / trace.name
            with trace.open("rb") as src, path.open("wb") as dst:
                for _, line in zip(range(limit), src, strict=False):
                    dst.write(line)
        rows = {}
        for mode in ("round_robin", "kv_router"):
            extra: dict[str, Any] = {}
            if mode == "kv_router":
                extra = {"router_config": KvRouterConfig(), "kv_event_lag_ms": lag_ms}
            started = time.perf_counter()
            result = run_mocker_trace_replay(
                [str(path)],
                num_workers=workers,
                router_mode=mode,
                trace_block_size=MOONCAKE_BLOCK,
                arrival_speedup_ratio=speedup,
                **extra,
            )
            s = result.summary
            rows[mode] = {
                "hit_rate": s["prefix_cache_reused_ratio"],
                "ttft_mean_ms": s["mean_ttft_ms"],
                "ttft_p50_ms": s["median_ttft_ms"],
                "ttft_p90_ms": s["p90_ttft_ms"],
                "ttft_p99_ms": s["p99_ttft_ms"],
                "throughput_rps": s["request_throughput_rps"],
                "completed": s["completed_requests"],
                "wall_s": time.perf_counter() - started,
            }
    return rows


def _by_policy(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["policy"]: r for r in results}


def ratios(entry: dict[str, Any]) -> dict[str, float | None]:
    """The issue's targets as numbers (None when a side is missing)."""
    ours = _by_policy(entry["ours"])
    ideal = entry["ideal_hit_rate"]
    out: dict[str, float | None] = {}
    best = ours.get("cache_aware")
    if best is None:
        return out
    out["cache_aware_hit_over_ideal"] = best["hit_rate"] / ideal if ideal else None
    out["cache_aware_prefill_load_max_over_mean"] = best["prefill_load_max_over_mean"]
    for rival in ("sglang_cache_aware", "dynamo_kv", "round_robin"):
        if rival in ours:
            out[f"cache_aware_ttft_p90_over_{rival}"] = (
                best["ttft_p90_ms"] / ours[rival]["ttft_p90_ms"]
            )
    others = [r["ttft_p90_ms"] for name, r in ours.items() if name != "cache_aware"]
    out["cache_aware_ttft_p90_over_best_other"] = (
        best["ttft_p90_ms"] / min(others) if others else None
    )
    dyn = entry["dynamo"]
    if dyn:
        out["dynamo_kv_router_hit_over_ideal"] = dyn["kv_router"]["hit_rate"] / ideal
        out["cache_aware_hit_over_dynamo_kv_router"] = (
            best["hit_rate"] / dyn["kv_router"]["hit_rate"]
            if dyn["kv_router"]["hit_rate"]
            else None
        )
    return out


_COLUMNS = (
    ("hit_rate", "hit rate", "{:.3f}"),
    ("hit_rate_host", "host hits", "{:.3f}"),
    ("hit_rate_best_worker", "best-worker hit", "{:.3f}"),
    ("ttft_mean_ms", "TTFT mean", "{:.0f}"),
    ("ttft_p50_ms", "p50", "{:.0f}"),
    ("ttft_p90_ms", "p90", "{:.0f}"),
    ("ttft_p99_ms", "p99", "{:.0f}"),
    ("queue_mean_ms", "queue mean", "{:.0f}"),
    ("prefill_load_max_over_mean", "prefill load max/mean", "{:.2f}"),
    ("prefetch_tokens", "prefetch tokens", "{:,}"),
    ("cache_loss", "cache loss", "{:.3f}"),
    ("throughput_rps", "req/s", "{:.2f}"),
)


def markdown(entry: dict[str, Any]) -> str:
    head = "| policy | " + " | ".join(h for _, h, _ in _COLUMNS) + " |"
    rule = "|" + "---|" * (len(_COLUMNS) + 1)
    lines = [
        f"**{entry['trace']}**: {entry['requests']} requests, {entry['workers']} workers, "
        f"ideal hit rate **{entry['ideal_hit_rate']:.3f}** (one infinite cache), "
        f"**{entry['pooled_lru_hit_rate']:.3f}** (one LRU cache of the pool's capacity)",
        "",
        head,
        rule,
    ]
    for r in entry["ours"]:
        cells = [fmt.format(r[k]) for k, _, fmt in _COLUMNS]
        lines.append(f"| {r['policy']} | " + " | ".join(cells) + " |")
    for mode, r in (entry["dynamo"] or {}).items():
        cells = [fmt.format(r[k]) if k in r else "n/a" for k, _, fmt in _COLUMNS]
        lines.append(f"| Dynamo mocker {mode} (its own engine model) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append", type=Path, help="repeatable")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--speedup", type=float, default=1.0)
    ap.add_argument("--l1-blocks", type=int, default=SimConfig().l1_blocks)
    ap.add_argument("--l2-blocks", type=int, default=0)
    ap.add_argument("--limit", type=int, help="first N requests of each trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int)
    ap.add_argument("--quick", action="store_true", help=f"first {QUICK_LIMIT} requests")
    ap.add_argument("--markdown", type=Path, help="also write the tables here")
    ap.add_argument("--no-dynamo", action="store_true", help="skip Dynamo's mocker")
    args = ap.parse_args()
    traces = args.trace or [
        DATA / "conversation_trace.jsonl",
        DATA / "synthetic_trace.jsonl",
    ]
    limit = args.limit or (QUICK_LIMIT if args.quick else None)
    policies = [p for p in args.policies.split(",") if p]
    config = SimConfig(
        workers=args.workers,
        l1_blocks=args.l1_blocks,
        l2_blocks=args.l2_blocks,
        seed=args.seed,
        engine_seed=args.seed,
    )
    out: dict[str, Any] = {"workers": args.workers, "limit": limit, "traces": []}
    for path in traces:
        started = time.perf_counter()
        trace = load_trace(path, seed=args.seed, speedup=args.speedup, limit=limit)
        load_s = time.perf_counter() - started
        ours = replay_trace(trace, policies, config, jobs=args.jobs)
        entry = {
            "trace": path.name,
            "requests": len(trace.requests),
            "workers": args.workers,
            "ideal_hit_rate": trace.ideal_hit_rate(),
            "pooled_lru_hit_rate": trace.pooled_lru_hit_rate(
                args.workers * (args.l1_blocks + args.l2_blocks)
            ),
            "load_s": load_s,
            "ours_wall_s": time.perf_counter() - started,
            "ours": ours,
            "dynamo": None
            if args.no_dynamo
            else dynamo_rows(path, args.workers, args.speedup, config.event_lag_ms, limit),
        }
        entry["ratios"] = ratios(entry)
        out["traces"].append(entry)
    sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
    if args.markdown:
        args.markdown.write_text("\n".join(markdown(e) for e in out["traces"]))


if __name__ == "__main__":
    main()
