"""The router in front of the real stack: mock engines (ZMQ KV events) -> node agents -> NATS.

Nothing here is a double: the engines run the shared cache model and publish like vLLM,
the agents republish on NATS, the router consumes it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import nats
import openai
import pytest
from stack import BS, MODEL, MockStack, Replica, until

from index.codec import BlockRemoved, decode

AUTH = {"authorization": "Bearer t"}
SYSTEM = "You are the assistant of a cache-aware router test; answer in a few words. " * 3


def idle_since(replica: Replica, t: float) -> bool:
    """Every engine reported an empty queue after monotonic time ``t``: with 60-token
    prompts a stale report of the last turn still running outweighs the whole hit."""
    return all(
        w.load.engine_seen > t and not w.load.engine.running and not w.load.engine.waiting
        for w in replica.state.registry
    )


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[tuple[MockStack, Replica]]:
    mocks = await MockStack(nats_url).start(3, load_interval=0.1)
    replica = await Replica(mocks.router_config("r0", health_interval=0.2)).start()
    yield mocks, replica
    await replica.stop()
    await mocks.stop()


async def test_conversation_stays_on_its_engine_and_hits_grow(
    stack: tuple[MockStack, Replica],
) -> None:
    mocks, replica = stack
    client = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    workers, cached = [], []
    try:
        for turn in range(4):
            messages.append({"role": "user", "content": f"turn {turn}: what changed since?"})
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=messages,
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
                user="session-42",
            )
            workers.append(raw.headers["x-cache-router-worker"])
            stream = raw.parse()
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage is not None:
                    usage = chunk.usage
            assert text and usage is not None
            cached.append(usage.prompt_tokens_details.cached_tokens if turn else 0)
            messages.append({"role": "assistant", "content": text})
            done = time.monotonic()
            await until(lambda: mocks.delivered(replica), what="events through the agents")
            await until(lambda t=done: idle_since(replica, t), what="idle load reports")
    finally:
        await client.close()
    assert len(set(workers)) == 1, workers
    assert all(b > a for a, b in itertools.pairwise(cached)), cached


async def test_router_predicts_exactly_what_the_engines_report(
    stack: tuple[MockStack, Replica], nats_url: str
) -> None:
    """With evictions going on (32-block engines), the index's match for the chosen worker
    equals the cached tokens the engine then reports: stores and removals both arrive."""
    mocks, replica = stack
    removed = []

    async def on_batch(msg: Any) -> None:
        removed.extend(e for e in decode(msg.data).events if isinstance(e, BlockRemoved))

    nc = await nats.connect(nats_url)
    await nc.subscribe("kv.events.>", cb=on_batch)
    async with httpx.AsyncClient(base_url=replica.url, timeout=30) as http:
        # 5 topics sharing a system prompt, each prompt with its own tail: about 4x what
        # the three 32-block engines can hold, so they evict while the test runs
        prompts = [f"{SYSTEM} topic {i % 5}: " + f"note {i} " * (30 + 2 * i) for i in range(18)]
        checked = 0
        for i, prompt in enumerate(prompts):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
            await until(lambda: mocks.delivered(replica), what="events through the agents")
            r = await http.post("/admin/explain", json=body, headers=AUTH)
            matches = {w["worker_id"]: w["match"]["total"] for w in r.json()["workers"]}
            n = r.json()["num_tokens"]
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            worker = r.headers["x-cache-router-worker"]
            got = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            predicted = min(matches[worker], (n - 1) // BS) * BS
            assert got == predicted, (i, worker, got, predicted)
            checked += predicted > 0
    await nc.close()
    assert checked >= 5 and removed  # hits were predicted, and evictions did happen
    pool = replica.pool()
    for e in mocks.engines:
        assert pool.index.stats().workers[e.cfg.worker_id]["gpu"] == len(e.cache.gpu_hashes())
