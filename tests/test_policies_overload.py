"""``cache_aware`` under load and at rest (issues 31 and 35): a prefix every client
shares is no affinity, and the recompute charge fades as the holder's queue outgrows
what a hit saves; the collapse on short-think-time chat as a seeded simulation."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from index.prefix_index import TierMatch
from policies import RouteRequest, WorkerView, make_policy
from sim.gen_trace import generate, write
from sim.simulator import SimConfig, Simulation
from sim.traces import load_trace

BS = 16


def _chain(tag: object, blocks: int, prefix: list[int] | None = None) -> list[int]:
    return list(prefix or []) + [hash(("blk", tag, i)) & (2**64 - 1) for i in range(blocks)]


def _route_at_rest(requests: list[RouteRequest], seed: int) -> list[str]:
    """The worker of each request, each finished before the next arrives (1 request/s
    on idle engines); a worker holds what it computed, as the index reports."""
    policy = make_policy("cache_aware", random.Random(seed))
    held: dict[str, set[int]] = {f"w{i}": set() for i in range(8)}
    picks = []
    for r in requests:
        ws = []
        for wid, blocks in held.items():
            depth = 0
            while depth < len(r.block_hashes) and r.block_hashes[depth] in blocks:
                depth += 1
            ws.append(WorkerView(wid, match=TierMatch(depth, depth, depth, depth)))
        d = policy.select(r, ws)
        picks.append(d.worker_id)
        held[d.worker_id].update(r.block_hashes)
        policy.on_first_token(r, d.worker_id, 10.0)
        policy.on_finish(r, d.worker_id)
    return picks


def test_a_prefix_every_request_shares_is_no_affinity() -> None:
    """Issue 35: every prompt starts with the same block (BOS, the chat template's
    header), so its holder always had a hit: 40 of 40 requests went to one engine."""
    header = _chain("header", 1)
    requests = [RouteRequest(f"r{i}", "m", 20 * BS, _chain(i, 19, header), BS) for i in range(40)]
    for seed in range(3):
        picks = Counter(_route_at_rest(requests, seed))
        assert len(picks) >= 6 and max(picks.values()) <= 20, picks


def test_a_session_still_returns_to_its_context() -> None:
    """What is not common stays affinity: each session's later turns go where its
    earlier ones computed its context, although every prompt shares the header."""
    header = _chain("header", 1)
    requests = []
    for turn in range(4):
        for s in range(12):
            hashes = _chain(("s", s), 8 * (turn + 1), header)
            requests.append(
                RouteRequest(f"s{s}.{turn}", "m", len(hashes) * BS, hashes, BS, f"s{s}")
            )
    where: dict[str | None, set[str]] = {}
    for r, worker in zip(requests, _route_at_rest(requests, 0), strict=True):
        where.setdefault(r.session_key, set()).add(worker)
    assert all(len(w) == 1 for w in where.values()), where
    assert len(set().union(*where.values())) >= 4  # and the sessions spread


def _two_workers(holder_queue_tokens: int) -> dict[str, dict[str, float]]:
    """A session's turn, a 64-block prompt whose 48 leading blocks ``w0`` holds behind a
    queue of ``holder_queue_tokens`` prompt tokens; ``w1`` holds nothing and idles. The
    session's 4 earlier turns make sessions long (the fade's condition)."""
    policy = make_policy("cache_aware", random.Random(0))
    for turn in range(4):
        earlier = RouteRequest(f"t{turn}", "m", 8 * BS, _chain(("t", turn), 8), BS, "s")
        chosen = policy.select(earlier, [WorkerView("w0"), WorkerView("w1")]).worker_id
        policy.on_finish(earlier, chosen)
    r = RouteRequest("r", "m", 64 * BS, _chain("ctx", 64), BS, "s")
    w0 = WorkerView("w0", match=TierMatch(48, 48, 48, 48), inflight_requests=1,
                    inflight_prefill_tokens=holder_queue_tokens)  # fmt: skip
    return policy.select(r, [w0, WorkerView("w1")]).scores


def test_the_recompute_charge_fades_as_the_holder_queues() -> None:
    """Issue 31: a hit is worth its saved prefill against the extra queueing delay. The
    charge for recomputing what ``w0`` holds is whole while ``w0`` queues no more than
    the pool's mean, smaller as its queue grows, and gone once its excess over the mean
    reaches the prefill the hit saves (48 blocks of 16 tokens, 38.4 ms). Only for a
    session's request where sessions are long: a request that comes alone keeps it."""
    full = _two_workers(0)["w1"]["recompute_ms"]
    assert full > 1000  # weight 8 x (1 + 4 x 0.75 share) x 38.4 ms
    part = _two_workers(400)  # w0 waits ~26 ms, the mean ~13: about a third of it gone
    assert 0 < part["w1"]["recompute_ms"] < full
    gone = _two_workers(4000)  # ~206 ms queued: excess ~100 ms over the mean
    assert gone["w1"]["recompute_ms"] == 0
    assert gone["w0"]["queue_ms"] - gone["w1"]["queue_ms"] > 38.4
    alone = RouteRequest("a", "m", 64 * BS, _chain("ctx", 64), BS)
    w0 = WorkerView("w0", match=TierMatch(48, 48, 48, 48), inflight_requests=1,
                    inflight_prefill_tokens=4000)  # fmt: skip
    scores = make_policy("cache_aware", random.Random(0)).select(alone, [w0, WorkerView("w1")])
    assert scores.scores["w1"]["recompute_ms"] == full


def test_no_collapse_on_chat_with_short_think_times(tmp_path: Path) -> None:
    """The collapse of issue 31 as a seeded simulation (~4 s): chat over 12 shared system
    prompts, turns 0.1-1 s apart, 4 engines past the trace's rate. Before the fading
    charge, sessions stayed on holders whose queues had grown 30x what their hits saved:
    TTFT p90 1,210 ms against ``dynamo_kv``'s 445 (hit 0.843 / 0.805); after, 545 ms
    and 0.848. The bound is the sweep's never-collapse one (1.5x), not its 1.1x target:
    one seed of a small pool is noisy."""
    trace_path = write(
        tmp_path / "chat.jsonl",
        generate("chat", sessions=120, system_prompts=12, think_s=(0.1, 1.0), seed=6),
    )
    trace = load_trace(trace_path, 64, seed=6, engine_seed=6, speedup=1.6)
    config = SimConfig(workers=4, seed=6, engine_seed=6)
    ours = Simulation(trace, "cache_aware", config).run()
    dynamo = Simulation(trace, "dynamo_kv", config).run()
    assert ours["ttft_p90_ms"] <= 1.5 * dynamo["ttft_p90_ms"], (ours, dynamo)
    assert ours["hit_rate"] >= dynamo["hit_rate"]
