"""A multi-turn, multi-session chat workload driven through any OpenAI endpoint.

Every session shares one system prompt, has its own long context document, and asks
``turns`` questions in sequence, appending each answer, the way a chat UI or an agent
loop does. That is the traffic a cache-aware router exists for: the shared prefix and
each session's growing history are cacheable, but only where they were computed.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import openai
from openai.types.chat import ChatCompletionMessageParam

SYSTEM = (
    "You are the support assistant of a company that runs GPU inference fleets. "
    "Answer precisely, cite the relevant section of the document, keep it short. "
) * 12
_WORDS = (
    "cache",
    "prefix",
    "block",
    "engine",
    "router",
    "token",
    "latency",
    "queue",
    "worker",
    "replica",
    "session",
    "eviction",
    "prefill",
    "decode",
    "batch",
    "stream",
)


@dataclass
class TurnResult:
    session: int
    turn: int
    worker: str
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float


@dataclass
class WorkloadReport:
    results: list[TurnResult] = field(default_factory=list)
    errors: int = 0

    def summary(self) -> dict[str, float | int]:
        prompt = sum(r.prompt_tokens for r in self.results)
        cached = sum(r.cached_tokens for r in self.results)
        ttft = sorted(r.ttft_ms for r in self.results)
        per_worker: dict[str, int] = {}
        for r in self.results:
            per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
        return {
            "requests": len(self.results),
            "errors": self.errors,
            "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50_ms": _pct(ttft, 0.5),
            "ttft_p90_ms": _pct(ttft, 0.9),
            "ttft_mean_ms": statistics.fmean(ttft) if ttft else 0.0,
            "max_worker_share": max(per_worker.values()) / len(self.results)
            if self.results
            else 0.0,
        }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


def _document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def _session(
    client: openai.AsyncOpenAI,
    model: str,
    session: int,
    turns: int,
    doc_words: int,
    max_tokens: int,
    seed: int,
    report: WorkloadReport,
) -> None:
    rng = random.Random(seed * 1_000_003 + session)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Document {session}:\n{_document(rng, doc_words)}"},
        {"role": "assistant", "content": "Read it. Ask away."},
    ]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Q{turn}: {_document(rng, 24)}?"})
        start = time.perf_counter()
        first: float | None = None
        text, usage = "", None
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=model,
                messages=messages,
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                user=f"session-{session}",
            )
            worker = raw.headers.get("x-cache-router-worker", "?")
            async for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter()
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    usage = chunk.usage
        except openai.OpenAIError:
            report.errors += 1
            return
        if usage is None or first is None:
            report.errors += 1
            return
        details = usage.prompt_tokens_details
        report.results.append(
            TurnResult(
                session=session,
                turn=turn,
                worker=worker,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=(details.cached_tokens or 0) if details else 0,
                ttft_ms=(first - start) * 1000,
            )
        )
        messages.append({"role": "assistant", "content": text})


async def run_workload(
    base_url: str,
    model: str,
    *,
    sessions: int,
    turns: int,
    doc_words: int = 400,
    max_tokens: int = 16,
    concurrency: int = 16,
    seed: int = 0,
) -> WorkloadReport:
    """Run every session (at most ``concurrency`` at once); sessions start staggered."""
    report = WorkloadReport()
    client = openai.AsyncOpenAI(base_url=base_url, api_key="demo", max_retries=0, timeout=60)
    gate = asyncio.Semaphore(concurrency)

    async def one(session: int) -> None:
        async with gate:
            await _session(client, model, session, turns, doc_words, max_tokens, seed, report)

    try:
        await asyncio.gather(*(one(s) for s in range(sessions)))
    finally:
        await client.close()
    return report
