"""Predicted hits against the engine's own count, through the real stack: mock engines
(vLLM's cache rules, ZMQ events) -> node agents -> nats-server -> the router.

Per request the router's prediction (``x-cache-router-hit-tokens``) must equal the
engine's ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from replica_stack import BS, MODEL, MockStack, Replica
from router_double import until


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[tuple[MockStack, Replica]]:
    mocks = await MockStack(nats_url).start(1)
    replica = await Replica(mocks.router_config("r0")).start()
    yield mocks, replica
    await replica.stop()
    await mocks.stop()


async def complete(http: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[int, int]:
    """(predicted, engine-reported) cached tokens of one request."""
    r = await http.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
    )
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(r.headers["x-cache-router-hit-tokens"]), cached


async def test_prompts_of_whole_blocks_never_count_their_last_block(
    stack: tuple[MockStack, Replica],
) -> None:
    mocks, replica = stack
    seen = []
    async with httpx.AsyncClient(timeout=10) as http:
        for n_tokens in (3 * BS, 3 * BS + 5, 4 * BS, 1):
            prompt = [1000 + n_tokens, *range(1, n_tokens)]
            for _ in range(2):
                seen.append((n_tokens, *await complete(http, replica.url, prompt)))
                await until(lambda: mocks.synced(replica), what="events applied")
    assert all(pred == cached for _, pred, cached in seen), seen
    # the repeat of an exact multiple hit all blocks but the one holding the last token
    assert (3 * BS, 2 * BS, 2 * BS) in seen and (3 * BS + 5, 3 * BS, 3 * BS) in seen
