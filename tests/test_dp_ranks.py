"""Data-parallel ranks (router/workers/dp.py): indexed, matched and routed per (worker, rank).

The end-to-end tests run the real stack: one mock engine with two ranks (each its own
cache and ZMQ publisher, like vLLM's DP engine cores), one node agent per rank, NATS,
the router. A prefix cached on rank r is matched for rank r only, and the request the
router sends there lands on rank r (the engine reports the hit).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from stack import BS, MODEL, EngineStack, hits, mock_engine_config, until

from policies.base import RouteRequest
from router.config import ConfigError, RouterConfig, WorkerSpec, worker_spec
from router.events.consumer import last_seq
from router.http.app import RouterState
from router.workers.dp import DP_HEADER, forward_rank, split_target, target_id, target_ids
from router.workers.load import EngineLoad
from router.workers.registry import WorkerRegistry
from sim.mock.engine import MockEngine, offset_endpoint

AUTH = {"authorization": "Bearer t"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
ROUTE = RouteRequest("r", MODEL, num_tokens=4, block_hashes=[], block_size=BS)
PROMPT = "Data-parallel ranks each keep their own KV cache, so a prefix lives on one. " * 4


# -- naming and forwarding ---------------------------------------------------------


def test_target_names_round_trip() -> None:
    assert target_ids("w", 1) == ["w"]
    assert target_ids("w", 3) == ["w-dp0", "w-dp1", "w-dp2"]
    for r in (0, 7, 12):
        assert split_target(target_id("a-dp2", r)) == ("a-dp2", r)
    assert split_target("plain") == ("plain", None)
    assert split_target("w-dp01") == ("w-dp01", None)  # not a name target_id makes
    assert split_target("-dp1") == ("-dp1", None)


def test_forward_rank_header_and_body_forms() -> None:
    headers = [(b"x-request-id", b"r1"), (DP_HEADER, b"9")]  # a client's own is replaced
    body = {"model": "m", "prompt": "p", "data_parallel_rank": 5}
    raw = orjson.dumps(body)
    assert forward_rank(headers, raw, body, None, "header") == (headers, raw)
    sent, out = forward_rank(headers, raw, body, 2, "header")
    assert sent == [(b"x-request-id", b"r1"), (DP_HEADER, b"2")] and out is raw
    sent, out = forward_rank(headers, raw, body, 3, "routed_dp_rank")
    assert sent == [(b"x-request-id", b"r1")]
    assert orjson.loads(out) == {"model": "m", "prompt": "p", "routed_dp_rank": 3}
    _, out = forward_rank(headers, raw, body, 1, "data_parallel_rank")
    assert orjson.loads(out)["data_parallel_rank"] == 1


def test_worker_spec_dp_fields_are_validated() -> None:
    spec = worker_spec(
        {"id": "e", "url": "http://h:1", "dp_size": 4, "dp_field": "routed_dp_rank"}, "t"
    )
    assert (spec.dp_size, spec.dp_field) == (4, "routed_dp_rank")
    for bad in ({"dp_size": 0}, {"dp_size": True}, {"dp_size": 1 << 20}, {"dp_field": "query"}):
        with pytest.raises(ConfigError):
            worker_spec({"id": "e", "url": "http://h:1", **bad}, "t")


def test_registry_targets_and_name_clashes() -> None:
    reg = WorkerRegistry(RouterConfig(block_size=BS))
    w = reg.add(WorkerSpec("e", "http://h:1", dp_size=2))
    assert w.targets == ["e-dp0", "e-dp1"]
    assert reg.target("e-dp1") == (w, 1) and reg.source("e-dp0") is w
    assert reg.target("e") is None and reg.source("e-dp2") is None
    assert sorted(reg.pools["default"].index.workers) == ["e-dp0", "e-dp1"]
    with pytest.raises(ValueError, match="taken"):
        reg.add(WorkerSpec("e-dp1", "http://h:2"))
    plain = reg.add(WorkerSpec("f", "http://h:3"))
    assert reg.target("f") == (plain, None) and plain.targets == ["f"]
    reg.add(WorkerSpec("g-dp1", "http://h:4"))
    with pytest.raises(ValueError, match="taken"):  # its rank 1 would be that worker
        reg.add(WorkerSpec("g", "http://h:5", dp_size=2))
    assert reg.get("g") is None
    reg.remove("e")
    assert reg.source("e-dp0") is None and "e-dp0" not in reg.pools["default"].index.workers


def test_views_count_each_rank_against_its_own_load() -> None:
    """Each rank's view carries that rank's own flights and its share of the engine's
    report (the views pair targets with loads once per worker, ``Worker.candidates``)."""
    cfg = RouterConfig(block_size=BS, workers=[
        WorkerSpec("e", "http://h:1", model=MODEL, dp_size=3),
        WorkerSpec("f", "http://h:2", model=MODEL),
    ])  # fmt: skip
    state = RouterState(cfg)
    e, f = state.registry.get("e"), state.registry.get("f")
    assert e is not None and f is not None
    e.rank_loads[1].begin(200)
    e.rank_loads[2].begin(0)
    f.load.begin(50)
    e.load.report(EngineLoad(running=7, waiting=2, kv_usage=0.5))
    parsed = state.router.parse("chat", orjson.dumps(CHAT), {})
    prep = state.router.prepared(parsed, state.registry.for_model(MODEL), ROUTE)
    views = {v.worker_id: v for v in state.router.views(prep, {"e-dp0"})}
    assert sorted(views) == ["e-dp1", "e-dp2", "f"]
    got = {t: (v.inflight_requests, v.inflight_prefill_tokens, v.running_prefill_tokens)
           for t, v in views.items()}  # fmt: skip
    assert got == {"e-dp1": (1, 200, 200), "e-dp2": (1, 0, 0), "f": (1, 50, 50)}
    assert (views["e-dp1"].engine_running, views["e-dp1"].engine_waiting) == (3, 1)
    assert views["f"].engine_running is None


def test_offset_endpoint_follows_vllm() -> None:
    assert offset_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert offset_endpoint("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"
    assert offset_endpoint(None, 1) is None


# -- end to end ----------------------------------------------------------------------


class DpStack(EngineStack):
    @property
    def engine(self) -> MockEngine:
        return self.engines["e0"]

    def synced(self) -> bool:
        """Every batch each rank published is applied by the router (through its agent)."""
        ingest = self.state.registry.pools["default"].ingest
        for rank, agent in zip(self.engine.ranks, self.agents, strict=True):
            assert rank.publisher is not None
            published = rank.publisher.seq - 1
            if published >= 0 and not (
                agent.core.last_seq == published == last_seq(ingest, agent.cfg.worker_id)
            ):
                return False
        return True


@pytest.fixture(params=["header", "routed_dp_rank"])
async def stack(request: Any, nats_url: str) -> AsyncIterator[DpStack]:
    s = DpStack(nats_url)
    try:
        # an agent per rank, named as its target
        engine = await s.add(mock_engine_config("e0", gpu_blocks=256, dp_size=2))
        dp_field = request.param
        await s.serve(
            RouterConfig(
                nats_url=nats_url,
                block_size=BS,
                admin_token="t",
                health_interval=0.2,
                predict_ttl=0,  # only the engines' own events say where a prefix is
                workers=[WorkerSpec("e0", engine.url, model=MODEL, dp_size=2, dp_field=dp_field)],
            )
        )
        yield s
    finally:
        await s.stop()


async def test_prefix_on_one_rank_is_matched_and_routed_there(stack: DpStack) -> None:
    assert stack.served is not None
    async with httpx.AsyncClient(base_url=stack.served.url, timeout=30) as http:
        first, predicted, cached = await hits(http, PROMPT + "first question")
        assert first in ("e0-dp0", "e0-dp1") and predicted == cached == 0
        rank = int(first[-1])
        other = 1 - rank
        # the engine ran it on the rank the router named, and only that rank holds it
        assert stack.engine.ranks[rank].scheduler.prompt_tokens > 0
        assert stack.engine.ranks[other].scheduler.prompt_tokens == 0
        assert not stack.engine.ranks[other].cache.gpu_hashes()
        await until(stack.synced, what="both ranks' events through their agents")

        explain = await http.post(
            "/admin/explain",
            headers=AUTH,
            json={"model": MODEL, "prompt": PROMPT + "second question"},
        )
        body = explain.json()
        rows = {w["worker_id"]: w for w in body["workers"]}
        assert set(rows) == {"e0-dp0", "e0-dp1"}
        assert rows[first]["dp_rank"] == rank and rows[first]["worker"] == "e0"
        assert rows[first]["match"]["total"] > 0
        assert rows[f"e0-dp{other}"]["match"]["total"] == 0  # no hit promised on the other rank
        assert body["decision"] == {**body["decision"], "worker": "e0", "dp_rank": rank}

        again, predicted, cached = await hits(http, PROMPT + "second question")
        assert again == first
        assert predicted == cached > 0  # the engine delivered exactly the predicted hit
        assert stack.engine.ranks[other].scheduler.prompt_tokens == 0

        metrics = (await http.get("/metrics")).text
        assert f'worker="{first}"' in metrics


async def test_each_rank_matches_only_its_own_prefix(stack: DpStack) -> None:
    """Two prefixes placed directly on the two ranks (the engine's own header): each
    request follows its prefix to its rank, and the engine reports the hit there."""
    assert stack.served is not None
    prompts = {r: f"rank {r} owns this prefix. " * 12 for r in (0, 1)}
    async with httpx.AsyncClient(base_url=stack.engine.url, timeout=30) as engine:
        for r, p in prompts.items():
            resp = await engine.post(
                "/v1/completions",
                headers={"X-data-parallel-rank": str(r)},
                json={"model": MODEL, "prompt": p, "max_tokens": 1},
            )
            assert resp.status_code == 200
        bad = await engine.post(
            "/v1/completions",
            headers={"X-data-parallel-rank": "2"},
            json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        )
        assert bad.status_code == 400
    await until(stack.synced, what="both ranks' events through their agents")
    index = stack.app.state.registry.pools["default"].index
    assert index.workers and set(index.workers) == {"e0-dp0", "e0-dp1"}
    async with httpx.AsyncClient(base_url=stack.served.url, timeout=30) as http:
        for r, p in prompts.items():
            body = {"model": MODEL, "prompt": p + " and a follow-up"}
            why = (await http.post("/admin/explain", headers=AUTH, json=body)).json()
            target, predicted, cached = await hits(http, p + " and a follow-up")
            assert target == f"e0-dp{r}", why
            assert predicted == cached > 0, why
