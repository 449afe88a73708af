"""The router in front of real vLLM engines (PyPI's CPU build, a 2-layer Llama with
dummy weights): two engines with their node agents, a real nats-server, the router,
the official ``openai`` client.

Every request is checked twice: the router's predicted cached tokens
(``x-cache-router-hit-tokens``) equal vLLM's ``usage.prompt_tokens_details.cached_tokens``,
and the router's token ids equal vLLM's ``/tokenize`` of the same body. Through cold and
warm chats and completions, a prompt of whole blocks, streaming usage, a LoRA adapter,
cache salts, eviction, and an engine restart the health checks never see.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from stack import Served, until
from vllm_engine import BLOCK, LORA, MODEL, Engine

from agent.node import AgentConfig, NodeAgent
from router.app import RouterApp
from router.config import RouterConfig, WorkerSpec
from router.events import last_seq
from router.tokenize import HFTokenizer

SYSTEMS = [f"You are assistant number {i}. Answer in one short sentence. " * 6 for i in range(3)]


class Checker:
    def __init__(self, router_url: str, engines: list[Engine], tok: HFTokenizer) -> None:
        self.client = openai.AsyncOpenAI(base_url=router_url + "/v1", api_key="x", max_retries=0)
        self.engines = {e.name: e for e in engines}
        self.tok = tok
        self.rows: list[dict[str, Any]] = []
        self.http = httpx.AsyncClient(timeout=60)

    async def router_tokens(self, kind: str, body: dict[str, Any]) -> list[int]:
        if kind == "chat":
            ids, _ = self.tok.chat(body)
        else:
            ids, _ = self.tok.completion(body["prompt"], True)
        return list(ids)

    async def engine_tokens(self, worker: str, kind: str, body: dict[str, Any]) -> list[int]:
        if kind == "completion" and isinstance(body["prompt"], list):
            return list(body["prompt"])  # token ids go to the engine as they are
        req: dict[str, Any] = {"model": body["model"]}
        if kind == "chat":
            req.update(messages=body["messages"], add_generation_prompt=True)
        else:
            req["prompt"] = body["prompt"]
        r = await self.http.post(self.engines[worker].url + "/tokenize", json=req)
        r.raise_for_status()
        return list(r.json()["tokens"])

    async def send(self, label: str, kind: str, stream: bool = False, **body: Any) -> dict:
        body.setdefault("model", MODEL)
        extra = {k: body.pop(k) for k in ("cache_salt",) if k in body}
        create = (
            self.client.chat.completions if kind == "chat" else self.client.completions
        ).with_raw_response.create
        opts: dict[str, Any] = {"max_tokens": 2, "temperature": 0.0, "extra_body": extra}
        if stream:
            opts.update(stream=True, stream_options={"include_usage": True})
        raw = await create(**body, **opts)
        worker = raw.headers["x-cache-router-worker"]
        predicted = int(raw.headers["x-cache-router-hit-tokens"])
        if stream:
            usage = None
            async for chunk in raw.parse():
                usage = chunk.usage or usage
        else:
            usage = raw.parse().usage
        assert usage is not None, label
        details = usage.prompt_tokens_details
        cached = details.cached_tokens if details else None
        full = {**body, **extra}
        mine = await self.router_tokens(kind, full)
        theirs = await self.engine_tokens(worker, kind, full)
        row = {
            "label": label,
            "worker": worker,
            "prompt_tokens": usage.prompt_tokens,
            "predicted": predicted,
            "cached": cached,
            "hits_equal": predicted == cached,
            "tokens_equal": mine == theirs and len(mine) == usage.prompt_tokens,
        }
        self.rows.append(row)
        return row


def long_prompt(i: int, n_words: int) -> str:
    return f"document {i}: " + " ".join(f"w{i}x{j}" for j in range(n_words))


@pytest.mark.timeout(1500)  # two cold vLLM starts and a restart on 2 cores
async def test_vllm_predicted_hits_equal_cached_tokens(
    engines: list[Engine], model_dir: Path, nats_url: str
) -> None:
    agents = [
        NodeAgent(
            AgentConfig(
                worker_id=e.name,
                zmq_endpoint=e.events,
                replay_endpoint=e.replay,
                engine_url=e.url,
                nats_url=nats_url,
                load_interval=0.5,
                replay_timeout=2.0,
            )
        )
        for e in engines
    ]
    for a in agents:
        await a.start()
    cfg = RouterConfig(
        nats_url=nats_url,
        block_size=BLOCK,
        tokenizer=str(model_dir),
        admin_token="t",
        health_interval=3600.0,  # the restart below must go unseen by health checks
        workers=[WorkerSpec(e.name, e.url) for e in engines],  # models from /v1/models
    )
    app = RouterApp(cfg)
    served = await Served(app).start()
    state = app.state
    pool = state.registry.pools["default"]

    def synced() -> bool:
        return all(
            a.core.last_seq is None or last_seq(pool.ingest, a.cfg.worker_id) == a.core.last_seq
            for a in agents
        )

    async def settle() -> None:
        await asyncio.sleep(0.3)  # vLLM publishes a step's events after its output
        await until(synced, timeout=30, what="router applied every batch")

    await until(lambda: state.bus.connected, timeout=30, what="router on NATS")
    await until(lambda: all(a.engine_connected for a in agents), timeout=60, what="agents on vLLM")
    await until(lambda: len(state.registry.for_model(LORA)) == 2, timeout=60, what="models")
    check = Checker(served.url, engines, HFTokenizer(model_dir))
    try:
        # cold, then warm: multi-turn chats on three system prompts
        for turn in range(3):
            for i, system in enumerate(SYSTEMS):
                messages = [{"role": "system", "content": system}]
                for t in range(turn + 1):
                    messages.append({"role": "user", "content": f"chat {i} turn {t}: go on"})
                    if t < turn:
                        messages.append({"role": "assistant", "content": f"reply {t}"})
                await check.send(f"chat{i}.t{turn}", "chat", messages=messages)
                await settle()
        # completions sharing a prefix; a prompt of exactly four blocks (ids), twice
        for i in range(3):
            await check.send(f"completion.{i}", "completion", prompt=SYSTEMS[0] + f" tail {i}")
            await settle()
        whole = [1, *range(500, 500 + 4 * BLOCK - 1)]
        for i in range(2):
            await check.send(f"whole-blocks.{i}", "completion", prompt=whole)
            await settle()
        # streaming usage
        for i in range(2):
            msgs = [{"role": "system", "content": SYSTEMS[1]}, {"role": "user", "content": "s"}]
            await check.send(f"stream.{i}", "chat", stream=True, messages=msgs)
            await settle()
        # a LoRA adapter: its blocks are not the base model's
        for i in range(2):
            await check.send(f"lora.{i}", "completion", model=LORA, prompt=SYSTEMS[2] + " lora")
            await settle()
        # cache salts
        for salt in ("tenant-a", "tenant-a", "tenant-b"):
            await check.send(
                f"salt.{salt}", "completion", prompt=SYSTEMS[2] + " salted", cache_salt=salt
            )
            await settle()
        # eviction: long prompts (each ~1/4 of an engine's cache) push older ones out
        for i in range(8):
            await check.send(f"evict.{i}", "completion", prompt=long_prompt(i, 100))
            await settle()
        for i in (0, 1, 7):
            await check.send(f"evict.again.{i}", "completion", prompt=long_prompt(i, 100))
            await settle()
        # a restart the health checks never see: same ports, empty cache
        victim = next(e for e in engines if pool.index.stats().workers.get(e.name, {}).get("gpu"))
        agent = next(a for a in agents if a.cfg.worker_id == victim.name)
        # off the event loop: the agents and the router must keep running meanwhile
        await asyncio.to_thread(victim.stop)
        victim.start()
        await asyncio.to_thread(victim.wait_ready)
        await until(
            lambda: not pool.index.stats().workers.get(victim.name, {}).get("gpu"),
            timeout=60,
            what="the restarted engine's blocks gone from the router",
        )
        assert agent.stats()["epoch_starts_published"] + agent.stats()["restarts"] >= 1
        for i in range(4):
            await check.send(f"after-restart.{i}", "completion", prompt=long_prompt(7 - i, 100))
            await settle()
    finally:
        summary = {
            "requests": len(check.rows),
            "hits_equal": sum(r["hits_equal"] for r in check.rows),
            "tokens_equal": sum(r["tokens_equal"] for r in check.rows),
            "predicted_tokens": sum(r["predicted"] for r in check.rows),
            "cached_tokens": sum(r["cached"] or 0 for r in check.rows),
            "mismatches": [r for r in check.rows if not (r["hits_equal"] and r["tokens_equal"])],
        }
        print("REAL_ENGINES " + json.dumps(summary))
        Path(model_dir.parent / "real_engines_summary.json").write_text(json.dumps(check.rows))
        await check.http.aclose()
        await served.stop()
        for a in agents:
            await a.stop()
    assert summary["mismatches"] == [], summary
    assert summary["cached_tokens"] > 0  # warm requests did hit
