"""The mock engine's SGLang prefill side waits for its decode engine, as SGLang's does:
the request sits in the bootstrap queue until a decode engine joins the room, and fails
with a clear error after a bounded wait when none does."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.pd import PdSide
from sim.mock.scheduler import Timing

ROOM = 1234567


async def prefill_engine(timeout: float) -> MockEngine:
    return await MockEngine(
        MockEngineConfig(
            worker_id="p0",
            model="m",
            block_size=16,
            gpu_blocks=64,
            zmq_endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            timing=Timing(speed=50.0),
            role="prefill",
            bootstrap_timeout=timeout,
        )
    ).start()


def body(engine: MockEngine) -> dict[str, object]:
    return {
        "model": "m",
        "prompt": "a disaggregated prompt " * 8,
        "max_tokens": 4,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": engine.port,
        "bootstrap_room": ROOM,
    }


async def test_a_prefill_whose_decode_engine_never_joins_fails_after_the_wait() -> None:
    engine = await prefill_engine(0.3)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            started = time.monotonic()
            resp = await client.post(engine.url + "/v1/completions", json=body(engine))
            waited = time.monotonic() - started
            state = (await client.get(f"{engine.url}/mock/bootstrap/{ROOM}")).json()["state"]
        assert resp.status_code == 500
        error = resp.json()["error"]
        assert error["code"] == "bootstrap_timeout"
        assert f"bootstrap room {ROOM}" in error["message"] and "0.3 s" in error["message"]
        assert waited >= 0.3
        assert state == "failed"  # a decode engine joining late hears the prefill failed
        assert engine.pd.counts["bootstrap_timeouts"] == 1
        assert engine.pd.counts["prefills"] == 0
        assert engine.scheduler.prompt_tokens == 0  # nothing was computed
    finally:
        await engine.stop()


@pytest.mark.parametrize("join_first", [True, False])
async def test_the_prefill_runs_once_a_decode_engine_joins(join_first: bool) -> None:
    engine = await prefill_engine(10.0)
    url = f"{engine.url}/mock/bootstrap/{ROOM}"
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            if join_first:  # the decode engine's join can come first: both go at once
                assert (await client.post(url)).json()["state"] == "joined"
            task = asyncio.ensure_future(
                client.post(engine.url + "/v1/completions", json=body(engine))
            )
            if not join_first:
                for _ in range(200):  # bounded: the prefill is seen waiting in the room
                    if (await client.get(url)).json()["state"] == "pending":
                        break
                    await asyncio.sleep(0.01)
                assert (await client.get(url)).json()["state"] == "pending"
                assert not task.done()
                assert (await client.post(url)).json()["state"] == "ready"
            resp = await asyncio.wait_for(task, 10)
            assert resp.status_code == 200
            assert resp.json()["usage"]["completion_tokens"] == 1  # a prefill: one token
            assert (await client.get(url)).json()["state"] == "done"
        assert engine.pd.counts["prefills"] == 1
        assert engine.pd.counts["bootstrap_timeouts"] == 0
    finally:
        await engine.stop()


def test_the_bootstrap_timeout_is_bounded() -> None:
    for bad in (0.0, -1.0, 1e9):
        with pytest.raises(ValueError, match="bootstrap_timeout"):
            PdSide("prefill", "p0", "127.0.0.1", lambda: 0, None, Timing(), bad)  # type: ignore[arg-type]
