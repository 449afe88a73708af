"""Sweep: traces x load x memory x pool size x engine-cost mismatch x seeds, every policy.

One table of ``cache_aware`` against the best other policy per setting, with a Pareto
column (hit rate >= every other policy's and TTFT p90 <= every other's) and the issue-13
targets: p90 <= 1.1x the best other's p90, hit rate >= the best other's - 1 point, p90
never above 1.5x ``least_load``'s. Prints one JSON object (every policy's numbers per
setting); ``--markdown`` writes the table. Asserts nothing.

The machine is shared: run a slice of the grid at a time under the bench lock, then
merge the slices into one table::

    flock /work/bench.lock nice -n 5 python3 bench/sweep.py --grid quick > quick.json
    for i in 0 1 2; do  # the full grid is the quick one and 6 more settings
        flock /work/bench.lock nice -n 5 python3 bench/sweep.py --grid full --start 6 \\
            --part $i/3 > full.$i.json
    done
    python3 bench/sweep.py --merge quick.json full.*.json --markdown sweep.md > sweep.json

Agent-shaped traces come from ``sim.gen_trace`` (the ``cache-router gen-trace`` code);
the Mooncake traces are read from ``../shared/data/traces/`` (not committed).
Engine costs: ``1x`` is what the policies assume; ``slow2x`` engines take twice the
prefill and step time, ``fast2x`` half, ``decode2x`` twice the decode attention.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

from policies import POLICY_NAMES, EngineCosts
from sim.gen_trace import generate, write
from sim.simulator import SimConfig
from sim.trace_replay import replay_trace
from sim.traces import load_trace

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "traces"
COSTS: dict[str, dict[str, float]] = {
    "1x": {},
    "slow2x": {
        "prefill_ms_per_token": 0.1,
        "attn_ms_per_token_ctx": 4e-6,
        "decode_ms_per_step": 12,
    },
    "fast2x": {
        "prefill_ms_per_token": 0.025,
        "attn_ms_per_token_ctx": 1e-6,
        "decode_ms_per_step": 3,
    },
    "decode2x": {"decode_ms_per_kv_token": 8e-5},
}
# trace name -> (gen-trace shape, sessions) or a Mooncake file (and a request limit)
TRACES: dict[str, tuple[str, int] | tuple[Path, int | None]] = {
    "chat": ("chat", 300),
    "agent": ("agent", 40),
    "mooncake-conv": (DATA / "conversation_trace.jsonl", 1500),
    "mooncake-syn": (DATA / "synthetic_trace.jsonl", 2000),
}


@dataclass(frozen=True, slots=True)
class Setting:
    trace: str
    speedup: float = 1.0
    workers: int = 8
    l1_blocks: int = 16384
    l2_blocks: int = 0
    costs: str = "1x"
    seed: int = 0

    @property
    def label(self) -> str:
        mem = f"{self.l1_blocks}" + (f"+{self.l2_blocks}h" if self.l2_blocks else "")
        return f"{self.trace} x{self.speedup:g} w{self.workers} p{mem} {self.costs} s{self.seed}"


def grid(name: str) -> list[Setting]:
    quick = [
        Setting("chat", speedup=2.0),
        Setting("chat", l1_blocks=4096),
        Setting("agent", speedup=3.0, l1_blocks=4096),
        Setting("agent", l1_blocks=4096, seed=1),
        Setting("agent", costs="decode2x"),
        Setting("mooncake-syn", workers=8),
    ]
    if name == "quick":
        return quick
    return [
        *quick,
        Setting("chat", workers=4, costs="slow2x", speedup=0.5),
        Setting("chat", workers=16, speedup=2.0, costs="fast2x"),
        Setting("agent", workers=16, speedup=2.0, l1_blocks=4096),
        Setting("agent", l1_blocks=4096, l2_blocks=16384),
        Setting("mooncake-conv", workers=8),
        Setting("mooncake-conv", workers=16, speedup=2.0),
    ]


def _trace(s: Setting, tmp: Path) -> Any:
    spec = TRACES[s.trace]
    if isinstance(spec[0], str):
        path = write(
            tmp / f"{s.trace}.{s.seed}.jsonl", generate(spec[0], sessions=spec[1], seed=s.seed)
        )
        limit = None
    else:
        path, limit = spec
    return load_trace(path, 64, seed=s.seed, engine_seed=s.seed, speedup=s.speedup, limit=limit)


def run_setting(s: Setting, policies: list[str], tmp: Path, jobs: int | None) -> dict[str, Any]:
    trace = _trace(s, tmp)
    config = SimConfig(
        workers=s.workers,
        l1_blocks=s.l1_blocks,
        l2_blocks=s.l2_blocks,
        seed=s.seed,
        engine_seed=s.seed,
        costs=EngineCosts.from_config(COSTS[s.costs]),
    )
    start = time.perf_counter()
    reports = replay_trace(trace, policies, config, jobs=jobs)
    keep = ("hit_rate", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "busy_mean")
    keep += ("hinted_share", "off_best_worker_share", "prefill_tokens_computed")
    return {
        "setting": s.label,
        "requests": len(trace.requests),
        "ideal_hit_rate": trace.ideal_hit_rate(),
        "wall_s": time.perf_counter() - start,
        "results": {r["policy"]: {k: r[k] for k in keep} for r in reports},
    }


def judge(row: dict[str, Any], ours: str = "cache_aware") -> dict[str, Any]:
    """cache_aware against the others on one setting: ratios, Pareto, the targets."""
    res = row["results"]
    me = res[ours]
    others = {p: r for p, r in res.items() if p != ours}
    best_p90 = min(others, key=lambda p: others[p]["ttft_p90_ms"])
    best_hit = max(others, key=lambda p: others[p]["hit_rate"])
    p90_ratio = me["ttft_p90_ms"] / others[best_p90]["ttft_p90_ms"]
    hit_diff = me["hit_rate"] - others[best_hit]["hit_rate"]
    ll = others.get("least_load")
    ll_ratio = me["ttft_p90_ms"] / ll["ttft_p90_ms"] if ll else None
    return {
        "best_p90_other": best_p90,
        "best_hit_other": best_hit,
        "p90_over_best_other": p90_ratio,
        "hit_minus_best_other": hit_diff,
        "p90_over_least_load": ll_ratio,
        "pareto": hit_diff >= 0 and p90_ratio <= 1.0,
        "target_p90": p90_ratio <= 1.1,
        "target_hit": hit_diff >= -0.01,
        "target_never_collapse": ll_ratio is None or ll_ratio <= 1.5,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| setting | requests | cache_aware hit / p90 ms | best other hit | best other p90 ms "
        "| p90 / best other | hit - best other | p90 / least_load | Pareto-best | targets |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in rows:
        j = judge(row)
        me = row["results"]["cache_aware"]
        bh, bp = row["results"][j["best_hit_other"]], row["results"][j["best_p90_other"]]
        met = [j["target_p90"], j["target_hit"], j["target_never_collapse"]]
        lines.append(
            f"| {row['setting']} | {row['requests']} | {me['hit_rate']:.3f} / "
            f"{me['ttft_p90_ms']:.0f} | {bh['hit_rate']:.3f} ({j['best_hit_other']}) | "
            f"{bp['ttft_p90_ms']:.0f} ({j['best_p90_other']}) | {j['p90_over_best_other']:.2f} | "
            f"{100 * j['hit_minus_best_other']:+.1f} pt | {j['p90_over_least_load']:.2f} | "
            f"{'yes' if j['pareto'] else 'no'} | {sum(met)}/3 |"
        )
    n = len(rows)
    judged = [judge(r) for r in rows]
    summary = (
        f"\nPareto-best on {sum(j['pareto'] for j in judged)} of {n}; p90 <= 1.1x best other "
        f"on {sum(j['target_p90'] for j in judged)}; hit >= best other - 1 pt on "
        f"{sum(j['target_hit'] for j in judged)}; p90 <= 1.5x least_load on "
        f"{sum(j['target_never_collapse'] for j in judged)}.\n"
    )
    return head + "\n".join(lines) + "\n" + summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", choices=("quick", "full"), default="quick")
    ap.add_argument("--part", default="0/1", help="i/n: run every n-th setting from i")
    ap.add_argument("--start", type=int, default=0, help="skip the grid's first N settings")
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--jobs", type=int, help="parallel processes (default: one per core)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge earlier outputs")
    ap.add_argument("--markdown", metavar="PATH", help="write the table")
    args = ap.parse_args()
    if args.merge:
        rows = [row for p in args.merge for row in orjson.loads(Path(p).read_bytes())["rows"]]
    else:
        i, n = (int(x) for x in args.part.split("/"))
        settings = grid(args.grid)[args.start :][i::n]
        policies = args.policies.split(",")
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for s in settings:
                rows.append(run_setting(s, policies, Path(tmp), args.jobs))
                print(f"sweep: {s.label}: {rows[-1]['wall_s']:.0f} s", file=sys.stderr)
    for row in rows:
        row["judge"] = judge(row)
    sys.stdout.write(orjson.dumps({"rows": rows}, option=orjson.OPT_INDENT_2).decode() + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
