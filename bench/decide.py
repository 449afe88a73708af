"""The request path's decide step in-process, per call, at 1, 4 and 16 workers.

A ``RouterState`` built from a config the way the tests build one (no NATS, forecast
off), one short chat prepared once (36 blocks), each worker holding a random prefix of
it, an engine load report each and a flight on every other one. Timed, in microseconds
a call, best of ``--repeat`` rounds of ``--calls``: ``for_model`` + ``decide`` +
``hit_blocks`` (what ``router.forward.proxy`` runs per request after hashing), and its parts:
``views``, the index's ``match_tiers`` (and its native core's call alone), the policy's
``select``, ``for_model``, ``hit_blocks``. ``--baseline DIR`` also runs the checkout in
DIR, alternating rounds with this one in subprocesses, so noise hits both alike.

    flock /work/.sim.lock nice -n 15 python bench/decide.py [--baseline /work/main]

Prints one JSON object. Never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
# bench/index.py would shadow the ``index`` package; the tree comes from PYTHONPATH
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE / "bench"]
WORKERS = (1, 4, 16)


def measure(calls: int, repeat: int) -> dict[str, dict[str, float]]:
    """Each timed part at each worker count, in this process's checkout."""
    out: dict[str, dict[str, float]] = {}
    for n in WORKERS:
        out[str(n)] = {
            name: round(min(timeit.repeat(f, number=calls, repeat=repeat)) / calls * 1e6, 2)
            for name, f in parts(n).items()
        }
    return out


def parts(n: int) -> dict[str, Callable[[], object]]:
    """The timed calls over a router of ``n`` workers set up as the docstring says."""
    from router.config import RouterConfig, WorkerSpec
    from router.http.app import RouterState
    from router.routing.decide import hit_blocks
    from router.workers.load import EngineLoad

    specs = [WorkerSpec(f"w{i}", f"http://127.0.0.1:{9000 + i}", model="m") for i in range(n)]
    st = RouterState(RouterConfig(workers=specs, forecast_tracked=0))
    router, reg = st.router, st.registry
    words = " ".join(f"word{i}" for i in range(300))
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": words}]})
    prep = asyncio.run(router.prepare(router.parse("chat", raw.encode(), {}), len(raw)))
    hashes = prep.request.block_hashes
    index = prep.pool.index
    rng = random.Random(1)
    for i, w in enumerate(reg):
        depth = rng.randrange(len(hashes) + 1)
        if depth:
            index.store(w.id, hashes[:depth])
        w.load.report(EngineLoad(running=i % 3, waiting=0, kv_usage=0.1))
        if i % 2:
            w.load.begin(100 + i)
    policy = router.experiment.policy_for(prep.arm)
    decision, views = router.decide(prep)

    def path() -> None:
        reg.for_model("m")
        d, v = router.decide(prep)
        hit_blocks(v, d)

    out: dict[str, Callable[[], object]] = {
        "decide_path": path,
        "views": lambda: router.views(prep),
        "match_tiers": lambda: index.match_tiers(hashes),
        "select": lambda: policy.select(prep.request, views),
        "for_model": lambda: reg.for_model("m"),
        "hit_blocks": lambda: hit_blocks(views, decision),
    }
    cores = getattr(index, "cores", None)
    if cores is not None and len(cores) == 1:
        core = cores[0]
        out["native_match_tiers"] = lambda: core.match_tiers(hashes, True, time.monotonic(), None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="alternations with --baseline")
    ap.add_argument("--baseline", metavar="DIR", help="also this checkout, alternating")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a round's child
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.calls, args.repeat)))
        return
    trees = {"ours": HERE}
    if args.baseline is not None:
        trees["baseline"] = Path(args.baseline).resolve()
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            cmd = [sys.executable, str(HERE / "bench" / "decide.py"), "--one",
                   "--calls", str(args.calls), "--repeat", str(args.repeat)]  # fmt: skip
            # the child imports the tree's packages first (cwd: -C; sys.path: PYTHONPATH)
            env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
            done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, check=True)
            rounds[name].append(json.loads(done.stdout))
    result: dict[str, Any] = {}
    for name, runs in rounds.items():
        result[name] = {
            n: {part: sorted(r[n][part] for r in runs) for part in runs[0][n]} for n in runs[0]
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
