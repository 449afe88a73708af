"""``cache-router forecast``: the capacity forecast (``index.capacity``) offline, on a trace.

Reads the trace as ``replay`` does (``sim.traces.load_trace``: Mooncake ``hash_ids`` or
plain JSONL) and feeds every request's router block hashes to the same analysis the
router runs online. ``--workers/--l1-blocks/--l2-blocks`` give the pool's sizes (the
predicted hit rates are read at them). With ``--policy`` the trace is also routed by
the simulator (``sim.simulator.Simulation``), which gives the per-worker curves under
that routing and, next to each prediction, the hit rate the simulated engines delivered.

``--json -`` prints one JSON object; ``--plot`` draws the curves to a PNG.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from index.capacity import CapacityForecast, Sampling, Tiers
from policies import Decision, Policy, RouteRequest, WorkerView, known_policies
from sim.report import write_json
from sim.simulator import SimConfig, Simulation
from sim.traces import Trace, TraceError, add_trace_arguments, trace_from

_DEFAULTS = SimConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    parser.add_argument("--workers", type=int, default=_DEFAULTS.workers, help="engines")
    parser.add_argument("--l1-blocks", type=int, default=_DEFAULTS.l1_blocks, help="GPU pages")
    parser.add_argument("--l2-blocks", type=int, default=0, help="host pages (0: none)")
    parser.add_argument(
        "--policy",
        choices=known_policies(),
        help="also route with the simulator: per-worker curves",
    )
    parser.add_argument(
        "--tracked",
        type=int,
        default=Sampling().max_tracked,
        help="blocks each stack samples (0: exact, every block)",
    )
    parser.add_argument("--json", metavar="PATH|-", help="write the forecast as JSON")
    parser.add_argument("--plot", metavar="PATH", help="PNG of the hit-rate curves")


def sampling(tracked: int) -> Sampling:
    """``tracked`` blocks per stack; 0: every block, exact (memory grows with the trace)."""
    if tracked == 0:
        return Sampling(max_tracked=1 << 40, hot_blocks=0, horizon=None)
    return Sampling(max_tracked=tracked)


def forecast(
    trace: Trace,
    config: SimConfig,
    *,
    policy: str | None = None,
    policy_params: dict[str, Any] | None = None,
    samples: Sampling | None = None,
) -> dict[str, Any]:
    """The forecast's report for ``trace`` at ``config``'s sizes (and, with ``policy``,
    per worker as the simulator routed it, with what its engines delivered)."""
    fc = CapacityForecast(trace.block_size, samples or Sampling())
    ids = [f"w{i}" for i in range(config.workers)]
    caps = {w: Tiers(config.l1_blocks, config.l2_blocks) for w in ids}
    simulated: dict[str, Any] | None = None
    if policy is None:
        for req in trace.requests:
            fc.observe(None, req.router_hashes.tolist(), req.input_len)
    else:
        sim = Simulation(trace, policy, config, policy_params=policy_params)
        hinted = _Hints(sim.policy)
        sim.policy = hinted  # type: ignore[assignment]
        report = sim.run()
        bs = trace.block_size
        per: dict[str, list[int]] = {w: [0, 0, 0] for w in ids}
        for r in sim.requests:  # in arrival order: the order the router saw them
            wid = ids[r.worker]
            hashes = trace.requests[r.idx].router_hashes.tolist()
            fc.observe(wid, hashes, r.input_len, hinted.blocks.get(r.rid, 0))
            acc = per[wid]
            acc[0] += r.hit_gpu_blocks * bs
            acc[1] += r.hit_host_blocks * bs
            acc[2] += r.input_len
        simulated = {
            "policy": policy,
            "hit_rate": report["hit_rate"],
            "hit_rate_gpu": report["hit_rate_gpu"],
            "hit_rate_host": report["hit_rate_host"],
            "ttft_mean_ms": report["ttft_mean_ms"],
            "ttft_p90_ms": report["ttft_p90_ms"],
            "workers": {
                w: {
                    "hit_rate": (g + h) / n if n else 0.0,
                    "hit_rate_gpu": g / n if n else 0.0,
                    "hit_rate_host": h / n if n else 0.0,
                }
                for w, (g, h, n) in per.items()
            },
        }
    out = fc.report(caps)
    pool_size = config.workers * (config.l1_blocks + config.l2_blocks)
    out["pooled_lru_hit_rate"] = trace.pooled_lru_hit_rate(pool_size)  # the sim's reference
    if simulated is not None:
        out["simulated"] = simulated
        # token-weighted over workers: what the routed pool as a whole is predicted to hit
        tok = {w: s.curve.tokens for w, s in fc.workers.items()}
        total = sum(tok.values()) or 1
        out["predicted_routed_hit_rate"] = (
            sum(out["workers"][w]["predicted_hit_rate"] * tok[w] for w in tok) / total
        )
    return out


class _Hints:
    """The policy, remembering the blocks each decision's prefetch hint pulls to the
    chosen worker (what the router passes to its forecast)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.blocks: dict[str, int] = {}

    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        decision = self.policy.select(request, workers)
        hint = decision.prefetch
        if hint is not None and hint.target_worker == decision.worker_id:
            self.blocks[request.request_id] = hint.blocks
        return decision

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)


