"""Predicted hits against the engine's own count, through the real stack: mock engines
(vLLM's cache rules, ZMQ events) -> node agents -> nats-server -> the router.

Per request the router's prediction (``x-cache-router-hit-tokens``) must equal the
engine's ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import httpx
import pytest
from stack import BS, MODEL, MockStack, Replica, index_blocks, until

from router.config import WorkerSpec
from router.observe.audit import MIN_SAMPLES, HitAudit
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.scheduler import Timing

AUTH = {"authorization": "Bearer t"}


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[tuple[MockStack, Replica]]:
    mocks = await MockStack(nats_url).start(1)
    replica = await Replica(mocks.router_config("r0")).start()
    yield mocks, replica
    await replica.stop()
    await mocks.stop()


def caught_up(mocks: MockStack, replica: Replica) -> bool:
    """The replica applied every batch the agent has, and the engine's last batch reached
    the agent: the index holds what the engine holds (the agent's seq alone could lag the
    engine's ZMQ publish under load, and a prediction then missed a block)."""
    return mocks.synced(replica) and index_blocks(replica) == mocks.engine_blocks()


async def complete(http: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[int, int]:
    """(predicted, engine-reported) cached tokens of one request."""
    r = await http.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
    )
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(r.headers["x-cache-router-hit-tokens"]), cached


async def test_prompts_of_whole_blocks_never_count_their_last_block(
    stack: tuple[MockStack, Replica],
) -> None:
    mocks, replica = stack
    seen = []
    async with httpx.AsyncClient(timeout=10) as http:
        for n_tokens in (3 * BS, 3 * BS + 5, 4 * BS, 1):
            prompt = [1000 + n_tokens, *range(1, n_tokens)]
            for _ in range(2):
                seen.append((n_tokens, *await complete(http, replica.url, prompt)))
                await until(lambda: caught_up(mocks, replica), what="events applied")
    assert all(pred == cached for _, pred, cached in seen), seen
    # the repeat of an exact multiple hit all blocks but the one holding the last token
    assert (3 * BS, 2 * BS, 2 * BS) in seen and (3 * BS + 5, 3 * BS, 3 * BS) in seen


def test_the_audit_window_bound_and_warnings() -> None:
    seen = {"good": True, "blind": False}
    audit = HitAudit(0.25, lambda w: seen[w])
    for i in range(MIN_SAMPLES):
        audit.routed("good", 1)
        audit.record("good", 32 * (i % 3), 32 * (i % 3))  # exact
        audit.routed("blind", 1)
        audit.record("blind", 0, 64)  # the engine hits, the router never predicts
    snap = audit.snapshot()
    assert snap["good"]["divergence"] == 0.0 and snap["good"]["warnings"] == {}
    assert snap["blind"]["divergence"] == 1.0
    assert set(snap["blind"]["warnings"]) == {"divergence", "no_events"}
    assert snap["blind"]["mismatched_requests"] == MIN_SAMPLES
    for _ in range(MIN_SAMPLES):
        audit.record("quiet", 0, None)
    assert set(audit.warnings("quiet")) == {"no_usage"}


@pytest.fixture
async def half_blind(nats_url: str) -> AsyncIterator[tuple[MockStack, Replica]]:
    """Two engines behind a round-robin router: ``m0`` with its agent, ``lonely`` with
    none, so its events never arrive (as with vLLM's PUB socket on a non-wildcard endpoint)."""
    mocks = await MockStack(nats_url).start(1)
    lonely = await MockEngine(
        MockEngineConfig(worker_id="lonely", model=MODEL, block_size=BS, timing=Timing(speed=200.0))
    ).start()
    cfg = mocks.router_config("r0", policy="round_robin")
    cfg = dataclasses.replace(
        cfg, workers=[*cfg.workers, WorkerSpec("lonely", lonely.url, model=MODEL)]
    )
    replica = await Replica(cfg).start()
    yield mocks, replica
    await replica.stop()
    await lonely.stop()
    await mocks.stop()


async def test_a_worker_without_events_is_flagged_in_admin_and_metrics(
    half_blind: tuple[MockStack, Replica],
) -> None:
    """The audit says which worker's events never arrive, and the healthy one audits exact."""
    mocks, replica = half_blind
    async with httpx.AsyncClient(timeout=10) as http:
        prompt = [7, *range(1, 3 * BS + 5)]
        for _ in range(2 * MIN_SAMPLES + 2):
            await complete(http, replica.url, prompt)
            await until(lambda: mocks.synced(replica), what="events applied")
        index = (await http.get(replica.url + "/admin/index", headers=AUTH)).json()
        metrics = (await http.get(replica.url + "/metrics")).text
    audit = index["audit"]
    assert audit["m0"]["warnings"] == {} and audit["m0"]["divergence"] == 0.0
    assert audit["m0"]["reported_hit_tokens"] > 0
    assert set(audit["lonely"]["warnings"]) == {"divergence", "no_events"}
    assert not audit["lonely"]["events_seen"] and audit["lonely"]["predicted_hit_tokens"] == 0
    assert 'cache_router_audit_warning{kind="no_events",worker="lonely"} 1.0' in metrics
    assert 'cache_router_audit_divergence{worker="m0"} 0.0' in metrics
    assert set(index["loop"]) >= {"lag_max_s", "late_wakeups", "cpu_wait_s", "samples"}
    assert "cache_router_event_loop_lag_seconds_count" in metrics


async def test_doctor_names_what_is_wrong(half_blind: tuple[MockStack, Replica]) -> None:
    """With one healthy worker and one whose events never arrive, the doctor passes the
    first and fails the second, in text and JSON, with exit status 1."""
    from router.observe.doctor import Check, diagnose, render

    mocks, replica = half_blind
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(2 * MIN_SAMPLES + 2):
            await complete(http, replica.url, [9, *range(1, 3 * BS + 5)])
            await until(lambda: mocks.synced(replica), what="events applied")
    with httpx.Client(timeout=10) as sync_http:
        checks = await asyncio.to_thread(diagnose, sync_http, replica.url, "t")
    by = {(c.worker, c.name): c for c in checks}
    for name in ("events", "block_size", "tokenizer.completion", "tokenizer.chat", "hits"):
        assert by[("m0", name)].status == "ok", by[("m0", name)]
    assert by[("lonely", "events")].status == "fail"
    assert by[("lonely", "hits.no_events")].status == "fail"
    assert by[("lonely", "block_size")].status == "ok"  # it is the events, not the size
    assert "wake-up(s) over 50 ms late" in by[("-", "event_loop")].detail
    text = render(checks)
    assert "FAIL lonely" in text and "problem(s)" in text
    assert all(isinstance(c, Check) for c in checks)
