"""Decision cost of every routing policy, side by side in one run.

One ``select`` + ``on_finish`` per request over ``--workers`` candidate views built the
way the router builds them (per-tier match depths from a real ``PrefixIndex``, load
numbers), for prompts of ``--blocks`` blocks. Prints one JSON object: per policy the
median and p99 microseconds per decision, and each policy's cost relative to
``round_robin`` (the floor: a decision that looks at nothing).

Run: ``python bench/policies.py [--workers 16] [--blocks 128] [--decisions 5000]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

# The checkout first: bench/index.py would otherwise shadow the ``index`` package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from index import BlockHasher, PrefixIndex
from policies import POLICY_NAMES, RouteRequest, WorkerView, make_policy
from policies.base import NO_MATCH


def build(workers: int, blocks: int, prompts: int, seed: int) -> tuple[PrefixIndex, list]:
    """An index where workers hold prefixes of shared-system-prompt conversations."""
    rng = random.Random(seed)
    hasher = BlockHasher(16)
    system = [rng.randrange(50_000) for _ in range(16 * 8)]
    index = PrefixIndex()
    requests = []
    for i in range(prompts):
        tokens = system + [rng.randrange(50_000) for _ in range(16 * (blocks - 8))]
        hashes = hasher.hash_tokens(tokens)
        for w in rng.sample(range(workers), rng.randrange(1, 3)):
            index.store(f"w{w}", hashes[: rng.randrange(8, blocks + 1)])
        requests.append(
            RouteRequest(f"r{i}", "m", len(tokens), hashes, 16, session_key=f"s{i % 97}")
        )
    return index, requests


def views(index: PrefixIndex, req: RouteRequest, workers: int, rng: random.Random) -> list:
    match = index.match_tiers(req.block_hashes)
    return [
        WorkerView(
            f"w{w}",
            match.get(f"w{w}", NO_MATCH),
            inflight_requests=rng.randrange(8),
            inflight_prefill_tokens=rng.randrange(20_000),
            engine_running=rng.randrange(16),
            engine_waiting=rng.randrange(4),
            kv_usage=rng.random(),
        )
        for w in range(workers)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=128, help="prompt length in 16-token blocks")
    ap.add_argument("--decisions", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    index, requests = build(args.workers, args.blocks, 200, args.seed)
    rng = random.Random(args.seed)
    cases = [(r, views(index, r, args.workers, rng)) for r in requests]
    out: dict[str, dict[str, float]] = {}
    for name in POLICY_NAMES:
        policy = make_policy(name, rng=random.Random(args.seed))
        times = []
        for i in range(args.decisions):
            req, vs = cases[i % len(cases)]
            t = time.perf_counter_ns()
            decision = policy.select(req, vs)
            policy.on_finish(req, decision.worker_id)
            times.append(time.perf_counter_ns() - t)
        times.sort()
        out[name] = {
            "p50_us": statistics.median(times) / 1000,
            "p99_us": times[int(0.99 * len(times))] / 1000,
        }
    floor = out["round_robin"]["p50_us"]
    for stats in out.values():
        stats["p50_over_round_robin"] = stats["p50_us"] / floor
    print(
        json.dumps(
            {
                "workers": args.workers,
                "prompt_blocks": args.blocks,
                "decisions": args.decisions,
                "policies": out,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
