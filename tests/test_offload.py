"""The tokenize pool is bounded: a full pool refuses at once (429), a slow one times out
(503), a prompt given up on while waiting never runs, and the HTTP answer says so in
the OpenAI error shape while short prompts keep being served."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import httpx
import pytest
from stack import EngineDouble, Served, until

from router.config import ConfigError, RouterConfig, WorkerSpec, load_config
from router.http.app import RouterApp
from router.http.errors import ApiError
from router.tokens.pool import TokenizePool


def _blocker() -> tuple[threading.Event, list[str], Callable[[str], str]]:
    gate = threading.Event()
    ran: list[str] = []

    def work(name: str) -> str:
        ran.append(name)
        assert gate.wait(10), "the test never opened the gate"
        return name

    return gate, ran, work


async def test_a_full_pool_refuses_at_once_and_frees_its_places():
    pool = TokenizePool(threads=1, limit=2, timeout=30)
    gate, ran, work = _blocker()
    try:
        first = asyncio.create_task(pool.run(work, "a"))
        second = asyncio.create_task(pool.run(work, "b"))
        await until(lambda: ran == ["a"], what="the first prompt running")
        assert pool.held == 2
        with pytest.raises(ApiError) as refused:
            await pool.run(work, "c")
        assert refused.value.status == 429 and refused.value.code == "tokenizer_busy"
        assert b'"type":"rate_limit_error"' in refused.value.body()
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(first, second), 10) == ["a", "b"]
        assert ran == ["a", "b"]  # the refused one never ran
        await until(lambda: pool.held == 0, what="places freed")
        assert await asyncio.wait_for(pool.run(work, "d"), 10) == "d"
    finally:
        gate.set()
        pool.shutdown()


async def test_a_slow_prompt_times_out_and_keeps_its_place_until_its_thread_is_done():
    pool = TokenizePool(threads=1, limit=4, timeout=0.2)
    gate, ran, work = _blocker()
    try:
        running = asyncio.create_task(pool.run(work, "a"))
        await until(lambda: ran == ["a"], what="the first prompt running")
        with pytest.raises(ApiError) as waited:
            await pool.run(work, "b")  # queued behind "a": never starts in 0.2 s
        assert waited.value.status == 503 and waited.value.code == "tokenizer_timeout"
        with pytest.raises(ApiError):
            await running  # "a" itself is past its 0.2 s by now
        # "b" is cancelled before it started; "a" is still on its thread and counted
        await until(lambda: pool.held == 1, what="the queued prompt cancelled")
        await asyncio.sleep(0.05)
        assert pool.held == 1
        gate.set()
        await until(lambda: pool.held == 0, what="the running prompt finishing")
        assert ran == ["a"]
    finally:
        gate.set()
        pool.shutdown()


async def test_a_request_given_up_on_while_queued_never_runs():
    pool = TokenizePool(threads=1, limit=4, timeout=30)
    gate, ran, work = _blocker()
    try:
        first = asyncio.create_task(pool.run(work, "a"))
        await until(lambda: ran == ["a"], what="the first prompt running")
        queued = asyncio.create_task(pool.run(work, "b"))
        await until(lambda: pool.held == 2, what="the second prompt queued")
        queued.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await queued
        await until(lambda: pool.held == 1, what="the queued prompt cancelled")
        gate.set()
        assert await asyncio.wait_for(first, 10) == "a"
        await until(lambda: pool.held == 0, what="places freed")
        assert ran == ["a"]
    finally:
        gate.set()
        pool.shutdown()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CACHE_ROUTER_TOKENIZE_QUEUE": "0"}, "tokenize_queue must be at least 1"),
        ({"CACHE_ROUTER_TOKENIZE_THREADS": "0"}, "tokenize_threads must be at least 1"),
        ({"CACHE_ROUTER_TOKENIZE_TIMEOUT": "0"}, "tokenize_timeout must be positive"),
        ({"CACHE_ROUTER_TOKENIZE_TIMEOUT": "1e9"}, "tokenize_timeout must be at most"),
    ],
)
def test_pool_settings_are_checked(env, message):
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def test_pool_settings_layer_like_every_setting(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text("tokenize_queue = 8\ntokenize_threads = 3\ntokenize_timeout = 2.5\n")
    cfg = load_config(path, env={"CACHE_ROUTER_TOKENIZE_QUEUE": "5"})
    assert (cfg.tokenize_queue, cfg.tokenize_threads, cfg.tokenize_timeout) == (5, 3, 2.5)


async def test_the_router_answers_429_then_serves_again_and_short_prompts_never_wait():
    engine = await EngineDouble("w0").start()
    cfg = RouterConfig(
        block_size=4,
        offload_chars=1000,
        tokenize_threads=1,
        tokenize_queue=1,
        workers=[WorkerSpec("w0", engine.url, model="m")],
    )
    app = RouterApp(cfg)
    served = await Served(app).start()
    pool = app.state.tokenize_pool
    gate, ran, work = _blocker()
    long = {"model": "m", "prompt": "a long prompt " * 200, "max_tokens": 1}
    short = {"model": "m", "prompt": "short", "max_tokens": 1}
    try:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            holder = asyncio.create_task(pool.run(work, "held"))  # the pool's one place
            await until(lambda: ran == ["held"], what="the pool held")
            r = await http.post("/v1/completions", json=long)
            assert r.status_code == 429
            err = r.json()["error"]
            assert err["code"] == "tokenizer_busy" and err["type"] == "rate_limit_error"
            assert "retry later" in err["message"]
            r = await http.post("/v1/completions", json=short)  # tokenized inline
            assert r.status_code == 200
            metrics = (await http.get("/metrics")).text
            assert "cache_router_tokenize_held 1.0" in metrics
            assert 'kind="tokenizer_busy"' in metrics
            gate.set()
            await holder
            await until(lambda: pool.held == 0, what="the place freed")
            r = await http.post("/v1/completions", json=long)
            assert r.status_code == 200
    finally:
        gate.set()
        await served.stop()
        await engine.stop()
