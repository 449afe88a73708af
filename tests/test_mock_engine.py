"""The mock engine over real HTTP and real ZMQ on loopback: OpenAI shapes, prefix cache
hits and evictions, KV events that rebuild its cache in the router's index, replay,
metrics, prefetch, waiting requests, SGLang layout and an HF tokenizer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgpack
import orjson
import pytest
import zmq
import zmq.asyncio
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families
from stack import until

from index.backend import make_ingest
from index.codec import BlockRemoved, BlockStored, decode
from index.hashing import BlockHasher
from index.prefix_index import PrefixIndex
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.scheduler import Timing

BS = 4
FAST = Timing(speed=200.0)
SYSTEM = "You are a careful assistant who answers in short sentences. " * 4


def chat(user: str, system: str = SYSTEM, **extra: object) -> dict[str, object]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": "mock-model", "messages": messages, **extra}


def engine_config(**kw: object) -> MockEngineConfig:
    base: dict[str, object] = {
        "block_size": BS,
        "gpu_blocks": 256,
        "zmq_endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "timing": FAST,
    }
    base.update(kw)
    return MockEngineConfig(**base)  # type: ignore[arg-type]


class EventTap:
    """A SUB socket on the engine's PUB socket, collecting (seq, payload)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.batches: list[tuple[int, bytes]] = []

    async def settle(self, engine: MockEngine) -> None:
        """Wait until the SUB socket is joined (the slow-joiner): a probe batch arrives."""
        assert engine.publisher is not None
        for _ in range(200):
            engine.publisher.publish([])
            if await self.sub.poll(20):
                await self.drain()
                self.batches.clear()
                return
        raise AssertionError("SUB socket never joined")

    async def drain(self, quiet_ms: int = 100) -> list[tuple[int, bytes]]:
        while await self.sub.poll(quiet_ms):
            frames = await self.sub.recv_multipart()
            assert len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8
            self.batches.append((int.from_bytes(frames[1], "big"), frames[2]))
        return self.batches

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    async with MockEngine(engine_config()) as e:
        yield e


async def test_repeated_prefix_hits_and_openai_shapes(engine: MockEngine) -> None:
    async with httpx.AsyncClient(base_url=engine.url) as http:
        first = (await http.post("/v1/chat/completions", json=chat("What is a cache?"))).json()
        again = (await http.post("/v1/chat/completions", json=chat("What is a block?"))).json()
        models = (await http.get("/v1/models")).json()
        assert (await http.get("/health")).status_code == 200
    assert first["object"] == "chat.completion" and first["id"].startswith("chatcmpl-")
    msg = first["choices"][0]
    assert msg["message"]["role"] == "assistant" and msg["message"]["content"]
    assert msg["finish_reason"] == "stop"
    u1, u2 = first["usage"], again["usage"]
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    assert u1["total_tokens"] == u1["prompt_tokens"] + u1["completion_tokens"]
    # The shared system prompt is cached, in whole blocks, short of the new user turn.
    cached = u2["prompt_tokens_details"]["cached_tokens"]
    assert cached % BS == 0 and len(SYSTEM) // 4 - BS <= cached < u2["prompt_tokens"]
    assert models["data"][0]["id"] == "mock-model"


async def test_streaming_with_the_openai_client(engine: MockEngine) -> None:
    client = AsyncOpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0)
    body = chat("Stream please")
    kwargs = {"messages": body["messages"], "model": "mock-model"}
    full = await client.chat.completions.create(**kwargs, max_tokens=7)  # type: ignore[call-overload]
    stream = await client.chat.completions.create(
        **kwargs, max_tokens=7, stream=True, stream_options={"include_usage": True}
    )  # type: ignore[call-overload]
    chunks = [c async for c in stream]
    await client.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content  # deterministic output
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the first call cached it


