"""Where a PD rule's prefill-side hit rate goes, per rule on a trace. JSON out, one line each.

The PD simulator (``sim/pd.py``, as ``cache-router replay --prefill-workers``) with each
prefill choice recorded against the router's index at that moment:

- ``index_best``: the hit rate had every prefill gone to the prefill engine with the
  longest match (what the placement so far makes reachable);
- ``index_chosen``: the match on the engine the rule picked (``index_best -
  index_chosen`` is what the choice gave up, ``left_holder_*`` the requests that did);
- ``hit_rate``: what the engines delivered (above ``index_chosen``: blocks stored or
  prefetched between the choice and the admission);
- ``distinct_share``: distinct blocks / blocks held over the prefill engines, sampled
  every 200 prefills (below 1: the same prefix computed on several engines);
- ``left_holder_lost_*``: the requests that left a holder and got less than its match
  (``left_holder_*`` counts by the index at the choice, so it includes requests whose
  chosen engine computed the prefix before admitting them: a session's previous turn
  queued there, a shared prefix computed by a request ahead; Mooncake synthetic seed 0,
  ``cache_router``: 17 left, 3 lost, 0.04 of 0.55 points);
- ``chosen_lost_hit_rate``: the chosen engine's match evicted before the engine admitted
  the request (the prefill queue's own compute pushes the LRU tail out);
- ``reuse_bands``: the hit rate split by how long ago the prompt's longest shared prefix
  was last requested (any earlier request, any engine): per band the requests, the
  ``reachable`` hit (that shared prefix) and the delivered ``hit`` (the bands' hits sum
  to ``hit_rate``). An engine's LRU holds 16,384 pages (1.05M tokens): on Mooncake
  synthetic, between two uses of a prefix 60-100 s apart its engine computed a median
  0.76M tokens, 100-200 s apart 1.33M, so the bands straddle the survival time, where
  which rule keeps which old prefix is decided (BENCHMARKS.md, session 11);
- ``prefill_tokens_per_engine``, ``intake_cv``, ``intake_cv_150s``: each prefill engine's
  intake (prompt tokens it computed: new KV its LRU takes in, so evicts), their
  coefficient of variation over the run, and the mean of that coefficient over sliding
  150 s windows (read at each prefill choice from 150 s after the first): an engine that
  takes in more evicts sooner, and a prefix reused minutes later survives where the
  intake was low (issue 13's mixed pool, BENCHMARKS.md session 13; the PD prefill side,
  session 14).

    flock /work/bench.lock nice -n 5 python3 bench/pd_hits.py --trace T --limit 2000 \\
        --rules cache_router,sglang_pd [--params '{"recompute_weight": 8}'] \\
        [--decode-params '{"transfer_weight": 0}'] [--seed 1] [--predict-ttl-ms 3000]

``--params`` go to the prefill policy of every rule whose prefill side is
``cache_aware``, ``--decode-params`` to a ``decode_load`` decode side.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

from index.hashing import cacheable_blocks
from policies.base import WorkerView
from policies.pd import DecodeLoad, PdDecision
from sim.pd import PdSimulation, parse_rule
from sim.request import SimRequest
from sim.simulator import SimConfig
from sim.traces import Trace, load_trace

_SAMPLE_EVERY = 200
# Upper edges (s) of the reuse bands; a prompt sharing no block with any earlier one is
# "first", one last shared at or past the last edge is ">=200s".
_BAND_EDGES_S = (30, 60, 100, 200)
_INTAKE_WINDOW_S = 150


class Recorded(PdSimulation):
    """The PD simulator, recording each prefill choice against the index."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.choices: dict[int, tuple[int, int, str]] = {}  # best, chosen, engine
        self.distinct: list[float] = []
        # (time ms, prompt tokens each prefill engine computed so far) at each choice
        self.intake: list[tuple[float, list[int]]] = []

    def _send_prefill(self, req: SimRequest, pd: PdDecision, views: list[WorkerView]) -> None:
        assert pd.prefill is not None
        cap = cacheable_blocks(req.input_len, self.block_size)
        best = max(min(v.match.total, cap) for v in views)
        chosen = next(min(v.match.total, cap) for v in views if v.worker_id == pd.prefill.worker_id)
        self.choices[req.idx] = (best, chosen, pd.prefill.worker_id)
        self.intake.append((self.now, [self.engines[i].prefill_tokens for i in self.prefill_slots]))
        if len(self.choices) % _SAMPLE_EVERY == 0:
            held = [self.engines[i].cache.gpu_hashes() for i in self.prefill_slots]
            total = sum(len(h) for h in held)
            self.distinct.append(round(len(set().union(*held)) / max(total, 1), 3))
        super()._send_prefill(req, pd, views)


