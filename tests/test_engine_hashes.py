"""Engine block hashes as vLLM sends them by default (32-byte sha256) on every path a
router or agent carries them: events -> ingest, the agent's mirror -> dump -> replay ->
ingest, and the router's prefetch hint (JSON) -> the agent that checks it."""

from __future__ import annotations

import hashlib

import orjson
import pytest

from agent.core import AgentCore
from agent.prefetch import check_hint
from index.backend import make_ingest
from index.codec import BlockRemoved, BlockStored, EventBatch, decode, encode, hash_from_json
from index.hashing import BlockHasher
from index.prefix_index import PrefixIndex
from policies.base import PrefetchHint, RouteRequest
from policies.experiments import Arm
from router.config import RouterConfig, WorkerSpec
from router.forward.hints import hint_message
from router.http.app import RouterState
from router.workers.pools import Pool

BS = 4


def sha(i: int) -> bytes:
    # leading zero bytes on purpose: an int form would lose them
    return b"\x00\x00" + hashlib.sha256(i.to_bytes(8, "big")).digest()[2:]


def payload(*events: object) -> bytes:
    return encode(EventBatch(1.0, list(events), None), events_as_map=True)  # type: ignore[arg-type]


def test_dump_and_replay_of_sha256_hashes_rebuild_the_same_router_view() -> None:
    tokens = list(range(4 * BS))
    batches = [
        payload(BlockStored([sha(0), sha(1)], None, tokens[: 2 * BS], BS, medium="GPU")),
        payload(BlockStored([sha(2), sha(3)], sha(1), tokens[2 * BS :], BS, medium="GPU")),
        payload(BlockRemoved([sha(3)], "GPU")),
    ]
    core = AgentCore(1)  # a one-batch ring: a replay from 0 must be a dump
    hasher = BlockHasher(BS)
    live = make_ingest(PrefixIndex(), hasher)
    for seq, p in enumerate(batches):
        core.accept(seq, p)
        live.apply("w", seq, p)
    msgs = core.gap_fill(0)
    assert msgs[-1].kind == "end" and msgs[-1].dump
    dumped = make_ingest(PrefixIndex(), hasher)
    chunks = [decode(m.payload) for m in msgs if m.kind == "dump"]
    dumped.load_dump("w", msgs[-1].seq, chunks, epoch=msgs[-1].epoch)
    assert dumped.engine_blocks("w") == live.engine_blocks("w")
    assert set(live.engine_blocks("w")) == {sha(0), sha(1), sha(2)}
    match = dumped.index.match_tiers(hasher.hash_tokens(tokens))["w"]
    assert match.gpu == 3


def test_prefetch_hint_names_sha256_blocks_in_json_the_agent_accepts() -> None:
    pool = Pool.create("p", BS)
    tokens = list(range(3 * BS))
    pool.ingest.apply(
        "src", 0, payload(BlockStored([sha(i) for i in range(3)], None, tokens, BS, medium="CPU"))
    )
    request = RouteRequest("r", "m", len(tokens), pool.hasher.hash_tokens(tokens), BS)
    hint = PrefetchHint("src", "dst", 3, "cpu", 50.0)
    message = hint_message(hint, request, pool)
    assert message is not None
    data = orjson.dumps(message)  # raised TypeError on bytes before
    checked = check_hint(data)
    assert [hash_from_json(h) for h in checked["block_hashes"]] == [sha(i) for i in range(3)]
    assert checked["num_tokens"] == 3 * BS


NATS = {"nats_url": "nats://127.0.0.1:4222"}  # never dialled: the state is only built


@pytest.mark.parametrize(
    ("settings", "kept"),
    [
        (NATS, True),  # cache_aware sends hints by default
        ({}, False),  # no NATS: a hint has no way out
        ({**NATS, "policy_params": {"prefetch": False}}, False),
        ({**NATS, "policy": "round_robin"}, False),
        ({**NATS, "arms": [Arm("a", "round_robin"), Arm("b", "cache_aware")]}, True),
        ({**NATS, "arms": [Arm("a", "round_robin"), Arm("b", "least_load")]}, False),
        # a decode-side policy's hint is never sent (router/pd/exchange.py)
        ({**NATS, "arms": [Arm("a", "round_robin", decode_policy="cache_aware")]}, False),
    ],
)
def test_the_router_keeps_engine_names_only_where_a_hint_can_carry_them(
    settings: dict[str, object], kept: bool
) -> None:
    """vLLM's 32-byte block names cost the index 24 B a block and only prefetch hints
    read them: a router none of whose policies sends a hint, or that has no NATS to
    send one on, keeps none, and a hint lookup then names no bytes-named block."""
    spec = WorkerSpec("w", "http://127.0.0.1:9", model="m", block_size=BS)
    cfg = RouterConfig(workers=[spec], forecast_tracked=0, **settings)  # type: ignore[arg-type]
    pool = RouterState(cfg).registry.pools[spec.pool]
    assert pool.ingest.keep_names is kept
    tokens = list(range(3 * BS))
    pool.ingest.apply("w", 0, payload(BlockStored([sha(i) for i in range(3)], None, tokens, BS)))
    router = pool.hasher.hash_tokens(tokens)
    assert pool.index.match(router)["w"] == 3
    assert pool.ingest.engine_hashes("w", router) == ([sha(i) for i in range(3)] if kept else [])
