"""A hybrid model on a real vLLM: layer 0 with a 64-token sliding window, layer 1 full
attention, so vLLM keeps two KV-cache groups and a hit needs both (the full group every
block before it, the window group the last two). The router learns the groups from the
events (``kv_cache_spec_kind``) and must predict exactly vLLM's ``cached_tokens``.

vLLM 0.32 caches only the window group's blocks that can serve a hit (the tail of each
stored range, ``SlidingWindowManager.reachable_block_mask``), so a prompt that forks from
a cached one mid-range gets no hit at all (measured: ``fork`` below, 0 cached)."""

from __future__ import annotations

from pathlib import Path

import pytest
from real_stack import Feed, Stack, long_prompt
from vllm_engine import MODEL, Engine

from router.config import WorkerSpec


@pytest.mark.timeout(900)
async def test_a_sliding_window_model_predicts_its_cached_tokens(
    sw_engine: Engine, sw_model_dir: Path, nats_url: str
) -> None:
    s = Stack([Feed("s0", sw_engine)], [WorkerSpec("s0", sw_engine.url)], sw_model_dir, nats_url)
    try:
        check = await s.start([MODEL])
        for i in range(3):  # prompts of 4-10 blocks, each far past the window
            prompt = long_prompt(i, 40 + 30 * i)
            await check.send(f"cold.{i}", "completion", prompt=prompt)
            await s.settle()
            await check.send(f"warm.{i}", "completion", prompt=prompt + " and more")
            await s.settle()
        # a shared head, another tail: the hit ends where the prompts part
        await check.send("fork", "completion", prompt=long_prompt(2, 60) + " another tail")
        await s.settle()
    finally:
        out = sw_model_dir.parent / "real_engines_sliding_window.json"
        summary = await s.finish("sliding-window", out)
    assert summary is not None
    assert summary["mismatches"] == [], summary
    assert summary["cached_tokens"] > 0
