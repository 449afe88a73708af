"""LoRA adapters (router/workers/lora.py): requests for an adapter go only to engines that have
it loaded, hit there in the adapter's own prefix space, and never count base-model blocks.

End to end: two mock engines (one serving an adapter) -> agents -> NATS -> the router."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from stack import BS, MODEL, MockStack, Replica, hits, mock_engine_config, until

from router.config import ModelSpec, RouterConfig, WorkerSpec
from router.workers.lora import LoraSlots, parse_lora_info
from router.workers.registry import WorkerRegistry

AUTH = {"authorization": "Bearer t"}
ADAPTER = "sql-lora"
PROMPT = "Translate the question into SQL over the orders table, then explain it. " * 4


def test_parse_lora_info_reads_vllms_gauge() -> None:
    text = (
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",'
        'waiting_lora_adapters=""} 1.7e9\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",'
        'waiting_lora_adapters="c"} 1.8e9\n'
    )
    slots = parse_lora_info(text)
    assert slots == LoraSlots(frozenset({"a"}), frozenset({"c"}), 2)  # the last series
    assert slots.can_take("a") and slots.can_take("c") and not slots.can_take("d")
    assert parse_lora_info("vllm:num_requests_running 3\n") is None
    assert parse_lora_info('vllm:lora_requests_info{max_lora="x"} 1\n') is None


def test_an_unlisted_adapter_prefers_engines_with_a_free_slot() -> None:
    cfg = RouterConfig(block_size=BS, models={ADAPTER: ModelSpec(base=MODEL)})
    reg = WorkerRegistry(cfg)
    full, free, unknown = (reg.add(WorkerSpec(w, f"http://h/{w}", model=MODEL)) for w in "abc")
    full.lora = LoraSlots(frozenset({"x", "y"}), frozenset(), 2)
    free.lora = LoraSlots(frozenset({"x"}), frozenset(), 2)
    assert reg.for_model(ADAPTER) == [free]
    free.lora = LoraSlots(frozenset({"x", "z"}), frozenset(), 2)
    assert reg.for_model(ADAPTER) == [full, free, unknown]  # no slot anywhere: any base engine
    assert reg.lora_name(ADAPTER) == ADAPTER and reg.lora_name(MODEL) is None


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[tuple[MockStack, Replica]]:
    mocks = MockStack(nats_url)
    for i, adapters in enumerate([(ADAPTER,), ()]):
        await mocks.add(mock_engine_config(f"l{i}", gpu_blocks=256, lora_modules=adapters))
    replica = await Replica(mocks.router_config("r0", health_interval=0.05)).start()
    yield mocks, replica
    await replica.stop()
    await mocks.stop()


async def test_adapter_requests_go_only_to_its_engine_and_hit(
    stack: tuple[MockStack, Replica],
) -> None:
    mocks, replica = stack
    registry = replica.state.registry
    # the router learns the adapter from the engine's /v1/models (parent = the base model)
    await until(
        lambda: [w.id for w in registry.for_model(ADAPTER)] == ["l0"], what="adapter listed"
    )
    assert registry.adapters[ADAPTER] == MODEL
    async with httpx.AsyncClient(base_url=replica.url, timeout=30) as http:
        workers, cached = [], []
        for turn in range(4):
            worker, predicted, hit = await hits(http, PROMPT + f"question {turn}", ADAPTER)
            workers.append(worker)
            cached.append(hit)
            assert predicted == hit, (turn, predicted, hit)
            await until(lambda: mocks.delivered(replica), what="events applied")
        assert workers == ["l0"] * 4
        assert cached[0] == 0 and all(c > 0 for c in cached[1:])
        # the adapter's blocks are its own prefix space: the same prompt on the base model
        # matches nothing on l0, though l0 holds those tokens under the adapter
        body = {"model": MODEL, "prompt": PROMPT + "question 9"}
        rows = (await http.post("/admin/explain", headers=AUTH, json=body)).json()["workers"]
        assert {r["worker_id"]: r["match"]["total"] for r in rows} == {"l0": 0, "l1": 0}
        worker, predicted, hit = await hits(http, PROMPT + "question 9")
        assert predicted == hit == 0
        missing = await http.post(
            "/v1/completions", json={"model": "no-such-adapter", "prompt": "x", "max_tokens": 1}
        )
        assert missing.status_code == 404
