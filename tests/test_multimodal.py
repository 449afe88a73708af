"""Multimodal prompts (router/tokens/media.py, index/media.py): the router never matches past an
item it cannot identify, and matches through one it can (the same image bytes again in a
later turn). End to end with the mock engine, which expands items and keys their blocks
as vLLM does."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from stack import BS, MODEL, MockStack, Replica, mock_engine_config, until

from index.hashing import BlockHasher, request_block_hashes
from index.media import MediaRegistry
from router.tokens.media import as_ints, block_keys, expand, media_identifier
from router.tokens.tokenize import FallbackTokenizer
from sim.mock.engine import MEDIA_PAD, placeholder_run

SYSTEM = "You describe pictures for a catalogue, precisely and in few words. " * 3


def image(seed: int) -> dict[str, Any]:
    data = base64.b64encode(bytes([seed]) * 300).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def chat(*turns: list[dict[str, Any]] | str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for i, content in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return {"model": MODEL, "messages": messages, "max_tokens": 4}


def test_identifiers_and_block_keys() -> None:
    part = image(1)
    assert media_identifier(part) == media_identifier(image(1)) != media_identifier(image(2))
    assert media_identifier({**part, "uuid": "sku-1"}) == "sku-1"  # vLLM's item uuid wins
    # an item from token 20, 40 long, in blocks of 16: blocks 1-3, offsets 4, -12, -28
    assert block_keys([("a", 20, 40)], BS) == {1: [("a", 4)], 2: [("a", -12)], 3: [("a", -28)]}


def test_registry_learns_runs_it_sees_whole() -> None:
    reg = MediaRegistry(max_items=2)
    tokens = [1] * 20 + [9] * 24 + [2] * 4  # an item at 20, 24 long
    keys: list[Any] = [None, [["a", 4]], [["a", -12]]]
    assert reg.learn(tokens, BS, keys) == 1
    assert reg.placeholder("a") == [9] * 24
    # a run reaching the event's end may go on: not learnt from it
    assert reg.learn([1] * 8 + [9] * 24, BS, [[["b", 8]], [["b", -8]]]) == 0
    assert reg.placeholder("b") is None
    # two items back to back with one pad token: each run ends where the next item starts
    assert (
        reg.learn(
            [1] * 4 + [9] * 11 + [2], 4, [None, [["e", 0]], [["e", -4], ["f", 2]], [["f", -2]]]
        )
        == 2
    )
    assert reg.placeholder("e") == [9] * 6 and reg.placeholder("f") == [9] * 5
    reg.learn([5] * 3 + [2], 4, [[["c", 0]]])
    reg.learn([6] * 3 + [2], 4, [[["d", 0]]])
    assert len(reg) == 2 and reg.placeholder("a") is None  # the oldest went


def test_unknown_items_cut_hashing_where_it_always_did() -> None:
    tok = FallbackTokenizer()
    body = chat(
        [
            {"type": "text", "text": "what is this? " * 4},
            image(1),
            {"type": "text", "text": "and this " * 9},
        ]
    )
    seen = expand(tok, body, lambda _ident: None, as_ints)
    assert seen.hashable == tok.hashable_tokens(body) and not seen.items
    known = expand(tok, body, placeholder_run, as_ints)
    assert known.hashable is None
    [(_ident, start, length)] = known.items
    assert known.tokens[start : start + length] == [MEDIA_PAD] * length
    # with the item known, blocks past it are keyed by it: another image, other hashes
    swapped = [body["messages"][1]["content"][0], image(2), body["messages"][1]["content"][2]]
    other_body = {**body, "messages": [body["messages"][0], {"role": "user", "content": swapped}]}
    other = expand(tok, other_body, placeholder_run, as_ints)
    h1 = request_block_hashes(BlockHasher(BS), known.tokens, media_keys=block_keys(known.items, BS))
    h2 = request_block_hashes(BlockHasher(BS), other.tokens, media_keys=block_keys(other.items, BS))
    first = start // BS
    assert h1[:first] == h2[:first] and h1[first] != h2[first]


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[tuple[MockStack, Replica]]:
    mocks = MockStack(nats_url)
    await mocks.add(mock_engine_config("v0", gpu_blocks=512))
    replica = await Replica(mocks.router_config("r0")).start()
    yield mocks, replica
    await replica.stop()
    await mocks.stop()


async def _send(
    stack: tuple[MockStack, Replica], http: httpx.AsyncClient, body: dict[str, Any]
) -> tuple[int, int, str]:
    mocks, replica = stack
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    await until(lambda: mocks.delivered(replica), what="the engine's events applied")
    predicted = int(resp.headers["x-cache-router-hit-tokens"])
    return (
        predicted,
        out["usage"]["prompt_tokens_details"]["cached_tokens"],
        out["choices"][0]["message"]["content"],
    )


async def test_a_multimodal_conversation_hits_through_its_image(
    stack: tuple[MockStack, Replica],
) -> None:
    registry = stack[1].pool().ingest.media
    ask = {"type": "text", "text": "What is on this label? Read every word of it. " * 2}
    # text after the image in the same turn: the engine caches blocks past the item, so its
    # placeholder run shows whole in the events (an image last is learnt a turn later)
    then = {"type": "text", "text": "Answer in one line, then list the colours. " * 2}
    before = (
        len(FallbackTokenizer().encode(f"<|system|>\n{SYSTEM}\n<|user|>\n" + ask["text"], False))
        // 4
    )
    async with httpx.AsyncClient(base_url=stack[1].url, timeout=30) as http:
        turn1 = [ask, image(7), then]
        predicted, cached, reply = await _send(stack, http, chat(turn1))
        assert predicted == cached == 0
        assert registry.placeholder(media_identifier(image(7))) == placeholder_run(
            media_identifier(image(7))
        )
        # the same image bytes again, a turn later: the hit runs through the image
        turn2 = chat(turn1, reply, "Now in French, please.")
        predicted, cached, _ = await _send(stack, http, turn2)
        assert predicted == cached
        assert cached > before + len(placeholder_run(media_identifier(image(7))))
        # another image where that one was: no hit past the text before it
        other = chat([ask, image(8), then], reply, "Now in French, please.")
        predicted, cached, _ = await _send(stack, http, other)
        assert predicted == cached <= before
        # the same image named by the client (vLLM's uuid): a new identifier, learnt as well
        named = chat([ask, {**image(7), "uuid": "label-7"}, then])
        predicted, cached, _ = await _send(stack, http, named)
        assert predicted == cached <= before
        predicted, cached, _ = await _send(
            stack, http, chat([ask, {**image(7), "uuid": "label-7"}, then], "ok", "more")
        )
        assert predicted == cached > before
