"""A chat tokenized once, measured on a real vLLM: the engine's CPU per chat turn and the
client's TTFT with the router sending chats as token ids (``chat_tokens_in``, the
default where the engine takes them) and as chats (off), on conversations growing to a
few thousand tokens (issue 35 item 3). ``--api responses``: the same conversations as
Responses requests (``instructions`` and ``input`` items, ``store: false``), sent as ids
(router.forward.responses_out) or as they came; TTFT is then the time to the first
``response.output_text.delta`` (vLLM sends ``response.created`` before any work).

One vLLM CPU engine (the real-engine tests' tiny Llama, ``--enable-scale-out``, 16K
tokens of KV cache so no conversation is evicted) and two routers in this process in
front of it, one per way. Each conversation grows ``--turns`` turns of ``--user-words``
new words each (plus the 16 tokens answered), streamed at temperature 0; the two ways
alternate conversation by conversation, each on its own text, so both see the same cache
pattern (each turn hits its conversation's previous turns). Per turn: the engine's CPU
(psutil: its API server process, where a chat is rendered and tokenized, and its whole
process tree) and the client's time to the first streamed event. One JSON object out.

    flock /tmp/cpu-heavy.lock python3 bench/tokens_in.py [--api responses] \\
        --vllm-python /tmp/cache-router-vllm-venv/bin/python   # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "real_engines"))

from stack import Served  # noqa: E402
from vllm_engine import BLOCK, MODEL, Engine, running  # noqa: E402

from router.config import RouterConfig, WorkerSpec  # noqa: E402
from router.http.app import RouterApp  # noqa: E402

WORDS = [
    "cache",
    "router",
    "engine",
    "block",
    "prefix",
    "token",
    "turn",
    "answer",
    "question",
    "user",
    "system",
    "model",
    "queue",
    "batch",
    "prefill",
    "decode",
    "latency",
    "memory",
    "page",
    "hash",
    "index",
    "policy",
    "worker",
]


def cpu(proc: psutil.Process) -> tuple[float, float]:
    """CPU seconds of the API server process, and of its whole tree."""
    own = proc.cpu_times()
    front = own.user + own.system
    total = front
    for child in proc.children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return front, total


def sent(app: RouterApp) -> float:
    """Chats the router sent as token ids (``cache_router_tokens_in{outcome="sent"}``)."""
    for metric in app.state.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "cache_router_tokens_in_total" and s.labels["outcome"] == "sent":
                return s.value
    return 0.0


def text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 13 + i // 5) % len(WORDS)] for i in range(n))


async def turn(
    http: httpx.AsyncClient, url: str, messages: list[dict[str, str]], proc: psutil.Process
) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    f0, t0 = cpu(proc)
    start = time.perf_counter()
    ttft = None
    reply: list[str] = []
    usage: dict[str, Any] = {}
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            for c in obj.get("choices") or ():
                reply.append(c["delta"].get("content") or "")
            usage = obj.get("usage") or usage
    f1, t1 = cpu(proc)
    messages.append({"role": "assistant", "content": "".join(reply)})
    return {
        "ttft_ms": (ttft or 0.0) * 1000,
        "engine_front_cpu_ms": (f1 - f0) * 1000,
        "engine_cpu_ms": (t1 - t0) * 1000,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    }


async def responses_turn(
    http: httpx.AsyncClient, url: str, messages: list[dict[str, str]], proc: psutil.Process
) -> dict[str, Any]:
    """One Responses turn: the system message as ``instructions``, the rest as items."""
    body = {"model": MODEL, "instructions": messages[0]["content"], "input": messages[1:],
            "max_output_tokens": 16, "temperature": 0, "stream": True, "store": False}  # fmt: skip
    f0, t0 = cpu(proc)
    start = time.perf_counter()
    ttft = None
    reply: list[str] = []
    usage: dict[str, Any] = {}
    async with http.stream("POST", url + "/v1/responses", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            obj = json.loads(line[6:])
            if obj["type"] == "response.output_text.delta":
                if ttft is None:
                    ttft = time.perf_counter() - start
                reply.append(obj["delta"])
            elif obj["type"] == "response.completed":
                usage = obj["response"]["usage"]
    f1, t1 = cpu(proc)
    messages.append({"role": "assistant", "content": "".join(reply)})
    return {
        "ttft_ms": (ttft or 0.0) * 1000,
        "engine_front_cpu_ms": (f1 - f0) * 1000,
        "engine_cpu_ms": (t1 - t0) * 1000,
        "prompt_tokens": usage.get("input_tokens"),
        "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens"),
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def q(key: str, p: float) -> float:
        values = sorted(r[key] for r in rows)
        return round(values[min(len(values) - 1, int(p * len(values)))], 2)

    def mean(key: str) -> float:
        return round(statistics.fmean(r[key] for r in rows), 2)

    return {
        "turns": len(rows),
        "engine_front_cpu_ms_mean": mean("engine_front_cpu_ms"),
        "engine_cpu_ms_mean": mean("engine_cpu_ms"),
        "ttft_ms_p50": q("ttft_ms", 0.5),
        "ttft_ms_p90": q("ttft_ms", 0.9),
        "prompt_tokens_max": max(r["prompt_tokens"] or 0 for r in rows),
    }  # fmt: skip


async def run(args: argparse.Namespace, engine: Engine, model_dir: Path) -> dict[str, Any]:
    assert engine.proc is not None
    proc = psutil.Process(engine.proc.pid)
    routers: dict[str, tuple[RouterApp, Served]] = {}
    other = args.api  # the way as the client sent it: "chat" or "responses"
    ask = turn if other == "chat" else responses_turn
    for name, on in (("tokens_in", True), (other, False)):
        cfg = RouterConfig(block_size=BLOCK, tokenizer=str(model_dir), chat_tokens_in=on,
                           workers=[WorkerSpec(engine.name, engine.url, model=MODEL)])  # fmt: skip
        app = RouterApp(cfg)
        routers[name] = (app, await Served(app).start())
    rows: dict[str, list[dict[str, Any]]] = {"tokens_in": [], other: []}
    async with httpx.AsyncClient(timeout=300) as http:
        warm = [{"role": "system", "content": "warm"}, {"role": "user", "content": "warm up"}]
        for _ in range(100):  # the tokens-in router's probe
            await ask(http, routers["tokens_in"][1].url, list(warm), proc)
            if sent(routers["tokens_in"][0]):
                break
            await asyncio.sleep(0.2)
        for conv in range(args.conversations):
            order = ["tokens_in", other] if conv % 2 == 0 else [other, "tokens_in"]
            for way in order:
                seed = conv * 2 + (way == other)
                messages = [{"role": "system", "content": text(seed + 1000, 40)}]
                for t in range(args.turns):
                    messages.append(
                        {"role": "user", "content": text(seed * 31 + t, args.user_words)}
                    )
                    row = await ask(http, routers[way][1].url, messages, proc)
                    row.update(conversation=conv, turn=t)
                    rows[way].append(row)
    as_ids = sent(routers["tokens_in"][0])
    for _, served in routers.values():
        await served.stop()
    out: dict[str, Any] = {w: summary(r) for w, r in rows.items()}
    # the turns past half the conversation, where the conversation is long
    late = {w: summary([x for x in r if x["turn"] >= args.turns // 2]) for w, r in rows.items()}
    out["late_turns"] = late
    out["tokens_in_sent"] = as_ids
    out["per_turn"] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--vllm-python", default="/tmp/cache-router-vllm-venv/bin/python")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-words", type=int, default=300)
    ap.add_argument("--out", default="")
    ap.add_argument("--api", choices=("chat", "responses"), default="chat")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokens-in-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        subprocess.run([args.vllm_python, str(ROOT / "tests/real_engines/make_model.py"),
                        str(model_dir)], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
        extra = ("--enable-scale-out", "--max-model-len", "4096")  # the model's positions
        engine = Engine("b0", args.vllm_python, model_dir, work, env, extra=extra, gpu_blocks=512)
        with running([engine]):
            result = asyncio.run(run(args, engine, model_dir))
    vllm = [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"]
    commit = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
    result["versions"] = {
        "vllm": subprocess.run(vllm, capture_output=True, text=True).stdout.strip(),
        "cache_router": subprocess.run(commit, capture_output=True, text=True).stdout.strip(),
    }
    result["config"] = vars(args)
    text_out = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text_out)
    summary_only = {k: v for k, v in result.items() if k != "per_turn"}
    print(json.dumps(summary_only, indent=1))


if __name__ == "__main__":
    main()
