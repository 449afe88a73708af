"""The Responses API through the router with the official ``openai`` client: cache-aware
on its input, streamed or not, and response affinity (a ``previous_response_id`` goes
to the engine that stored it, across router replicas too; a clean error when that
engine is gone). Engines are mock vLLMs with stored responses, behind node agents on a
real nats-server, so the index learns from real KV events.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from stack import MODEL, MockStack, Replica, until

SYSTEM = "You are the helpful agent of a cache-aware router test; keep answers short. " * 6


_open: list[openai.AsyncOpenAI] = []


def client(url: str) -> openai.AsyncOpenAI:
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    _open.append(c)
    return c


@pytest.fixture(autouse=True)
async def close_clients():
    yield
    while _open:
        await _open.pop().close()


async def create(c: openai.AsyncOpenAI, **kw) -> tuple[str, str, int]:
    """(response id, worker that served it, cached input tokens) of one create call."""
    raw = await c.responses.with_raw_response.create(model=MODEL, max_output_tokens=6, **kw)
    resp = raw.parse()
    assert resp.status == "completed" and resp.output_text
    cached = resp.usage.input_tokens_details.cached_tokens
    return resp.id, raw.headers["x-cache-router-worker"], cached


async def create_streamed(c: openai.AsyncOpenAI, **kw) -> tuple[str, str, list[str]]:
    async with c.responses.with_streaming_response.create(
        model=MODEL, max_output_tokens=6, stream=True, **kw
    ) as raw:
        worker = raw.headers["x-cache-router-worker"]
        kinds, done = [], None
        async for event in await raw.parse():
            kinds.append(event.type)
            if event.type == "response.completed":
                done = event.response
    assert done is not None and done.output_text
    return done.id, worker, kinds


@pytest.fixture
async def stack(nats_url):
    s = await MockStack(nats_url).start(3)
    try:
        yield s
    finally:
        await s.stop()


async def test_conversations_stay_on_the_engine_that_stores_them(stack):
    replica = await Replica(stack.router_config("r0")).start()
    try:
        c = client(replica.url)
        chains: dict[str, list[str]] = {}
        for topic in range(6):  # several conversations, several engines
            rid, worker, _ = await create(c, instructions=SYSTEM, input=f"topic {topic} " * 30)
            chains[rid] = [worker]
            last = rid
            for turn in range(3):
                stream = turn == 1
                if stream:
                    last, w, kinds = await create_streamed(
                        c, input=f"turn {turn}", previous_response_id=last
                    )
                    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
                    assert "response.output_text.delta" in kinds
                else:
                    last, w, _ = await create(c, input=f"turn {turn}", previous_response_id=last)
                chains[rid].append(w)
        for workers in chains.values():
            assert len(set(workers)) == 1, workers  # every turn on the first turn's engine
        # and the engines really hold them: each stored its own conversations only
        by_engine = {e.cfg.worker_id: e for e in stack.engines}
        for rid, workers in chains.items():
            assert by_engine[workers[0]].responses.get(rid) is not None
            others = [e for w, e in by_engine.items() if w != workers[0]]
            assert all(e.responses.get(rid) is None for e in others)
        # retrieval goes to the right engine too
        rid = next(iter(chains))
        assert (await c.responses.retrieve(rid)).id == rid
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve("resp_never_made")
    finally:
        await replica.stop()


async def test_without_affinity_another_engine_does_not_know_the_response(stack):
    """What the router protects against: vLLM answers 404 for a response it did not make."""
    first, second = stack.engines[:2]
    direct = client(first.url)
    made = await direct.responses.create(model=MODEL, input="remember me", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        await client(second.url).responses.create(
            model=MODEL, input="and now?", previous_response_id=made.id
        )


async def test_responses_are_routed_cache_aware_on_their_input(stack):
    replica = await Replica(stack.router_config("r0")).start()
    try:
        c = client(replica.url)
        long_input = "the same long shared context for every request " * 15
        _, home, _ = await create(c, instructions=SYSTEM, input=long_input)
        await until(lambda: stack.synced(replica), what="the router applied the events")
        for _ in range(4):
            _, worker, cached = await create(c, instructions=SYSTEM, input=long_input)
            assert worker == home
            assert cached > 0  # the engine reused the prefix the router sent it for
    finally:
        await replica.stop()


async def test_a_clean_openai_error_when_the_storing_engine_is_gone(stack):
    replica = await Replica(stack.router_config("r0")).start()
    try:
        c = client(replica.url)
        rid, worker, _ = await create(c, input="a conversation to lose " * 10)
        # the engine stops but is still listed: 503, retry later
        engine = next(e for e in stack.engines if e.cfg.worker_id == worker)
        await engine.stop()
        with pytest.raises(openai.APIStatusError) as down:
            await c.responses.create(model=MODEL, input="more", previous_response_id=rid)
        assert down.value.status_code == 503
        assert down.value.body["code"] == "previous_response_unavailable"
        # the operator removes it: its responses are gone for good, 404
        async with httpx.AsyncClient(base_url=replica.url, timeout=5) as http:
            r = await http.delete(f"/admin/workers/{worker}", headers={"authorization": "Bearer t"})
            assert r.status_code == 200
        with pytest.raises(openai.NotFoundError) as gone:
            await c.responses.create(model=MODEL, input="more", previous_response_id=rid)
        assert gone.value.body["code"] == "previous_response_not_found"
        assert gone.value.body["param"] == "previous_response_id"
        assert worker in gone.value.message
        # a new conversation still works on the engines left
        _, other, _ = await create(c, input="a new start")
        assert other != worker
    finally:
        await replica.stop()


async def test_affinity_is_shared_between_replicas(stack):
    a = await Replica(stack.router_config("ra")).start()
    b = await Replica(stack.router_config("rb")).start()
    try:
        ca, cb = client(a.url), client(b.url)
        for i in range(4):
            rid, worker, _ = await create(ca, input=f"started on replica a, {i} " * 10)
            await until(lambda rid=rid: b.state.affinity.lookup(rid), what="b heard of it")
            nxt, w2, _ = await create(cb, input="continued on b", previous_response_id=rid)
            assert w2 == worker
            await until(lambda nxt=nxt: a.state.affinity.lookup(nxt), what="a heard back")
            _, w3, _ = await create(ca, input="back on a", previous_response_id=nxt)
            assert w3 == worker
    finally:
        await b.stop()
        await a.stop()