def cv(values: Sequence[float]) -> float:
    """Coefficient of variation (population standard deviation over the mean; 0 when
    the mean is 0)."""
    mean = sum(values) / len(values)
    if mean == 0:
        return 0.0
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean


def windowed_cv(samples: Sequence[tuple[float, Sequence[int]]], window_ms: float) -> float | None:
    """``samples``: (time ms, running totals per engine), in time order. The mean, over the
    samples at least ``window_ms`` after the first, of ``cv`` of what each engine added in
    the ``window_ms`` ending there (windows where none added anything are skipped); None
    when no sample qualifies."""
    out = []
    j = 0
    for t, totals in samples:
        if t - samples[0][0] < window_ms:
            continue
        while samples[j][0] < t - window_ms:
            j += 1
        added = [a - b for a, b in zip(totals, samples[j][1], strict=True)]
        if sum(added) > 0:
            out.append(cv(added))
    return sum(out) / len(out) if out else None


def last_shared(trace: Trace) -> list[tuple[int, float]]:
    """Per request ``(blocks, gap ms)``: its longest leading run of blocks that an
    earlier request also had (at most its cacheable blocks), and the time since the
    latest earlier request that had all of them; ``(0, inf)`` when none shares a block.

    Block hashes chain their parents, so the latest request holding the deepest shared
    block holds the whole run."""
    bs = trace.block_size
    latest: dict[int, int] = {}  # block hash -> latest request holding it
    out: list[tuple[int, float]] = []
    for i, req in enumerate(trace.requests):
        hashes = req.router_hashes.tolist()
        cap = cacheable_blocks(req.input_len, bs)
        depth, by = 0, -1
        for h in hashes[:cap]:
            j = latest.get(h)
            if j is None:
                break
            depth, by = depth + 1, j
        gap = req.arrival_ms - trace.requests[by].arrival_ms if depth else float("inf")
        out.append((depth, gap))
        for h in hashes:
            latest[h] = i
    return out


def band(gap_ms: float) -> str:
    """The reuse band of a gap (``_BAND_EDGES_S``)."""
    if gap_ms == float("inf"):
        return "first"
    lo = 0
    for hi in _BAND_EDGES_S:
        if gap_ms < hi * 1000.0:
            return f"<{hi}s" if lo == 0 else f"{lo}-{hi}s"
        lo = hi
    return f">={lo}s"


def reuse_bands(
    trace: Trace, delivered: dict[int, int], tokens: int
) -> dict[str, dict[str, float]]:
    """The delivered hit rate (``delivered``: request index -> blocks served from cache,
    the requests served) split by ``band`` of ``last_shared``'s gap."""
    bs = trace.block_size
    names = [band(0.0)] + [band(e * 1000.0) for e in _BAND_EDGES_S] + ["first"]
    out = {n: {"requests": 0, "reachable": 0.0, "hit": 0.0} for n in names}
    for i, (blocks, gap) in enumerate(last_shared(trace)):
        if i not in delivered:
            continue
        row = out[band(gap)]
        row["requests"] += 1
        row["reachable"] += blocks * bs / tokens
        row["hit"] += delivered[i] * bs / tokens
    return out