def _fail(message: str) -> int:
    print(f"cache-router forecast: error: {message}", file=sys.stderr)
    return 2


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(trace: str, result: dict[str, Any]) -> str:
    pool = result["pooled"]
    lines = [
        f"trace {trace}: {result['requests']} requests, block size {result['block_size']}, "
        f"ceiling hit rate {result['ceiling_hit_rate']:.3f} (unbounded cache)",
        f"pool {pool['capacity_blocks']} blocks: predicted {_pct(pool['predicted_hit_rate'])} "
        f"(one LRU; the simulator's pooled LRU: {result['pooled_lru_hit_rate']:.3f}), "
        f"saturates at {pool['saturation_blocks']} blocks, working set (95 % of the ceiling) "
        f"{result['working_set_blocks']} blocks",
        "blocks needed: "
        + ", ".join(f"{k} % of the ceiling {v}" for k, v in result["needed_blocks"].items()),
    ]
    lines += [f"warning: {w}" for w in result["warnings"]]
    sim = result.get("simulated")
    if sim is not None:
        lines.append(
            f"under {sim['policy']}: predicted {result['predicted_routed_hit_rate']:.3f}, "
            f"simulated {sim['hit_rate']:.3f}"
        )
        rows = [("worker", "gpu", "host", "pred", "sim", "pred gpu", "sim gpu", "saturates")]
        for wid, w in result["workers"].items():
            s = sim["workers"][wid]
            rows.append(
                (
                    wid,
                    str(w["gpu_blocks"]),
                    str(w["host_blocks"]),
                    _pct(w["predicted_hit_rate"]),
                    _pct(s["hit_rate"]),
                    _pct(w["predicted_gpu_hit_rate"]),
                    _pct(s["hit_rate_gpu"]),
                    str(w["saturation_blocks"]),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(
        "pooled curve (blocks: hit rate): " + ", ".join(f"{c}: {r:.3f}" for c, r in pool["curve"])
    )
    return "\n".join(lines)


def plot(trace: str, result: dict[str, Any], path: str) -> None:
    """Hit rate vs cache size: the pooled curve, each worker's, the sizes, the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    pool = result["pooled"]
    xs, ys = zip(*pool["curve"], strict=True)
    ax.plot(xs, ys, marker="o", color="black", label="pooled (one LRU: the ceiling)")
    for wid, w in result["workers"].items():
        wx, wy = zip(*w["curve"], strict=True)
        ax.plot(wx, wy, alpha=0.5, label=f"{wid} (as routed)")
    ax.axhline(result["ceiling_hit_rate"], color="grey", linestyle=":", label="unbounded")
    if pool["capacity_blocks"]:
        ax.axvline(pool["capacity_blocks"], color="tab:red", linestyle="--", label="pool size")
    ax.axvline(pool["saturation_blocks"], color="tab:green", linestyle="--", label="saturation")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"cache size (blocks of {result['block_size']} tokens)")
    ax.set_ylabel("prompt-token hit rate")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"{trace}: {result['requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.block_size < 1 or args.workers < 1 or args.l1_blocks < 1 or args.l2_blocks < 0:
        return _fail("--block-size, --workers and --l1-blocks must be >= 1, --l2-blocks >= 0")
    if args.tracked < 0 or (args.limit is not None and args.limit < 1):
        return _fail("--tracked must be >= 0 and --limit >= 1")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail("--plot needs matplotlib: pip install 'cache-router[plot]'")
    try:
        trace = trace_from(args)
    except TraceError as exc:
        return _fail(str(exc))
    config = SimConfig(
        workers=args.workers,
        l1_blocks=args.l1_blocks,
        l2_blocks=args.l2_blocks,
        engine_seed=args.seed,
        seed=args.seed,
    )
    result = {
        "trace": str(args.trace),
        "workers": args.workers,
        "l1_blocks": args.l1_blocks,
        "l2_blocks": args.l2_blocks,
        **forecast(trace, config, policy=args.policy, samples=sampling(args.tracked)),
    }
    if args.json:
        write_json(result, args.json)
    if args.json != "-":
        print(table(str(args.trace), result))
    if args.plot:
        plot(str(args.trace), result, args.plot)
    return 0
