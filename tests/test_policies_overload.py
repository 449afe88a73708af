"""``cache_aware`` under load and at rest (issues 31 and 35): a prefix every client
shares is no affinity, and the recompute charge fades as the holder's queue outgrows
what a hit saves; the collapse on short-think-time chat as a seeded simulation."""

from __future__ import annotations

import random
from collections import Counter

from index.prefix_index import TierMatch
from policies import RouteRequest, WorkerView, make_policy

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
