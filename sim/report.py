"""Per-policy numbers from a finished simulation (one flat JSON-ready dict)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import orjson

if TYPE_CHECKING:
    from policies import EngineCosts
    from policies.base import Policy
    from sim.batch_engine import BatchEngine
    from sim.request import SimRequest

PolicyReport = dict[str, Any]


class Simulation(Protocol):
    """What a report reads of a finished run (``sim.simulator.Simulation`` has it)."""

    @property
    def costs(self) -> EngineCosts: ...
    @property
    def block_size(self) -> int: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def engines(self) -> Sequence[BatchEngine]: ...
    @property
    def requests(self) -> Sequence[SimRequest]: ...
    @property
    def routed(self) -> Sequence[int]: ...
    @property
    def route_us(self) -> Sequence[float]: ...
    @property
    def num_rejected(self) -> int: ...
    @property
    def counters(self) -> Counter[str]: ...


def _ratio(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def cache_loss(sim: Simulation) -> float:
    """DESIGN.md: 1 - (prefill throughput on missed tokens, cache on) / (cache off).

    Cache off, each request's missed tokens are charged their share of its cold prefill
    (``missed / prompt`` of it), so the mix of short and long prompts cannot pass for a
    loss or a gain. Cache on, they cost what the engine paid: they attend to the cached
    context (later positions cost more) and host hits must be loaded first.
    """
    costs, bs = sim.costs, sim.block_size
    t_on = t_off = 0.0
    for r in sim.requests:
        if r.first_token_ms < 0:
            continue
        hit = (r.hit_gpu_blocks + r.hit_host_blocks) * bs
        left = r.input_len - hit
        t_on += costs.prefill_ms(left, hit) + costs.load_ms("cpu", r.hit_host_blocks * bs)
        t_off += costs.prefill_ms(r.input_len) * left / r.input_len
    return 1.0 - t_off / t_on if t_on else 0.0


def summarize(sim: Simulation, wall_s: float) -> PolicyReport:
    bs = sim.block_size
    served = [r for r in sim.requests if r.first_token_ms >= 0]
    tokens_in = sum(r.input_len for r in served) or 1
    gpu = sum(r.hit_gpu_blocks for r in served) * bs
    host = sum(r.hit_host_blocks for r in served) * bs
    ttft = np.array([r.first_token_ms - r.arrival_ms for r in served] or [0.0])
    queue = np.array([r.admit_ms - r.arrival_ms for r in served] or [0.0])
    start = min(r.arrival_ms for r in sim.requests)
    span_s = max(max(r.finish_ms for r in sim.requests) - start, 1e-9) / 1000.0
    p50, p90, p99 = np.percentile(ttft, [50, 90, 99])
    route = np.array(sim.route_us or [0.0])
    hinted = [r for r in served if r.hint_deadline_ms >= 0]
    # routed away from the longest match (the request recomputes what a peer holds)
    off_best = sum(
        r.est_prefill > max(r.input_len - r.best_hit_blocks * bs, 1) for r in sim.requests
    )
    counters = sim.counters
    # promised more than the engine delivered: the index's view was false for this request
    # (lag, a rank it could not tell apart, a KV-cache group it did not know)
    over = [r for r in served if r.promised_blocks > r.hit_gpu_blocks + r.hit_host_blocks]
    return {
        "policy": sim.policy.name,
        "requests": len(sim.requests),
        "rejected": sim.num_rejected,
        "hit_rate": (gpu + host) / tokens_in,
        "hit_rate_gpu": gpu / tokens_in,
        "hit_rate_host": host / tokens_in,
        # Had every request gone to its best-matching worker (as the index saw it):
        # ideal - this = lost to eviction and event lag; this - hit_rate = lost by routing.
        "hit_rate_best_worker": sum(r.best_hit_blocks for r in served) * bs / tokens_in,
        "promised_hit_rate": sum(r.promised_blocks for r in served) * bs / tokens_in,
        "overpromised_share": len(over) / len(served) if served else 0.0,
        "overpromised_tokens": sum(
            r.promised_blocks - r.hit_gpu_blocks - r.hit_host_blocks for r in over
        )
        * bs,
        "ttft_mean_ms": float(ttft.mean()),
        "ttft_p50_ms": float(p50),
        "ttft_p90_ms": float(p90),
        "ttft_p99_ms": float(p99),
        "queue_mean_ms": float(queue.mean()),
        "queue_p90_ms": float(np.percentile(queue, 90)),
        "throughput_rps": len(served) / span_s,
        "input_tok_s": tokens_in / span_s,
        "output_tok_s": sum(r.output_len for r in served) / span_s,
        "prefill_load_max_over_mean": _ratio([e.prefill_tokens for e in sim.engines]),
        "requests_max_over_mean": _ratio(sim.routed),
        "busy_max": max(e.busy_ms for e in sim.engines) / 1000.0 / span_s,
        "busy_mean": sum(e.busy_ms for e in sim.engines) / len(sim.engines) / 1000.0 / span_s,
        "prefetch_hints": counters["prefetch_hints"],
        "prefetch_blocks": counters["prefetch_blocks"],
        "prefetch_tokens": counters["prefetch_blocks"] * bs,
        "prefetch_late": counters["prefetch_late"],
        "prefetch_blocks_sent": counters["prefetch_blocks_sent"],
        "hinted_share": len(hinted) / len(sim.requests) if sim.requests else 0.0,
        "hinted_admit_wait_ms": float(np.mean([r.admit_ms - r.arrival_ms for r in hinted]))
        if hinted
        else 0.0,
        "hinted_admit_estimate_ms": float(np.mean([r.hint_deadline_ms for r in hinted]))
        if hinted
        else 0.0,
        "off_best_worker_share": off_best / len(sim.requests) if sim.requests else 0.0,
        "prefill_tokens_computed": sum(e.prefill_tokens for e in sim.engines),
        "cache_loss": cache_loss(sim),
        "route_us_mean": float(route.mean()),
        "route_us_p99": float(np.percentile(route, 99)),
        "event_batches": counters["event_batches"],
        "ingest_errors": sum(v for k, v in counters.items() if k.startswith("ingest_")),
        "sim_duration_s": span_s,
        "wall_s": wall_s,
    }


def write_json(result: dict[str, Any], dest: str) -> None:
    """``--json -`` prints the result, ``--json PATH`` writes it: one rule for every sim command."""
    payload = orjson.dumps(result, option=orjson.OPT_INDENT_2)
    if dest == "-":
        sys.stdout.write(payload.decode() + "\n")
    else:
        Path(dest).write_bytes(payload + b"\n")
