"""Request-side hashing produces exactly what the event side produces, for every extra
key the engines put in their block hashes (LoRA, cache salt, multimodal), with events
built field for field as vLLM 0.32 (``to_event_extra_keys``) and SGLang 0.5.23
(``mem_cache/events.py``) publish them; and never a hit claimed past a key the router
cannot reproduce.
"""

from __future__ import annotations

import msgpack
import orjson
import pytest

from index.backend import make_ingest
from index.hashing import BlockHasher, cacheable_blocks, request_block_hashes
from index.prefix_index import PrefixIndex
from policies.cost_model import uncached_tokens
from router.config import ModelSpec, RouterConfig, WorkerSpec
from router.http.app import RouterApp
from router.tokens.tokenize import FallbackTokenizer

BS = 4
TOKENS = list(range(100, 100 + 5 * BS))  # five full blocks


def vllm_stored(
    hashes: list[int], parent: int | None, tokens: list[int], extra: list | None, lora: str | None
) -> dict:
    """vLLM 0.32's BlockStored as msgspec writes it (a map with "type")."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": 7 if lora else None,
        "medium": "GPU",
        "lora_name": lora,
        "extra_keys": extra,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def sglang_page(h: int, parent: int | None, tokens: list[int], salt: str | None, lora: str | None):
    """SGLang 0.5.23: one BlockStored per page, the salt and adapter on every one."""
    return {
        "type": "BlockStored",
        "block_hashes": [h],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": len(tokens),
        "lora_id": None,
        "medium": "GPU",
        "cache_salt": salt,
        "lora_name": lora,
    }


def payload(*events: dict) -> bytes:
    return msgpack.packb([1.0, list(events), None], use_bin_type=True)


def vllm_extra(lora: str | None, salt: str | None, n: int) -> list | None:
    """``to_event_extra_keys``: [lora name?, (mm id, offset)..., salt (block 0)?]."""
    out = []
    for i in range(n):
        keys = ([lora] if lora else []) + ([salt] if salt and i == 0 else [])
        out.append(tuple(keys) or None)
    return out if any(out) else None


def ingest_hashes(*events: dict) -> list[int]:
    ingest = make_ingest(PrefixIndex(), BlockHasher(BS))
    result = ingest.apply("w", 0, payload(*events))
    assert result.applied == len(events) and not result.errors
    blocks = ingest.engine_blocks("w")
    return [blocks[h] for e in events for h in e["block_hashes"]]


@pytest.mark.parametrize("lora", [None, "my-adapter"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_vllm_events_and_requests_agree(lora: str | None, salt: str | None) -> None:
    hs = [1, 2, 3, 4, 5]
    first = vllm_stored(hs[:2], None, TOKENS[: 2 * BS], vllm_extra(lora, salt, 2), lora)
    rest = vllm_stored(hs[2:], 2, TOKENS[2 * BS :], vllm_extra(lora, None, 3), lora)
    want = request_block_hashes(BlockHasher(BS), TOKENS, lora_name=lora, cache_salt=salt)
    assert ingest_hashes(first, rest) == want
    plain = request_block_hashes(BlockHasher(BS), TOKENS)
    if lora or salt:  # an adapter or a salt never shares a block with the base prompt
        assert not set(want) & set(plain)


@pytest.mark.parametrize("lora", [None, "my-adapter"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_sglang_events_and_requests_agree(lora: str | None, salt: str | None) -> None:
    pages = [
        sglang_page(10 + i, None if i == 0 else 9 + i, TOKENS[i * BS : (i + 1) * BS], salt, lora)
        for i in range(5)
    ]
    want = request_block_hashes(BlockHasher(BS), TOKENS, lora_name=lora, cache_salt=salt)
    assert ingest_hashes(*pages) == want


def test_vllm_and_sglang_key_the_same_request_alike() -> None:
    vllm = vllm_stored([1, 2, 3, 4, 5], None, TOKENS, vllm_extra("ad", "s", 5), "ad")
    sgl = [
        sglang_page(10 + i, None if i == 0 else 9 + i, TOKENS[i * BS : (i + 1) * BS], "s", "ad")
        for i in range(5)
    ]
    assert ingest_hashes(vllm) == ingest_hashes(*sgl)


def test_multimodal_blocks_are_never_claimed() -> None:
    """vLLM keys the blocks an image covers by ``(mm identifier, offset)``: the router
    cannot compute the identifier, so those blocks (and all after) never match."""
    extra = [None, (("mm-hash", 2),), (("mm-hash", -2),), None, None]
    event = vllm_stored([1, 2, 3, 4, 5], None, TOKENS, extra, None)
    held = ingest_hashes(event)
    plain = request_block_hashes(BlockHasher(BS), TOKENS)
    assert held[0] == plain[0] and not set(held[1:]) & set(plain)
    cut = request_block_hashes(BlockHasher(BS), TOKENS, hashable_tokens=BS + 2)
    assert cut == plain[:1]


def test_an_adapter_named_only_by_lora_id_matches_no_request() -> None:
    event = vllm_stored([1, 2], None, TOKENS[: 2 * BS], None, None)
    event["lora_id"] = 3
    held = ingest_hashes(event)
    for lora in (None, "3", "lora_id:3"):
        assert not set(held) & set(
            request_block_hashes(BlockHasher(BS), TOKENS[: 2 * BS], lora_name=lora)
        )


def test_the_last_block_rule() -> None:
    assert [cacheable_blocks(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]
    # an exact multiple of the block size recomputes its whole last block
    assert uncached_tokens(8, 2, 4) == 4
    assert uncached_tokens(9, 2, 4) == 1
    assert uncached_tokens(9, 1, 4) == 5


async def test_router_requests_match_lora_and_salted_events() -> None:
    """Through the router's own request path: the adapter from the config, the salt from
    the body, the prompt as token ids, and the last-block rule on the match."""
    cfg = RouterConfig(
        block_size=BS,
        workers=[WorkerSpec("w", "http://127.0.0.1:9", model="base")],
        models={"my-adapter": ModelSpec(base="base")},
    )
    state = RouterApp(cfg).state
    router = state.router
    pool = state.registry.pools["default"]
    extra = vllm_extra("my-adapter", "s", 5)
    event = vllm_stored([1, 2, 3, 4, 5], None, TOKENS, extra, "my-adapter")
    pool.ingest.apply("w", 0, payload(event))

    async def hit(model: str, salt: str | None, tokens: list[int]) -> int:
        body = {"model": model, "prompt": tokens, **({"cache_salt": salt} if salt else {})}
        prep = await router.prepare(router.parse("completion", orjson.dumps(body), {}), 0)
        (view,) = router.views(prep)
        return view.match.total

    assert await hit("my-adapter", "s", [*TOKENS, 1]) == 5
    assert await hit("my-adapter", "s", TOKENS) == 4  # the block with the last token: never
    assert await hit("my-adapter", None, [*TOKENS, 1]) == 0
    assert await hit("base", "s", [*TOKENS, 1]) == 0


def test_a_chat_is_hashed_only_up_to_its_first_media_item() -> None:
    tok = FallbackTokenizer()
    text = "describe the picture below in words " * 3
    parts = [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "and then this " * 20},
    ]
    body = {"messages": [{"role": "user", "content": parts}]}
    before = len(tok.encode(f"<|user|>\n{text}", False)) // 4
    assert tok.hashable_tokens(body) == before - 1
    assert tok.hashable_tokens({"messages": [{"role": "user", "content": text}]}) is None
    ids, _ = tok.chat(body)
    hashes = request_block_hashes(BlockHasher(BS), ids, hashable_tokens=before - 1)
    assert len(hashes) == (before - 1) // BS < len(BlockHasher(BS).hash_tokens(ids))