async def test_raw_sse_of_completions(engine: MockEngine) -> None:
    body = {"prompt": "count the blocks " * 6, "stream": True, "max_tokens": 3}
    async with (
        httpx.AsyncClient(base_url=engine.url) as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = (await resp.aread()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    assert len(chunks) == 3  # no usage chunk without stream_options.include_usage
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_errors_in_openai_format(engine: MockEngine) -> None:
    async with httpx.AsyncClient(base_url=engine.url) as http:
        wrong_model = await http.post("/v1/chat/completions", json={**chat("x"), "model": "gpt"})
        bad_json = await http.post("/v1/completions", content=b"{nope")
        no_prompt = await http.post("/v1/completions", json={"max_tokens": 3})
        too_long = await http.post("/v1/completions", json={"prompt": "x" * 8000})
        bad_max = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert wrong_model.status_code == 404
    for r in (bad_json, no_prompt, too_long, bad_max):
        assert r.status_code == 400, r.text
        assert set(r.json()["error"]) >= {"message", "type", "code"}


async def test_events_rebuild_the_cache_in_the_index_through_evictions() -> None:
    """ZMQ events -> EventIngest -> PrefixIndex equals what the engine's cache holds,
    while prompts overflow a small GPU and evict each other."""
    async with MockEngine(engine_config(gpu_blocks=40)) as engine:
        tap = EventTap(engine.zmq_endpoint or "")
        await tap.settle(engine)
        hasher = BlockHasher(BS)
        ingest = make_ingest(PrefixIndex(), hasher)
        prompts = [f"topic {i}: " + "lorem ipsum dolor sit amet " * 6 for i in range(6)]
        async with httpx.AsyncClient(base_url=engine.url) as http:
            cached = []
            for prompt in [*prompts, prompts[0]]:
                r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        batches = await tap.drain()
        tap.close()
    assert cached[-1] == 0  # prompt 0 was evicted by the later ones
    seqs = [s for s, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    events = [e for _, p in batches for e in decode(p).events]
    assert any(isinstance(e, BlockRemoved) for e in events)
    for seq, payload in batches:
        ingest.apply("w", seq - seqs[0], payload)
    assert set(ingest.engine_blocks("w")) == engine.cache.gpu_hashes()
    for prompt in prompts:
        tokens = engine.text.completion(prompt)
        gpu, _ = engine.cache.lookup(engine.cache.hash_blocks(tokens))
        assert ingest.index.match(hasher.hash_tokens(tokens)).get("w", 0) == gpu


async def test_replay_socket_answers_like_vllm(engine: MockEngine) -> None:
    tap = EventTap(engine.zmq_endpoint or "")
    await tap.settle(engine)
    async with httpx.AsyncClient(base_url=engine.url) as http:
        for i in range(3):
            await http.post("/v1/completions", json={"prompt": f"replay {i} " * 8, "max_tokens": 1})
    live = await tap.drain()
    tap.close()
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(engine.replay_endpoint or "")
    start = live[1][0]
    await dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies = []
    while True:
        assert await dealer.poll(5000)
        frames = await dealer.recv_multipart()
        assert frames[0] == b"" and len(frames) == 3
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq == -1:
            assert frames[2] == b""
            break
        replies.append((seq, frames[2]))
    # A malformed request is ignored, and the socket keeps serving.
    await dealer.send_multipart([b"", b"short"])
    await dealer.send_multipart([b"", (10**6).to_bytes(8, "big")])
    assert await dealer.poll(5000)
    assert int.from_bytes((await dealer.recv_multipart())[1], "big", signed=True) == -1
    ctx.destroy(linger=0)
    assert replies == live[1:]


async def test_metrics_parse_with_vllm_names_and_count_hits(engine: MockEngine) -> None:
    async with httpx.AsyncClient(base_url=engine.url) as http:
        for _ in range(2):
            await http.post("/v1/chat/completions", json=chat("metrics"))
        text = (await http.get("/metrics")).text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert name in samples, name
    assert samples["vllm:num_requests_running"].labels["model_name"] == "mock-model"
    queries = samples["vllm:prefix_cache_queries_total"].value
    hits = samples["vllm:prefix_cache_hits_total"].value
    assert 0 < hits < queries and 0 <= samples["vllm:kv_cache_usage_perc"].value <= 1


async def test_requests_that_do_not_fit_wait() -> None:
    slow = Timing(speed=1.0)  # ~0.2 s per request: the others visibly queue
    async with (
        MockEngine(engine_config(max_num_seqs=1, timing=slow)) as engine,
        httpx.AsyncClient(base_url=engine.url, timeout=30) as http,
    ):

        async def one(i: int) -> dict[str, object]:
            body = {"prompt": f"queue {i} " * 4, "max_tokens": 8, "ignore_eos": True}
            return (await http.post("/v1/completions", json=body)).json()

        jobs = [asyncio.create_task(one(i)) for i in range(3)]
        waiting = 0.0
        for _ in range(200):
            text = (await http.get("/metrics")).text
            for f in text_string_to_metric_families(text):
                if f.name == "vllm:num_requests_waiting":
                    waiting = max(waiting, f.samples[0].value)
            if waiting >= 1:
                break
            await asyncio.sleep(0.01)
        results = await asyncio.gather(*jobs)
    assert waiting >= 1
    assert all(r["usage"]["completion_tokens"] == 8 for r in results)  # type: ignore[index]


async def test_prefetch_lands_in_the_host_tier_and_is_hit() -> None:
    async with (
        MockEngine(engine_config()) as source,
        MockEngine(engine_config(host_blocks=64)) as target,
    ):
        prompt = "a long shared document about caches " * 4
        tokens = source.text.completion(prompt)
        hashes = source.cache.hash_blocks(tokens)
        tap = EventTap(target.zmq_endpoint or "")
        await tap.settle(target)
        async with httpx.AsyncClient() as http:
            no_tokens = await http.post(target.url + "/prefetch", json={"block_hashes": hashes})
            assert no_tokens.status_code == 422
            hint = {"block_hashes": hashes, "num_tokens": len(hashes) * BS, "token_ids": tokens}
            r = await http.post(target.url + "/prefetch", json=hint)
            assert r.status_code == 202 and r.json()["blocks"] == len(hashes)
            await until(lambda: target.cache.host_hashes() >= set(hashes), what="prefetch landed")
            body = {"prompt": prompt, "max_tokens": 1}
            hit = (await http.post(target.url + "/v1/completions", json=body)).json()
        events = [e for _, p in await tap.drain() for e in decode(p).events]
        tap.close()
    cached = hit["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == min(len(hashes), (len(tokens) - 1) // BS) * BS
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [h for e in cpu for h in e.block_hashes] == hashes  # announced, with tokens
    assert [t for e in cpu for t in e.token_ids] == tokens[: len(hashes) * BS]


async def test_sglang_layout_and_metrics() -> None:
    async with MockEngine(engine_config(encoding="sglang", host_blocks=8, gpu_blocks=12)) as e:
        tap = EventTap(e.zmq_endpoint or "")
        await tap.settle(e)
        async with httpx.AsyncClient(base_url=e.url) as http:
            for i in range(4):
                await http.post(
                    "/v1/completions", json={"prompt": f"sg {i} " * 16, "max_tokens": 1}
                )
            text = (await http.get("/metrics")).text
        batches = await tap.drain()
        tap.close()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"} <= names
    raw = [msgpack.unpackb(p, raw=False) for _, p in batches]
    events = [ev for b in raw for ev in b[1]]
    assert all(len(b) == 3 and isinstance(ev, dict) for b in raw for ev in b[1])
    stored_ = [ev for ev in events if ev["type"] == "BlockStored"]
    assert stored_ and all("lora_name" not in ev for ev in stored_)
    assert {ev.get("medium") for ev in events if ev["type"] != "AllBlocksCleared"} == {
        "GPU",
        "CPU_PINNED",
    }
    hashes = [h for ev in stored_ for h in ev["block_hashes"]]
    assert any(h < 0 for h in hashes) and all(-(1 << 63) <= h < 1 << 63 for h in hashes)


async def test_hf_tokenizer_file(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = "the cache holds every block of prompt so next turn starts where this one stopped"
    tok.train_from_iterator([words] * 3, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    async with MockEngine(engine_config(tokenizer=str(path))) as engine:
        body = {"prompt": "the cache holds every block", "max_tokens": 6}
        async with httpx.AsyncClient(base_url=engine.url) as http:
            r = (await http.post("/v1/completions", json=body)).json()
    assert r["usage"]["prompt_tokens"] == 5  # one id per word, as tokenizer.json says
    text = r["choices"][0]["text"]
    assert len(tok.encode(text).ids) == 6 and r["usage"]["completion_tokens"] == 6


async def test_a_continued_final_message_is_continued_as_vllm_does(engine: MockEngine) -> None:
    """vLLM's rules for ``continue_final_message``: not with a generation prompt (400);
    with ``add_generation_prompt: false`` the prompt is the chat up to the partial answer's
    last character, so its cached blocks are the original chat's plus the answer's."""
    partial = {"role": "assistant", "content": "the cache holds"}
    async with httpx.AsyncClient(base_url=engine.url) as http:
        body = chat("What is a cache?")
        grown = {**body, "messages": [*body["messages"], partial]}
        r = await http.post("/v1/chat/completions", json={**grown, "continue_final_message": True})
        assert r.status_code == 400 and "continue_final_message" in r.text
        first = (await http.post("/v1/chat/completions", json=body)).json()
        cont = {**grown, "continue_final_message": True, "add_generation_prompt": False}
        r = await http.post("/v1/chat/completions", json=cont)
        assert r.status_code == 200
        usage = r.json()["usage"]
        # the original prompt ended with the generation prompt the continuation renders too
        assert (
            usage["prompt_tokens"] >= first["usage"]["prompt_tokens"] + len("the cache holds") // 4
        )
        # every full block of the original chat is a prefix of the continuation's prompt
        held = first["usage"]["prompt_tokens"] // BS * BS
        assert usage["prompt_tokens_details"]["cached_tokens"] >= held > 0
