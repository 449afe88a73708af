"""Data-parallel ranks on a real vLLM (``--data-parallel-size 2``, CPU): one HTTP endpoint,
two KV caches. One agent per rank (its events on port P+rank), the router indexing and
routing per (engine, rank) target and naming the rank in vLLM's ``X-data-parallel-rank``
header. Per request: predicted hit tokens equal vLLM's ``cached_tokens``.

The router reads core NATS here, so the native event reader (``router.events.native_reader``)
applies the live batches itself, vLLM's default bytes (sha256) block hashes included; the
other real-engine tests read the JetStream stream."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from real_stack import Feed, Stack, long_prompt
from stack import until
from vllm_engine import MODEL, Engine

from router.config import WorkerSpec
from router.workers.dp import target_id


@pytest.mark.timeout(900)  # a cold start of two engine cores on 2 cores
async def test_each_rank_is_indexed_and_routed_on_its_own(
    dp_engine: Engine, model_dir: Path, nats_url: str
) -> None:
    feeds = [Feed(target_id("d0", r), dp_engine, r) for r in range(2)]
    workers = [WorkerSpec("d0", dp_engine.url, dp_size=2)]
    s = Stack(feeds, workers, model_dir, nats_url, transport="core")
    try:
        check = await s.start([MODEL])
        # a prefix placed directly on each rank (vLLM's own header, past the router)
        async with httpx.AsyncClient(base_url=dp_engine.url, timeout=120) as http:
            for r in (1, 0):
                resp = await http.post(
                    "/v1/completions",
                    headers={"X-data-parallel-rank": str(r)},
                    json={"model": MODEL, "prompt": long_prompt(r, 60), "max_tokens": 1},
                )
                assert resp.status_code == 200, resp.text
                await s.settle()
        assert s.blocks("d0-dp0") > 0 and s.blocks("d0-dp1") > 0
        # each request follows its prefix to the rank holding it; vLLM reports the hit
        for r in (1, 0, 1):
            row = await check.send(f"rank{r}", "completion", prompt=long_prompt(r, 60) + " more")
            assert row["worker"] == f"d0-dp{r}", row
            assert row["predicted"] > 0, row
            await s.settle()
        # new prefixes, cold then warm, wherever the router puts them
        for i in range(2, 6):
            for turn in range(2):
                await check.send(f"new{i}.{turn}", "completion", prompt=long_prompt(i, 40))
                await s.settle()
        events = s.app.state.events
        assert events.native is not None, "the router did not read through the native reader"
        await until(lambda: events.counts["native_applied"] > 0, what="batches applied natively")
    finally:
        summary = await s.finish("dp-ranks", model_dir.parent / "real_engines_dp.json")
    assert summary is not None
    assert summary["mismatches"] == [], summary
    assert summary["cached_tokens"] > 0
