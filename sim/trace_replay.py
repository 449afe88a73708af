"""``cache-router replay``: run a trace through the simulator once per policy, compare.

Policies run in parallel processes (fork: the prepared trace is shared, not pickled).
``--json -`` prints exactly one JSON object on stdout; the table goes to stdout
otherwise. A progress bar is drawn on stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import multiprocessing as mp
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import orjson

from index.groups import parse_groups
from policies import POLICY_NAMES, EngineCosts, known_policies
from sim.pd import PD_RULES, PdSimulation, parse_rule
from sim.report import PolicyReport, write_json
from sim.simulator import SimConfig, Simulation
from sim.traces import Trace, TraceError, add_trace_arguments, trace_from

# Set before the worker processes fork, so they inherit the trace instead of a pickle.
_TRACE: Trace | None = None
_PROGRESS: Any = None  # multiprocessing.Array of per-policy finished counts
_PROGRESS_EVERY = 64
_DEFAULTS = SimConfig()

_TABLE = (
    ("policy", "policy", "{}"),
    ("hit_rate", "hit", "{:.3f}"),
    ("ttft_mean_ms", "ttft mean", "{:.0f}"),
    ("ttft_p50_ms", "p50", "{:.0f}"),
    ("ttft_p90_ms", "p90", "{:.0f}"),
    ("ttft_p99_ms", "p99", "{:.0f}"),
    ("queue_mean_ms", "queue", "{:.0f}"),
    ("prefill_load_max_over_mean", "load max/mean", "{:.2f}"),
    ("prefetch_tokens", "prefetch tok", "{}"),
    ("cache_loss", "loss", "{:.3f}"),
    ("overpromised_share", "over-promised", "{:.3f}"),
)
_PD_TABLE = (
    ("policy", "PD rule", "{}"),
    ("hit_rate", "prefill hit", "{:.3f}"),
    ("ttft_mean_ms", "ttft mean", "{:.0f}"),
    ("ttft_p50_ms", "p50", "{:.0f}"),
    ("ttft_p90_ms", "p90", "{:.0f}"),
    ("tpot_mean_ms", "tpot mean", "{:.1f}"),
    ("tpot_p90_ms", "tpot p90", "{:.1f}"),
    ("prefill_queue_mean_ms", "prefill queue", "{:.0f}"),
    ("transfer_mean_ms", "transfer", "{:.0f}"),
    ("local_prefill_share", "local", "{:.2f}"),
    ("prefill_load_max_over_mean", "prefill max/mean", "{:.2f}"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    parser.add_argument("--workers", type=int, default=8, help="engines in the pool")
    parser.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated, from: {', '.join(POLICY_NAMES)} or a plugin's (default: all)",
    )
    parser.add_argument("--l1-blocks", type=int, default=_DEFAULTS.l1_blocks, help="GPU pages")
    parser.add_argument("--l2-blocks", type=int, default=0, help="host pages (0: none)")
    parser.add_argument("--json", metavar="PATH|-", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="PNG of hit rate and TTFT per policy")
    parser.add_argument(
        "--event-lag-ms", type=float, default=_DEFAULTS.event_lag_ms, help="KV event delay"
    )
    parser.add_argument(
        "--load-interval-ms",
        type=float,
        default=_DEFAULTS.load_interval_ms,
        help="engine load report period",
    )
    parser.add_argument(
        "--predict-ttl-ms",
        type=float,
        default=0.0,
        help="predict-on-route TTL (0: off)",
    )
    parser.add_argument(
        "--engine-costs",
        metavar="JSON|PATH",
        help="the simulated engines' EngineCosts fields, as a JSON object or a .json/.toml "
        "file, e.g. '{\"prefill_ms_per_token\": 0.1}' for engines 2x slower than the "
        "policies assume (they always estimate with the defaults)",
    )
    parser.add_argument("--jobs", type=int, help="parallel processes (default: one per core)")
    parser.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="a disaggregated pool (sim/pd.py): this many prefill engines and --workers "
        "decode engines; --policies are then PD rules, PREFILL+DECODE or one of "
        f"{', '.join(PD_RULES)} (default: those)",
    )
    parser.add_argument(
        "--dp-size", type=int, default=1, help="data-parallel ranks per engine, each its own cache"
    )
    parser.add_argument(
        "--kv-groups",
        default="",
        help='a hybrid model\'s KV-cache groups, e.g. "full,sliding_window:4096,mamba"',
    )
    parser.add_argument(
        "--group-blocks",
        type=int,
        default=0,
        help="pages of each KV-cache group past the first (0: --l1-blocks)",
    )
    parser.add_argument(
        "--blind",
        choices=("dp", "groups"),
        help="also run each policy behind a router blind to DP ranks (merged in the index, "
        "the engine picks the rank) or to the KV-cache groups (full attention matched "
        "alone), reported as 'POLICY (dp-blind)' / 'POLICY (groups-blind)'",
    )
    parser.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=0,
        help="with --prefill-workers: the decode engine prefills itself below this many "
        "uncached tokens (0: always a remote prefill)",
    )


def _fail(message: str) -> int:
    print(f"cache-router replay: error: {message}", file=sys.stderr)
    return 2


def engine_costs(value: str | None) -> EngineCosts:
    """``--engine-costs``: a JSON object, or a JSON / TOML file of EngineCosts fields."""
    if value is None:
        return EngineCosts()
    text = value.strip()
    if text.startswith("{"):
        try:
            fields = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"--engine-costs: not a JSON object: {exc}") from None
    else:
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"--engine-costs: {path}: no such file")
        try:
            if path.suffix == ".toml":
                fields = tomllib.loads(path.read_text())
            else:
                fields = orjson.loads(path.read_bytes())
        except (tomllib.TOMLDecodeError, orjson.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"--engine-costs: {path}: {exc}") from None
    if not isinstance(fields, dict):
        raise ValueError("--engine-costs: expected an object of EngineCosts fields")
    try:
        return EngineCosts.from_config(fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--engine-costs: {exc}") from None


def _check(args: argparse.Namespace) -> list[str] | str:
    """The policy list, or what is wrong with the arguments."""
    if args.prefill_workers < 0 or args.local_prefill_tokens < 0:
        return "--prefill-workers and --local-prefill-tokens must be >= 0"
    if args.prefill_workers:
        text = args.policies if args.policies is not None else ",".join(PD_RULES)
        rules = [p.strip() for p in text.split(",") if p.strip()]
        for rule in rules:
            try:
                parse_rule(rule)
            except ValueError as exc:
                return str(exc)
        policies = rules
    else:
        text = args.policies if args.policies is not None else ",".join(POLICY_NAMES)
        policies = [p.strip() for p in text.split(",") if p.strip()]
        unknown = [p for p in policies if p not in known_policies()]
        if not policies or unknown:
            return f"unknown policy {unknown or text!r}; known: {', '.join(known_policies())}"
    if not policies:
        return "no policy to run"
    if args.workers < 1:
        return "--workers must be >= 1"
    if not 1 <= args.dp_size <= 64 or args.group_blocks < 0:
        return "--dp-size must be in [1, 64], --group-blocks >= 0"
    try:
        groups = parse_groups(args.kv_groups)
    except ValueError as exc:
        return f"--kv-groups: {exc}"
    if groups and groups[0].kind != "full":
        return "--kv-groups: group 0 must be full attention"
    if args.blind == "dp" and args.dp_size < 2:
        return "--blind dp needs --dp-size >= 2"
    if args.blind == "groups" and len(groups) < 2:
        return "--blind groups needs --kv-groups with two or more groups"
    if args.prefill_workers and (args.blind or args.dp_size > 1 or groups):
        return "--prefill-workers runs without --dp-size, --kv-groups or --blind"
    if args.block_size < 1 or args.l1_blocks < 1 or args.l2_blocks < 0:
        return "--block-size and --l1-blocks must be >= 1, --l2-blocks >= 0"
    if args.limit is not None and args.limit < 1:
        return "--limit must be >= 1"
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib: pip install 'cache-router[plot]'"
    return policies


def blind_config(config: SimConfig, blind: str) -> SimConfig:
    """The same pool behind a router blind to DP ranks or to the KV-cache groups."""
    if blind == "dp":
        return dataclasses.replace(config, dp_aware=False)
    return dataclasses.replace(config, groups_aware=False)


def _simulate(
    k: int, policy: str, config: SimConfig, params: dict[str, Any] | None = None
) -> PolicyReport:
    assert _TRACE is not None
    progress = None
    if _PROGRESS is not None:
        counts = _PROGRESS

        def progress(done: int) -> None:
            if done % _PROGRESS_EVERY == 0:
                counts[k] = done

    simulation = PdSimulation if config.prefill_workers else Simulation
    report = simulation(_TRACE, policy, config, policy_params=params, progress=progress).run()
    if not config.dp_aware:
        report["policy"] = f"{report['policy']} (dp-blind)"
    elif not config.groups_aware:
        report["policy"] = f"{report['policy']} (groups-blind)"
    if _PROGRESS is not None:
        _PROGRESS[k] = len(_TRACE.requests)
    return report


def _bar(counts: Any, total: int, started: float) -> None:
    done = sum(counts)
    frac = done / total if total else 1.0
    width = 30
    fill = int(frac * width)
    elapsed = time.monotonic() - started
    sys.stderr.write(f"\rreplay [{'#' * fill}{'.' * (width - fill)}] {frac:6.1%} {elapsed:5.0f}s")
    sys.stderr.flush()


def replay_trace(
    trace: Trace,
    policies: list[str],
    config: SimConfig,
    *,
    jobs: int | None = None,
    blind: str | None = None,
    policy_params: dict[str, dict[str, Any]] | None = None,
) -> list[PolicyReport]:
    """Run each policy over ``trace``, in parallel processes; reports in ``policies`` order
    (with ``blind``, each followed by its run behind the blind router). ``policy_params``:
    parameters by policy name (``bench/sweep.py --params``: the policy under test's)."""
    global _TRACE, _PROGRESS
    runs = [(p, config) for p in policies]
    if blind is not None:
        other = blind_config(config, blind)
        runs = [r for p in policies for r in ((p, config), (p, other))]
    params = policy_params or {}
    jobs = min(len(policies), jobs or os.cpu_count() or 1)
    show = sys.stderr.isatty()
    ctx = mp.get_context("fork")
    _TRACE = trace
    _PROGRESS = ctx.Array("q", len(runs), lock=False) if show else None
    total = len(trace.requests) * len(runs)
    started = time.monotonic()
    try:
        if jobs <= 1:
            return [_simulate(k, p, c, params.get(p)) for k, (p, c) in enumerate(runs)]
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = [
                pool.submit(_simulate, k, p, c, params.get(p)) for k, (p, c) in enumerate(runs)
            ]
            pending = set(futures)
            while pending:
                _, pending = cf.wait(pending, timeout=0.5)
                if show:
                    _bar(_PROGRESS, total, started)
            return [f.result() for f in futures]
    finally:
        if show:
            _bar(_PROGRESS, total, started)
            sys.stderr.write("\n")
        _TRACE = _PROGRESS = None


def _table(result: dict[str, Any]) -> str:
    table = _PD_TABLE if result.get("prefill_workers") else _TABLE
    rows = [[head for _, head, _ in table]]
    rows += [[fmt.format(r[key]) for key, _, fmt in table] for r in result["results"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(table))]
    pool = f"{result['workers']} workers"
    if result.get("prefill_workers"):
        pool = f"{result['prefill_workers']} prefill + {result['workers']} decode engines"
    lines = [
        f"trace {result['trace']}: {result['requests']} requests, {pool}, "
        f"ideal hit rate {result['ideal_hit_rate']:.3f} (infinite cache), "
        f"{result['pooled_lru_hit_rate']:.3f} (one LRU of the pool's capacity)"
    ]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Hit rate (with the ideal as a line) and TTFT mean / p90 per policy, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = result["results"]
    names = [r["policy"] for r in results]
    x = range(len(names))
    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(names)), 4.5))
    ax_hit.bar(x, [r["hit_rate"] for r in results], color="tab:blue")
    ax_hit.axhline(result["ideal_hit_rate"], color="black", linestyle="--", label="ideal")
    ax_hit.set_ylabel("token hit rate")
    ax_hit.legend()
    half = 0.2
    ax_ttft.bar([i - half for i in x], [r["ttft_mean_ms"] for r in results], 2 * half, label="mean")
    ax_ttft.bar([i + half for i in x], [r["ttft_p90_ms"] for r in results], 2 * half, label="p90")
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.legend()
    for ax in (ax_hit, ax_ttft):
        ax.set_xticks(list(x), names, rotation=30, ha="right")
    fig.suptitle(f"{result['trace']}: {result['workers']} workers, {result['requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    policies = _check(args)
    if isinstance(policies, str):
        return _fail(policies)
    if sys.stderr.isatty():
        sys.stderr.write(f"replay: reading and hashing {args.trace} ...\n")
    try:
        trace = trace_from(args)
    except TraceError as exc:
        return _fail(str(exc))
    try:
        costs = engine_costs(args.engine_costs)
    except ValueError as exc:
        return _fail(str(exc))
    config = SimConfig(
        workers=args.workers,
        l1_blocks=args.l1_blocks,
        l2_blocks=args.l2_blocks,
        event_lag_ms=args.event_lag_ms,
        load_interval_ms=args.load_interval_ms,
        predict_ttl_ms=args.predict_ttl_ms,
        engine_seed=args.seed,
        seed=args.seed,
        costs=costs,
        prefill_workers=args.prefill_workers,
        local_prefill_tokens=args.local_prefill_tokens,
        dp_size=args.dp_size,
        kv_groups=args.kv_groups,
        group_blocks=args.group_blocks,
    )
    results = replay_trace(trace, policies, config, jobs=args.jobs, blind=args.blind)
    result = {
        "trace": str(args.trace),
        "workers": args.workers,
        "prefill_workers": args.prefill_workers,
        "local_prefill_tokens": args.local_prefill_tokens,
        "dp_size": args.dp_size,
        "kv_groups": args.kv_groups,
        "group_blocks": args.group_blocks,
        "blind": args.blind,
        "requests": len(trace.requests),
        "block_size": args.block_size,
        "l1_blocks": args.l1_blocks,
        "l2_blocks": args.l2_blocks,
        "speedup": args.speedup,
        "seed": args.seed,
        "event_lag_ms": args.event_lag_ms,
        "load_interval_ms": args.load_interval_ms,
        "predict_ttl_ms": args.predict_ttl_ms,
        "engine_costs": {
            f.name: getattr(costs, f.name) for f in dataclasses.fields(costs) if f.init
        },
        "ideal_hit_rate": trace.ideal_hit_rate(),
        "pooled_lru_hit_rate": trace.pooled_lru_hit_rate(
            (args.workers + args.prefill_workers) * (args.l1_blocks + args.l2_blocks)
        ),
        "results": results,
    }
    if args.json:
        write_json(result, args.json)
    if args.json != "-":
        print(_table(result))
    if args.plot:
        plot(result, args.plot)
    return 0
