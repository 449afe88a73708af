"""The mock engine's ``--scheduling-policy`` as vLLM v1's scheduler has it.

vLLM (vllm/v1/core/sched/scheduler.py, request_queue.py): under ``priority`` the waiting
queue is ordered by (priority, arrival), lower first; under ``fcfs`` by arrival. With
``max_num_seqs`` requests running, the waiting loop stops whatever the priorities: an
urgent request waits for the next slot to free and never preempts a running one. Under
``fcfs`` a request naming a priority other than 0 is refused (400).

Order and codes only, never time.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from sim.cache import PrefixCache
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.scheduler import Scheduler, SchedulingPolicy, Sequence, Timing

BS = 4


def _seq(cache: PrefixCache, name: str, priority: int = 0, tokens: int = 3) -> Sequence:
    prompt = [hash(name) % 1000 + i for i in range(2 * BS)]
    return Sequence(
        prompt=prompt, hashes=cache.hash_blocks(prompt), max_tokens=tokens,
        pieces=["x"] * tokens, finish_reason="length", id=name, priority=priority,
    )  # fmt: skip


async def _run_order(policy: SchedulingPolicy) -> tuple[list[str], list[str]]:
    """One slot, held by ``first``; five more submitted while it runs. The order they
    start in, and the order every request's tokens came out in."""
    cache = PrefixCache(BS, 256)
    sched = Scheduler(
        cache, Timing(speed=1000.0), lambda events: None, max_num_seqs=1, policy=policy
    )
    task = asyncio.create_task(sched.run())
    started: list[str] = []
    pieces: list[str] = []

    async def drain(seq: Sequence) -> None:
        while (out := await seq.out.get()) is not None:
            if seq.id not in started:
                started.append(seq.id)
            pieces.extend(seq.id for _ in out)

    first = _seq(cache, "first", priority=5, tokens=6)
    drains = [asyncio.create_task(drain(first))]
    sched.submit(first)
    while not sched.running:
        await asyncio.sleep(0)
    assert not first.done
    later = [("low", 9), ("mid-a", 0), ("urgent-a", -3), ("mid-b", 0), ("urgent-b", -3)]
    for name, priority in later:
        seq = _seq(cache, name, priority)
        drains.append(asyncio.create_task(drain(seq)))
        sched.submit(seq)
    # while the slot is held, nothing starts, and the queue is in scheduling order
    assert [s.id for s in sched.running] == ["first"]
    waiting = [s.id for s in sched.waiting]
    await asyncio.wait_for(asyncio.gather(*drains), 30)
    task.cancel()
    assert waiting == started[1:]
    return started, pieces


async def test_priority_orders_the_waiting_queue_and_never_preempts_a_full_batch() -> None:
    started, pieces = await _run_order("priority")
    # lower first, arrival order within a priority
    assert started == ["first", "urgent-a", "urgent-b", "mid-a", "mid-b", "low"]
    # the least urgent request holding the only slot ran to its end before any urgent
    # request got a token: no preemption at max_num_seqs (vLLM issue 40004)
    assert pieces[:6] == ["first"] * 6


async def test_fcfs_keeps_arrival_order() -> None:
    started, pieces = await _run_order("fcfs")
    assert started == ["first", "low", "mid-a", "urgent-a", "mid-b", "urgent-b"]
    assert pieces[:6] == ["first"] * 6


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy"):
        Scheduler(PrefixCache(BS, 8), Timing(), lambda events: None, policy="lifo")  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_the_engine_takes_priority_only_under_priority_scheduling(policy: str) -> None:
    cfg = MockEngineConfig(model="m", timing=Timing(speed=1000.0), scheduling_policy=policy)  # type: ignore[arg-type]
    engine = MockEngine(cfg)
    await engine.start()
    try:
        async with httpx.AsyncClient(base_url=engine.url) as http:

            async def post(**extra: object) -> httpx.Response:
                body = {"model": "m", "prompt": "hello there", "max_tokens": 2, **extra}
                return await http.post("/v1/completions", json=body)

            assert (await post()).status_code == 200
            assert (await post(priority=0)).status_code == 200
            urgent = await post(priority=-10)
            bad = await post(priority="high")
            chat = await http.post(
                "/v1/chat/completions",
                json={"model": "m", "max_tokens": 2, "priority": 3,
                      "messages": [{"role": "user", "content": "hi"}]},
            )  # fmt: skip
    finally:
        await engine.stop()
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "priority"
    if policy == "priority":
        assert urgent.status_code == 200 and chat.status_code == 200
    else:
        assert urgent.status_code == 400 and chat.status_code == 400
        assert "Priority scheduling is not enabled" in urgent.json()["error"]["message"]
