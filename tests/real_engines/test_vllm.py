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
from pathlib import Path

import pytest
from real_stack import Feed, Stack, long_prompt
from stack import until
from vllm_engine import BLOCK, LORA, MODEL, Engine

from router.config import WorkerSpec

SYSTEMS = [f"You are assistant number {i}. Answer in one short sentence. " * 6 for i in range(3)]


@pytest.mark.timeout(1500)  # two cold vLLM starts and a restart on 2 cores
async def test_vllm_predicted_hits_equal_cached_tokens(
    engines: list[Engine], model_dir: Path, nats_url: str
) -> None:
    workers = [WorkerSpec(e.name, e.url) for e in engines]  # models from /v1/models
    s = Stack([Feed(e.name, e) for e in engines], workers, model_dir, nats_url)
    try:
        check = await s.start([MODEL, LORA])
        # cold, then warm: multi-turn chats on three system prompts
        for turn in range(3):
            for i, system in enumerate(SYSTEMS):
                messages = [{"role": "system", "content": system}]
                for t in range(turn + 1):
                    messages.append({"role": "user", "content": f"chat {i} turn {t}: go on"})
                    if t < turn:
                        messages.append({"role": "assistant", "content": f"reply {t}"})
                await check.send(f"chat{i}.t{turn}", "chat", messages=messages)
                await s.settle()
        # completions sharing a prefix; a prompt of exactly four blocks (ids), twice
        for i in range(3):
            await check.send(f"completion.{i}", "completion", prompt=SYSTEMS[0] + f" tail {i}")
            await s.settle()
        whole = [1, *range(500, 500 + 4 * BLOCK - 1)]
        for i in range(2):
            await check.send(f"whole-blocks.{i}", "completion", prompt=whole)
            await s.settle()
        # streaming usage
        for i in range(2):
            msgs = [{"role": "system", "content": SYSTEMS[1]}, {"role": "user", "content": "s"}]
            await check.send(f"stream.{i}", "chat", stream=True, messages=msgs)
            await s.settle()
        # a LoRA adapter: its blocks are not the base model's
        for i in range(2):
            await check.send(f"lora.{i}", "completion", model=LORA, prompt=SYSTEMS[2] + " lora")
            await s.settle()
        # cache salts
        for salt in ("tenant-a", "tenant-a", "tenant-b"):
            await check.send(
                f"salt.{salt}", "completion", prompt=SYSTEMS[2] + " salted", cache_salt=salt
            )
            await s.settle()
        # eviction: long prompts (each ~1/4 of an engine's cache) push older ones out
        for i in range(8):
            await check.send(f"evict.{i}", "completion", prompt=long_prompt(i, 100))
            await s.settle()
        for i in (0, 1, 7):
            await check.send(f"evict.again.{i}", "completion", prompt=long_prompt(i, 100))
            await s.settle()
        # a restart the health checks never see: same ports, empty cache
        victim = next(e for e in engines if s.blocks(e.name))
        agent = s.agent(victim.name)
        # off the event loop: the agents and the router must keep running meanwhile
        await asyncio.to_thread(victim.stop)
        victim.start()
        await asyncio.to_thread(victim.wait_ready)
        await until(
            lambda: not s.blocks(victim.name),
            timeout=60,
            what="the restarted engine's blocks gone from the router",
        )
        assert agent.stats()["epoch_starts_published"] + agent.stats()["restarts"] >= 1
        for i in range(4):
            await check.send(f"after-restart.{i}", "completion", prompt=long_prompt(7 - i, 100))
            await s.settle()
    finally:
        summary = await s.finish("two-engines", model_dir.parent / "real_engines_summary.json")
    assert summary is not None
    assert summary["mismatches"] == [], summary
    assert summary["cached_tokens"] > 0  # warm requests did hit
