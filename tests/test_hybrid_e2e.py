"""A hybrid model end to end: mock engine (full + sliding window + Mamba groups) -> agent
-> NATS -> router. The router learns the groups from the events and never promises a
hit the engine does not deliver, where matching full attention alone would."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from stack import BS, MODEL, MockStack, Replica, mock_engine_config, until

from index.groups import GroupSpec

AUTH = {"authorization": "Bearer t"}
SYSTEM = (
    "A hybrid model keeps a sliding-window group and a Mamba group beside full attention. " * 12
)


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[tuple[MockStack, Replica]]:
    mocks = MockStack(nats_url)
    await mocks.add(
        mock_engine_config(
            "h0",
            gpu_blocks=512,
            kv_groups="full,sliding_window:40,mamba",  # a hit needs 3 window blocks before it
            group_blocks=20,  # the extra groups turn over much faster than full attention
            max_num_batched_tokens=48,  # prompts run in chunks: Mamba states at chunk ends
        )
    )
    replica = await Replica(mocks.router_config("r0", health_interval=0.2)).start()
    yield mocks, replica
    await replica.stop()
    await mocks.stop()


async def test_no_promised_hit_the_engine_does_not_deliver(
    stack: tuple[MockStack, Replica],
) -> None:
    mocks, replica = stack
    ingest, index = replica.pool().ingest, replica.pool().index
    over = 0  # requests where full attention alone would have promised more
    hits = 0
    async with httpx.AsyncClient(base_url=replica.url, timeout=30) as http:
        for i in range(28):
            # four topics share the system prompt; each topic's requests extend its last
            topic = i % 4
            prompt = SYSTEM + f"topic {topic}. " + f"detail {topic} " * (10 + 20 * (i // 4))
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            explain = (await http.post("/admin/explain", headers=AUTH, json=body)).json()
            [row] = explain["workers"]
            raw, seen = row["match"]["total"], row["view"]["match"]["total"]
            resp = await http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            predicted = int(resp.headers["x-cache-router-hit-tokens"])
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert predicted == cached, (i, predicted, cached, raw * BS, seen * BS)
            cap = (resp.json()["usage"]["prompt_tokens"] - 1) // BS
            over += min(raw, cap) > seen
            hits += cached > 0
            await until(lambda: mocks.delivered(replica), what="the engine's events applied")
    assert ingest.group_specs() == [
        GroupSpec("full"),
        GroupSpec("sliding_window", 40),
        GroupSpec("mamba"),
    ]
    assert {"h0", "h0:g1", "h0:g2"} <= set(index.workers)
    assert hits >= 10  # the rules still let real hits through
    assert over >= 5  # and the groups cut promises full attention alone would have made
