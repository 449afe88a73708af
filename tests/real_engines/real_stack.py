"""The router side of the real-engine tests: node agents, the router, and a checker that
sends each request with the official ``openai`` client and compares the router's
prediction with what vLLM reports."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
from stack import Served, until
from vllm_engine import BLOCK, MODEL, Engine

from agent.node import AgentConfig, NodeAgent
from router.config import RouterConfig, WorkerSpec
from router.events.consumer import last_seq
from router.http.app import RouterApp
from router.tokens.tokenize import HFTokenizer


@dataclass
class Feed:
    """One agent's engine side: a target id and the rank's endpoints."""

    target: str
    engine: Engine
    rank: int = 0


class Stack:
    """Agents (one per engine rank), the router in front of the engines, a checker."""

    def __init__(
        self,
        feeds: list[Feed],
        workers: list[WorkerSpec],
        model_dir: Path,
        nats_url: str,
        transport: str = "auto",
    ) -> None:
        self.feeds = feeds
        self.agents = [
            NodeAgent(
                AgentConfig(
                    worker_id=f.target,
                    zmq_endpoint=f.engine.events_of(f.rank),
                    replay_endpoint=f.engine.replay_of(f.rank),
                    engine_url=f.engine.url,
                    nats_url=nats_url,
                    load_interval=0.5,
                    replay_timeout=2.0,
                )
            )
            for f in feeds
        ]
        cfg = RouterConfig(
            nats_url=nats_url,
            block_size=BLOCK,
            tokenizer=str(model_dir),
            admin_token="t",
            events_transport=transport,  # "core": the native event reader (events_reader auto)
            health_interval=3600.0,  # a restart must go unseen by health checks
            workers=workers,
        )
        self.app = RouterApp(cfg)
        self.model_dir = model_dir
        self.served: Served | None = None
        self.check: Checker | None = None

    @property
    def pool(self) -> Any:
        return self.app.state.registry.pools["default"]

    def agent(self, target: str) -> NodeAgent:
        return next(a for a in self.agents if a.cfg.worker_id == target)

    def blocks(self, target: str) -> int:
        return sum(self.pool.index.stats().workers.get(target, {}).values())

    async def start(self, models: list[str]) -> Checker:
        for a in self.agents:
            await a.start()
        self.served = await Served(self.app).start()
        state = self.app.state
        await until(lambda: state.bus.connected, timeout=30, what="router on NATS")
        await until(
            lambda: all(a.engine_connected for a in self.agents), timeout=60, what="agents on vLLM"
        )
        for m in models:  # the router learns them from each engine's /v1/models
            n = len({f.engine.name for f in self.feeds})
            await until(lambda m=m, n=n: len(state.registry.for_model(m)) == n, timeout=60, what=m)
        engines = {f.target: f.engine for f in self.feeds}
        self.check = Checker(self.served.url, engines, HFTokenizer(self.model_dir))
        return self.check

    def synced(self) -> bool:
        return all(
            a.core.last_seq is None
            or last_seq(self.pool.ingest, a.cfg.worker_id) == a.core.last_seq
            for a in self.agents
        )

    async def settle(self) -> None:
        await asyncio.sleep(0.3)  # vLLM publishes a step's events after its output
        await until(self.synced, timeout=30, what="router applied every batch")

    async def finish(self, name: str, out: Path) -> dict[str, Any] | None:
        """The checker's summary (None if it never started), then everything stopped."""
        try:
            return self.check.summary(name, out) if self.check is not None else None
        finally:
            await self.stop()

    async def stop(self) -> None:
        if self.check is not None:
            await self.check.close()
        if self.served is not None:
            await self.served.stop()
        for a in self.agents:
            await a.stop()


class Checker:
    """Sends requests through the router; one row per request: predicted hit tokens
    (``x-cache-router-hit-tokens``) against vLLM's ``cached_tokens``, the router's token
    ids against vLLM's ``/tokenize`` of the same body."""

    def __init__(self, router_url: str, engines: dict[str, Engine], tok: HFTokenizer) -> None:
        self.client = openai.AsyncOpenAI(base_url=router_url + "/v1", api_key="x", max_retries=0)
        self.engines = engines  # by the target the router names
        self.tok = tok
        self.rows: list[dict[str, Any]] = []
        self.http = httpx.AsyncClient(timeout=60)

    async def router_tokens(self, kind: str, body: dict[str, Any]) -> list[int]:
        if kind == "chat":
            ids, _ = self.tok.chat(body)
        else:
            ids, _ = self.tok.completion(body["prompt"], True)
        return list(ids)

    async def engine_tokens(self, target: str, kind: str, body: dict[str, Any]) -> list[int]:
        if kind == "completion" and isinstance(body["prompt"], list):
            return list(body["prompt"])  # token ids go to the engine as they are
        req: dict[str, Any] = {"model": body["model"]}
        if kind == "chat":
            req.update(messages=body["messages"], add_generation_prompt=True)
        else:
            req["prompt"] = body["prompt"]
        r = await self.http.post(self.engines[target].url + "/tokenize", json=req)
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
        target = raw.headers["x-cache-router-worker"]
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
        theirs = await self.engine_tokens(target, kind, full)
        row = {
            "label": label,
            "worker": target,
            "prompt_tokens": usage.prompt_tokens,
            "predicted": predicted,
            "cached": cached,
            "hits_equal": predicted == cached,
            "tokens_equal": mine == theirs and len(mine) == usage.prompt_tokens,
        }
        self.rows.append(row)
        return row

    def summary(self, name: str, out: Path) -> dict[str, Any]:
        """Printed (``REAL_ENGINES <name> {...}``) and written with every row to ``out``."""
        rows = self.rows
        summary = {
            "requests": len(rows),
            "hits_equal": sum(r["hits_equal"] for r in rows),
            "tokens_equal": sum(r["tokens_equal"] for r in rows),
            "predicted_tokens": sum(r["predicted"] for r in rows),
            "cached_tokens": sum(r["cached"] or 0 for r in rows),
            "mismatches": [r for r in rows if not (r["hits_equal"] and r["tokens_equal"])],
        }
        print(f"REAL_ENGINES {name} " + json.dumps(summary))
        out.write_text(json.dumps(rows))
        return summary

    async def close(self) -> None:
        await self.http.aclose()
        await self.client.close()


def long_prompt(i: int, n_words: int) -> str:
    return f"document {i}: " + " ".join(f"w{i}x{j}" for j in range(n_words))
