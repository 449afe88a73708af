"""LoRA adapters (router/lora.py): requests for an adapter go only to engines that have
it loaded, hit there in the adapter's own prefix space, and never count base-model blocks.

End to end: two mock engines (one serving an adapter) -> agents -> NATS -> the router."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from stack import Served, engine_agent, until

from agent.node import NodeAgent
from router.app import RouterApp
from router.config import ModelSpec, RouterConfig, WorkerSpec
from router.events import last_seq
from router.lora import LoraSlots, parse_lora_info
from router.workers import WorkerRegistry
from sim.mock_engine import MockEngine, MockEngineConfig
from sim.mock_scheduler import Timing

AUTH = {"authorization": "Bearer t"}
BS = 16
MODEL = "mock-model"
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


class Stack:
    def __init__(self, engines: list[MockEngine], agents: list[NodeAgent], app: RouterApp):
        self.engines, self.agents, self.app = engines, agents, app
        self.served: Served | None = None

    def synced(self) -> bool:
        ingest = self.app.state.registry.pools["default"].ingest
        for engine, agent in zip(self.engines, self.agents, strict=True):
            pub = engine.publisher
            assert pub is not None
            if pub.seq and not agent.core.last_seq == pub.seq - 1 == last_seq(
                ingest, agent.cfg.worker_id
            ):
                return False
        return True


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    engines, agents = [], []
    for i, adapters in enumerate([(ADAPTER,), ()]):
        cfg = MockEngineConfig(
            worker_id=f"l{i}",
            model=MODEL,
            block_size=BS,
            gpu_blocks=256,
            lora_modules=adapters,
            zmq_endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            timing=Timing(speed=200.0),
        )
        engine = await MockEngine(cfg).start()
        engines.append(engine)
        agents.append(await engine_agent(engine, nats_url))
    app = RouterApp(
        RouterConfig(
            nats_url=nats_url,
            block_size=BS,
            admin_token="t",
            health_interval=0.05,
            workers=[WorkerSpec(e.cfg.worker_id, e.url, model=MODEL) for e in engines],
        )
    )
    s = Stack(engines, agents, app)
    s.served = await Served(app).start()
    await until(lambda: app.state.bus.connected, what="router on NATS")
    yield s
    await s.served.stop()
    for a in agents:
        await a.stop()
    for e in engines:
        await e.stop()


async def _complete(http: httpx.AsyncClient, model: str, prompt: str) -> tuple[str, int, int]:
    resp = await http.post(
        "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2}
    )
    assert resp.status_code == 200, resp.text
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (
        resp.headers["x-cache-router-worker"],
        int(resp.headers["x-cache-router-hit-tokens"]),
        cached,
    )


async def test_adapter_requests_go_only_to_its_engine_and_hit(stack: Stack) -> None:
    assert stack.served is not None
    registry = stack.app.state.registry
    # the router learns the adapter from the engine's /v1/models (parent = the base model)
    await until(
        lambda: [w.id for w in registry.for_model(ADAPTER)] == ["l0"], what="adapter listed"
    )
    assert registry.adapters[ADAPTER] == MODEL
    async with httpx.AsyncClient(base_url=stack.served.url, timeout=30) as http:
        workers, cached = [], []
        for turn in range(4):
            worker, predicted, hit = await _complete(http, ADAPTER, PROMPT + f"question {turn}")
            workers.append(worker)
            cached.append(hit)
            assert predicted == hit, (turn, predicted, hit)
            await until(stack.synced, what="events applied")
        assert workers == ["l0"] * 4
        assert cached[0] == 0 and all(c > 0 for c in cached[1:])
        # the adapter's blocks are its own prefix space: the same prompt on the base model
        # matches nothing on l0, though l0 holds those tokens under the adapter
        body = {"model": MODEL, "prompt": PROMPT + "question 9"}
        rows = (await http.post("/admin/explain", headers=AUTH, json=body)).json()["workers"]
        assert {r["worker_id"]: r["match"]["total"] for r in rows} == {"l0": 0, "l1": 0}
        worker, predicted, hit = await _complete(http, MODEL, PROMPT + "question 9")
        assert predicted == hit == 0
        missing = await http.post(
            "/v1/completions", json={"model": "no-such-adapter", "prompt": "x", "max_tokens": 1}
        )
        assert missing.status_code == 404
