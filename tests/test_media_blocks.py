"""Multimodal keys when an engine block is k > 1 router blocks: the request side keys an
item per router block (``router.tokens.media.block_keys``), the engine's ``BlockStored`` per
engine block (vLLM's ``cache_full_blocks``); the event side renumbers them
(``index.media.router_block_keys``) so both hash alike, for every k. End to end with the
mock engine at block 16k behind a router at 16, and as a property against a plain
reference of vLLM's keying."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stack import BS, MockStack, Replica, mock_engine_config
from test_multimodal import _send, chat, image

from index.backend import make_ingest
from index.hashing import BlockHasher, request_block_hashes
from index.prefix_index import PrefixIndex
from router.tokens.media import as_ints, block_keys, expand, media_identifier
from router.tokens.tokenize import FallbackTokenizer
from sim.mock.engine import placeholder_run


def reference_keys(
    items: list[tuple[str, int, int]], block_size: int, num_blocks: int
) -> list[list[Any] | None]:
    """vLLM's multimodal keys of each block: ``(identifier, item start - block start)`` for
    every item the block's tokens overlap (``_gen_mm_extra_hash_keys``), written plainly."""
    out: list[list[Any] | None] = []
    for b in range(num_blocks):
        lo, hi = b * block_size, (b + 1) * block_size
        keys = [(i, start - lo) for i, start, n in items if start < hi and start + n > lo]
        out.append(keys or None)
    return out


def _ingests() -> list[Any]:
    out = [pytest.param(lambda: make_ingest(PrefixIndex(), BlockHasher(BS)), id="python")]
    try:
        from index.native_index import NativePrefixIndex
        from index.native_ingest import NativeEventIngest
    except ImportError:
        return out
    native = pytest.param(
        lambda: NativeEventIngest(NativePrefixIndex(), BlockHasher(BS)), id="native"
    )
    return [*out, native]


def _stored(hashes: list[int], parent: int | None, tokens: list[int], size: int, keys: Any) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": keys if any(keys) else None,
    }


@st.composite
def prompts(draw: st.DrawFn) -> tuple[int, list[int], list[tuple[str, int, int]], int]:
    """(k, tokens, items, engine blocks in the first event): text tokens with items in
    them, back to back at times (the same pad token: runs end where the next item starts)."""
    k = draw(st.sampled_from([1, 2, 3, 4]))
    tokens: list[int] = []
    items: list[tuple[str, int, int]] = []
    for n in range(draw(st.integers(1, 4))):
        tokens += draw(st.lists(st.integers(1, 50), max_size=40))
        length = draw(st.integers(1, 70))
        items.append((f"mm-{n}", len(tokens), length))
        tokens += [draw(st.sampled_from([7_000_001, 7_000_002]))] * length
    tokens += draw(st.lists(st.integers(1, 50), min_size=1, max_size=40))
    engine = BS * k
    tokens += [51] * (-len(tokens) % engine)  # whole engine blocks, as an event carries
    first = draw(st.integers(1, len(tokens) // engine))
    return k, tokens, items, first


@pytest.mark.parametrize("make", _ingests())
@settings(max_examples=150, deadline=None)
@given(prompt=prompts())
def test_events_key_items_as_requests_do_for_every_k(
    make: Any, prompt: tuple[int, list[int], list[tuple[str, int, int]], int]
) -> None:
    k, tokens, items, first = prompt
    engine = BS * k
    blocks = len(tokens) // engine
    keys = reference_keys(items, engine, blocks)
    # vLLM's keys travel msgpack'd: tuples arrive as lists
    keys = msgpack.unpackb(msgpack.packb(keys), use_list=True)
    hashes = list(range(1, blocks + 1))
    cut = first * engine
    events = [_stored(hashes[:first], None, tokens[:cut], engine, keys[:first])]
    if first < blocks:  # an item may run on into the next event
        events.append(_stored(hashes[first:], first, tokens[cut:], engine, keys[first:]))
    ingest = make()
    result = ingest.apply("w", 0, msgpack.packb([0.0, events, None], use_bin_type=True))
    assert result.applied == len(events) and not result.errors
    want = request_block_hashes(
        BlockHasher(BS), tokens, media_keys=block_keys(items, BS) if items else None
    )
    got = ingest.engine_blocks("w")
    assert [got[h] for h in hashes] == want[k - 1 :: k]


def test_router_block_keys_split_an_item_across_router_blocks() -> None:
    from index.media import router_block_keys

    # block 32 = 2 router blocks of 16; an item at 20, 24 long (to 44); a salt on block 0
    tokens = [1] * 20 + [9] * 24 + [2] * 20
    got = router_block_keys([[("a", 20), "salt"], [("a", -12)]], tokens, 16, 2)
    assert got == [["salt"], [("a", 4)], [("a", -12)], None]
    with pytest.raises(ValueError, match="positive"):
        router_block_keys([], [], 16, 0)


@pytest.fixture(params=[2, 4], ids=["k2", "k4"])
async def coarse(request: Any, nats_url: str) -> AsyncIterator[tuple[MockStack, Replica]]:
    mocks = MockStack(nats_url)
    await mocks.add(mock_engine_config("v0", gpu_blocks=256, block_size=BS * request.param))
    replica = await Replica(mocks.router_config("r0")).start()  # router blocks of BS
    yield mocks, replica
    await replica.stop()
    await mocks.stop()


async def test_a_coarse_engine_hits_through_its_image(
    coarse: tuple[MockStack, Replica],
) -> None:
    mocks, replica = coarse
    engine = mocks.engines[0].cfg.block_size
    tok = FallbackTokenizer()
    then = {"type": "text", "text": "Answer in one line, then list the colours. " * 8}
    # a lead-in that puts the image mid router block, its run across an engine block's end
    for words in range(1, 64):
        ask = {"type": "text", "text": "Read this label. " + "word " * words}
        seen = expand(tok, chat([ask, image(7), then]), placeholder_run, as_ints)
        [(_ident, start, length)] = seen.items
        if start % BS and start // engine != (start + length - 1) // engine:
            break
    else:
        pytest.fail("no lead-in puts the image across an engine block's end")
    async with httpx.AsyncClient(base_url=replica.url, timeout=30) as http:
        turn1 = [ask, image(7), then]
        predicted, cached, reply = await _send(coarse, http, chat(turn1))
        assert predicted == cached == 0
        ident = media_identifier(image(7))
        assert replica.pool().ingest.media.placeholder(ident) == placeholder_run(ident)
        # the same image a turn later: the engine's hit runs through the image, and so does
        # the router's prediction
        predicted, cached, _ = await _send(coarse, http, chat(turn1, reply, "In French."))
        assert cached >= start + length
        assert predicted == cached
