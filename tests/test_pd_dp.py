"""DP ranks inside disaggregated pools, in both wire protocols: the prefill choice and the
decode choice each name a (worker, rank) target, and each engine gets its rank in the
form it reads (vLLM's ``X-data-parallel-rank`` header; SGLang's ``routed_dp_rank``, the
decode engine also ``disagg_prefill_dp_rank`` and a room whose remainder by the prefill's
dp size is the prefill rank).

The mock engines keep one KV cache per rank and transfer between one prefill rank and one
decode rank (vLLM: the rank's engine id in the transfer params; SGLang: rooms per prefill
rank), so a rank lost on the way fails the request or lands the blocks elsewhere.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from stack import BS, MODEL, EngineStack, mock_engine_config, until

from router.config import RouterConfig, WorkerSpec
from router.pd.exchange import bootstrap_room
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.scheduler import Timing

PROMPT = "Ranks of a disaggregated pool each keep their own KV cache; route to one. " * 6
FIELD = {"vllm": "header", "sglang": "routed_dp_rank"}


class Stack(EngineStack):
    def computed(self, wid: str) -> list[int]:
        """Prompt tokens each rank of ``wid`` computed."""
        return [r.scheduler.prompt_tokens for r in self.engines[wid].ranks]

    def holds(self, tid: str, tokens: int) -> bool:
        stats = self.state.registry.pools["default"].index.stats()
        return stats.workers.get(tid, {}).get("gpu", 0) * BS >= tokens - BS


@contextlib.asynccontextmanager
async def pd_dp_stack(nats_url: str, protocol: str, **cfg: Any) -> AsyncIterator[Stack]:
    """Prefill engine p0 and decode engine d0, two ranks each, an agent per rank."""
    s = Stack(nats_url)
    specs = []
    try:
        for wid, role in (("p0", "prefill"), ("d0", "decode")):
            engine = await s.add(
                mock_engine_config(
                    wid,
                    gpu_blocks=256,
                    dp_size=2,
                    timing=Timing(speed=50.0),
                    role=role,
                    bootstrap_timeout=5.0,
                )
            )
            specs.append(
                WorkerSpec(
                    wid,
                    engine.url,
                    model=MODEL,
                    role=role,
                    bootstrap_port=engine.port,
                    dp_size=2,
                    dp_field=FIELD[protocol],  # type: ignore[arg-type]
                )
            )
        await s.serve(
            RouterConfig(
                nats_url=nats_url,
                block_size=BS,
                admin_token="t",
                health_interval=30.0,
                pd_protocol=protocol,  # type: ignore[arg-type]
                workers=specs,
                **cfg,
            )
        )
        yield s
    finally:
        await s.stop()


async def _chat(http: httpx.AsyncClient, turn: str) -> tuple[str, dict[str, Any]]:
    resp = await http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "max_tokens": 5, "messages": [
            {"role": "system", "content": PROMPT}, {"role": "user", "content": turn}]},
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    return resp.headers["x-cache-router-worker"], resp.json()


def _prefill_target(metrics: str) -> list[str]:
    return [
        t for t in ("p0-dp0", "p0-dp1")
        if f'cache_router_pd_requests_total{{path="remote",role="prefill",worker="{t}"}}'
        in metrics
    ]  # fmt: skip


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_each_side_runs_on_the_rank_the_router_chose(nats_url: str, protocol: str) -> None:
    async with (
        pd_dp_stack(nats_url, protocol) as s,
        httpx.AsyncClient(base_url=s.url, timeout=30) as http,
    ):
        decode, answer = await _chat(http, "which rank?")
        assert decode in ("d0-dp0", "d0-dp1")
        assert answer["usage"]["completion_tokens"] == 5
        prompt = answer["usage"]["prompt_tokens"]
        chosen = _prefill_target((await http.get("/metrics")).text)
        assert len(chosen) == 1
        p_rank, d_rank = int(chosen[0][-1]), int(decode[-1])
        # the prefill rank the router chose computed the prompt, the other nothing
        assert s.computed("p0")[p_rank] == prompt and s.computed("p0")[1 - p_rank] == 0
        # the decode rank it chose received the blocks and generated; the other idled
        d_ranks = s.engines["d0"].ranks
        assert d_ranks[d_rank].scheduler.generation_tokens == 5
        assert d_ranks[1 - d_rank].scheduler.generation_tokens == 0
        assert not d_ranks[1 - d_rank].cache.gpu_hashes()
        assert s.engines["d0"].pd.counts["blocks_received"] == prompt // BS
        # each rank's own KV events say so, under its target name
        await until(lambda: s.holds(decode, prompt), what="decode rank indexed")
        await until(lambda: s.holds(chosen[0], prompt), what="prefill rank indexed")

        # the next turn of the conversation: its prefix is on that prefill rank
        _, _again = await _chat(http, "and again?")
        assert _prefill_target((await http.get("/metrics")).text) == chosen
        p_sched = s.engines["p0"].ranks[p_rank].scheduler
        assert p_sched.prefix_hits >= prompt // BS * BS - BS
        assert s.computed("p0")[1 - p_rank] == 0
        # fresh prompts (each a new room and a new choice on both sides) all arrive
        for i in range(4):
            fresh = {"role": "user", "content": f"conversation {i}: " + PROMPT[i:]}
            resp = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "max_tokens": 2, "messages": [fresh]},
            )
            assert resp.status_code == 200, resp.text
        explain = await http.post(
            "/admin/explain",
            headers={"authorization": "Bearer t"},
            json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]},
        )
        pd = explain.json()["pd"]
        assert set(pd["prefill"]["candidates"]) == {"p0-dp0", "p0-dp1"}
        assert set(pd["decode"]["candidates"]) == {"d0-dp0", "d0-dp1"}


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_a_local_prefill_runs_on_the_chosen_decode_rank(nats_url: str, protocol: str) -> None:
    async with pd_dp_stack(nats_url, protocol, pd_local_prefill_tokens=1 << 20) as s:
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as http:
            decode, answer = await _chat(http, "local, please")
        d_rank = int(decode[-1])
        assert s.computed("d0")[d_rank] == answer["usage"]["prompt_tokens"]
        assert s.computed("d0")[1 - d_rank] == 0 and s.computed("p0") == [0, 0]


def test_the_room_names_the_prefill_rank() -> None:
    rng = random.Random(7)
    for dp_size in (2, 3, 8, 1024):
        for rank in (0, dp_size - 1, dp_size // 2):
            for _ in range(50):
                room = bootstrap_room(rng, rank, dp_size)
                assert 0 <= room < 1 << 63 and room % dp_size == rank
    assert 0 <= bootstrap_room(rng, None, 1) < 1 << 63


async def test_a_decode_engine_in_another_ranks_room_never_gets_the_kv() -> None:
    """The mock is strict as SGLang is: a prefill on rank 1 waits in rank 1's room; a decode
    engine joining the room of ``room % dp_size`` (rank 0) leaves it waiting."""
    engine = await MockEngine(
        MockEngineConfig(
            worker_id="p0",
            model=MODEL,
            block_size=BS,
            gpu_blocks=64,
            dp_size=2,
            timing=Timing(speed=50.0),
            role="prefill",
            bootstrap_timeout=0.3,
        )
    ).start()
    room = 1000  # room % 2 == 0: an older decode engine would look on rank 0
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "routed_dp_rank": 1,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": engine.port}  # fmt: skip
    url = f"{engine.url}/mock/bootstrap"
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.post(f"{url}/{room}")).json()["dp_rank"] == 0
            lost = await http.post(
                engine.url + "/v1/completions", json={**body, "bootstrap_room": room}
            )
            assert lost.status_code == 500 and lost.json()["error"]["code"] == "bootstrap_timeout"
            # the decode engine that names the prefill's rank finds it
            room += 2
            assert (await http.post(f"{url}/{room}?dp_rank=1")).json()["state"] == "joined"
            ok = await http.post(
                engine.url + "/v1/completions", json={**body, "bootstrap_room": room}
            )
            assert ok.status_code == 200
            assert (await http.get(f"{url}/{room}?dp_rank=1")).json()["state"] == "done"
        assert [r.scheduler.prompt_tokens > 0 for r in engine.ranks] == [False, True]
    finally:
        await engine.stop()