def delivered_blocks(sim: PdSimulation) -> dict[int, int]:
    """Blocks each served request found cached where its prompt was computed (its prefill
    leg, else the decode engine), as ``sim.pd.summarize_pd`` counts the hit rate."""
    out = {}
    for r in sim.requests:
        if r.first_token_ms < 0:
            continue
        on = sim.prefill_leg.get(r.idx, r)
        out[r.idx] = on.hit_gpu_blocks + on.hit_host_blocks
    return out


def run(trace: Any, rule: str, args: argparse.Namespace) -> dict[str, Any]:
    prefill, decode = parse_rule(rule)
    config = SimConfig(
        workers=args.workers,
        prefill_workers=args.prefill_workers,
        seed=args.seed,
        engine_seed=args.seed,
        predict_ttl_ms=args.predict_ttl_ms,
    )
    params = args.params if prefill == "cache_aware" else None
    started = time.perf_counter()
    sim = Recorded(trace, rule, config, policy_params=params)
    if decode == DecodeLoad.name and args.decode_params:
        sim.decode_policy = DecodeLoad(random.Random(config.seed + 1), **args.decode_params)
    report = sim.run()
    bs = sim.block_size
    tokens = sum(r.input_len for r in sim.requests) or 1
    left = [(b, c) for b, c, _ in sim.choices.values() if c < b]
    got = delivered_blocks(sim)
    lost = [b - got.get(i, 0) for i, (b, c, _) in sim.choices.items() if c < b]
    lost = [x for x in lost if x > 0]
    evicted = sum(max(0, c - got.get(i, 0)) for i, (_, c, _) in sim.choices.items())
    served = sum(r.input_len for r in sim.requests if r.idx in got) or 1
    intake = [sim.engines[i].prefill_tokens for i in sim.prefill_slots]
    return {
        "rule": rule,
        "params": params or {},
        "decode_params": args.decode_params if decode == DecodeLoad.name else {},
        "seed": args.seed,
        "hit_rate": report["hit_rate"],
        "index_best": sum(b for b, _, _ in sim.choices.values()) * bs / tokens,
        "index_chosen": sum(c for _, c, _ in sim.choices.values()) * bs / tokens,
        "left_holder_requests": len(left),
        "left_holder_hit_rate": sum(b - c for b, c in left) * bs / tokens,
        "left_holder_lost_requests": len(lost),
        "left_holder_lost_hit_rate": sum(lost) * bs / tokens,
        "chosen_lost_hit_rate": evicted * bs / tokens,
        "reuse_bands": reuse_bands(sim.trace, got, served),
        "distinct_share": sim.distinct,
        "prefills_per_engine": dict(sorted(Counter(e for *_, e in sim.choices.values()).items())),
        "prefill_tokens_computed": sum(intake),
        "prefill_tokens_per_engine": intake,
        "intake_cv": cv(intake),
        "intake_cv_150s": windowed_cv(sim.intake, _INTAKE_WINDOW_S * 1000.0),
        "prefetch_hints": report["prefetch_hints"],
        "ttft_p90_ms": report["ttft_p90_ms"],
        "tpot_p90_ms": report["tpot_p90_ms"],
        "prefill_queue_mean_ms": report["prefill_queue_mean_ms"],
        "wall_s": time.perf_counter() - started,
    }


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object of policy parameters (``bench/sweep.py`` too)."""
    value = orjson.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--rules", default="cache_router,sglang_pd")
    parser.add_argument("--workers", type=int, default=4, help="decode engines")
    parser.add_argument("--prefill-workers", type=int, default=4)
    parser.add_argument("--params", type=json_object, default={})
    parser.add_argument("--decode-params", type=json_object, default={})
    parser.add_argument("--seed", type=int, default=0, help="token synthesis and policy RNG")
    parser.add_argument("--predict-ttl-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    # the seed synthesizes the tokens and the engines' hashes too, as ``cache-router replay
    # --seed`` does (until session 7 only the policies got it: seeds differed in tie-breaks)
    trace = load_trace(
        args.trace, args.block_size, seed=args.seed, engine_seed=args.seed, limit=args.limit
    )
    for rule in args.rules.split(","):
        sys.stdout.write(orjson.dumps(run(trace, rule.strip(), args)).decode() + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
