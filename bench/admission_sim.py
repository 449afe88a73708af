"""Admission in the simulator: each policy with and without it on seeded chat traces past
saturation (issue 31: what admission costs or saves where the engines' queues, not the
router's, used to hold the backlog).

The trace is tests/test_sim_admission.py's: chat over four shared system prompts, 150
sessions at 3 a second, four engines, arrivals sped up ``--loads`` times (2x: the pool
just past saturation). Per (seed, load, policy): hit rate, TTFT p50/p90/p99 (ms) of the
requests served, requests shed, and ``good_share``: the share of all requests served
with a TTFT within ``--slo`` (2 s; the percentiles leave the shed out, this counts
them), without admission and with the defaults (``--lifo on,off``: with ``queue_lifo``
on and off, each its own row).

    flock /tmp/cpu-heavy.lock python bench/admission_sim.py [--seeds 1,2,3] [--loads 2,3]

Prints one JSON object; never asserts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.admission.core import AdmissionSettings  # noqa: E402
from sim.gen_trace import generate, write  # noqa: E402
from sim.simulator import SimConfig, Simulation  # noqa: E402
from sim.traces import load_trace  # noqa: E402

TTFT = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    slo_ms = 1000.0 * args.slo
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(x) for x in args.seeds.split(",")):
            lines = generate("chat", sessions=150, rate=3.0, system_prompts=4, seed=seed)
            path = write(Path(tmp) / f"chat{seed}.jsonl", lines)
            for load in (float(x) for x in args.loads.split(",")):
                trace = load_trace(path, block_size=16, speedup=load)
                for policy in args.policies.split(","):
                    settings = [AdmissionSettings(lifo=x == "on") for x in args.lifo.split(",")]
                    for admission in (None, *settings):
                        config = SimConfig(workers=args.workers, admission=admission)
                        sim = Simulation(trace, policy, config)
                        r = sim.run()
                        good = sum(
                            0 <= q.first_token_ms - q.arrival_ms <= slo_ms
                            for q in sim.requests
                            if q.first_token_ms >= 0
                        )
                        rows.append({
                            "seed": seed, "load": load, "policy": policy,
                            "admission": admission is not None,
                            "lifo": None if admission is None else admission.lifo,
                            "hit_rate": round(r["hit_rate"], 3),
                            **{k: round(r[k]) for k in TTFT},
                            "shed": r["shed"],
                            "good_share": round(good / max(1, len(sim.requests)), 3),
                        })  # fmt: skip
                        print(orjson.dumps(rows[-1]).decode(), file=sys.stderr)
    return {"workers": args.workers, "slo_s": args.slo, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--loads", default="2,3", help="arrival speed-ups of the trace")
    ap.add_argument("--policies", default="cache_aware")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--lifo", default="on", help="queue_lifo with admission: on, off or on,off")
    ap.add_argument("--slo", type=float, default=2.0, help="good_share's TTFT bound, seconds")
    print(orjson.dumps(run(ap.parse_args()), option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
