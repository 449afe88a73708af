"""The router's own cost on the HTTP path at real prompt lengths, side by side in one run.

cache-router (``router.cli serve`` with a real tokenizer), SGLang's router
(``sglang_router.launch_router --policy cache_aware``) and ``vllm-router --policy
cache_aware`` each stand in turn in front of the same canned engine (bench/proxy.py's
raw HTTP/1.1 server, one process listening on up to 16 ports, so the engine is never
the bottleneck); ``direct`` is the engine alone. Phases, all printed as one JSON object:

- ``lengths``: cold chat and completions prompts of 100, 2K, 8K, 32K, 128K tokens (each
  request's text distinct), concurrency 1, 4 workers: router CPU per request (the
  router's threads' ``schedstat`` run time, nanoseconds, over its process tree) and the
  p50/p99 it adds to ``direct``; ``tokenizer_cpu_ms`` is this process encoding the same
  chat text once, the floor for a router that tokenizes;
- ``multi_turn``: one conversation growing by ~1K tokens a turn to 32K, the whole
  conversation sent each turn (``--multi-turn-only``: the targets in turn with it, then
  in the reverse order with a second conversation, the two passes averaged and kept in
  ``multi_turn_passes``);
- ``shared_prefix`` (``--shared-prefix-only``): agent-shaped chats as aiperf replays them,
  one user message a request: 4 sessions, each a ~1K-token text every session shares (a
  system prompt, tool definitions) and its own history growing by ~1K tokens a turn to
  ~9K, every session's turns in turn (cache-router's conversation prefix cache needs
  special tokens inside the text to reuse anything; its segment cache's word cuts do
  not); the router's CPU per turn as ``multi_turn`` measures it, two passes in opposite
  orders;
- ``interference``: short chat requests' p99 alone, then while a second client sends
  cold 128K-token chat prompts back to back (24 texts cycled, each request led by a
  number of its own); only answers with status 200 are timed, the others counted
  (``--interference-only``: this phase alone, ``--repeat`` times, and the spread of
  busy / idle p99);
- ``saturation``: short chat requests at concurrency 32 through 1, 4 and 16 workers:
  requests/s and the router's CPU per request (``--saturation-only``: this phase alone);
- ``e2e_shape`` (``--e2e-shape-only --slice FILE [--slice FILE ...]``): bench/e2e.py's
  requests without its engines: each slice's chat bodies as aiperf sends them (one user
  message, streaming with ``include_usage``, ``max_completion_tokens``, ``ignore_eos``),
  replayed on their own schedule (``ts`` in ms, divided by ``--speedup``) against a
  canned engine that streams like vLLM (the first token after ``--engine-ttft-ms``, one
  chunk a token ``--engine-itl-ms`` apart, the usage chunk, ``[DONE]``), each target
  started fresh for each replay and given no warm-up (bench/e2e.py starts a router per
  run), with the e2e's router settings (``--tokenizer`` the e2e's model directory:
  its ``tokenizer.json`` and chat template; ``--block-size 32``). CPU per request is the
  router's over the replay less its idle rate, as bench/e2e.py reports it. ``--rounds``
  replays, the targets' order reversed every other one. A slice file holds one JSON
  object a line, ``{"ts": ms, "body": {...}}``; ``--aiperf-dataset DIR`` writes one
  from aiperf's dataset cache (``~/.cache/aiperf/dataset_mmap/<key>``) and exits;
- ``idle_cpu_ms_per_s``: what the router burns with no request (health checks, load
  scrapes); it is inside every per-request CPU figure, amortized over the requests;
- ``cache_router_no_forecast_no_prefix_cache``: that with ``prefix_cache_mb = 0`` too, to
  show what the conversation prefix cache (router/tokens/prefix_cache.py) saves (``ratios``:
  ``multi_turn_cpu_prefix_cache_on_over_off``);
- ``cache_router_no_forecast``: cache-router with ``forecast_tracked = 0``, to show what
  the online capacity forecast (index/capacity.py: native stacks on a thread of its own,
  router/observe/capacity.py) costs per request.
- ``cache_router_2_processes`` (``--processes N``, default 2; 1: not run): cache-router
  with ``--processes N`` (router/http/processes.py: N routers on the port with SO_REUSEPORT,
  replicas over a nats-server the bench starts); its CPU is every process's, summed, and
  ``requests_by_process_*`` is how the kernel spread the 32 connections.

The tokenizer is the given ``tokenizer.json`` (Llama's SentencePiece BPE from
tests/real_engines/make_model.py) with ``<|im_start|>``/``<|im_end|>`` added as special
tokens and a ChatML template, written to a temporary directory for cache-router; the
peers route on text and are given no tokenizer (their cache_aware policies need none).

    flock /work/bench.lock nice -n 5 python bench/hotpath.py \\
        --tokenizer /tmp/tinymodel/tokenizer.json [--peers-python /work/venv-peers/bin/python]
        [--saturation-only | --multi-turn-only | --interference-only [--repeat N]]

The machine is shared: compare ratios within one run, and read ``load_average_1m``.
Never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import orjson
from proxy import (  # puts ROOT on sys.path for router.*
    ROOT,
    _EngineProtocol,
    _read_response,
    _read_timed,
    _requests,
    process,
    wait_http,
)

from sim.mock.natsd import EmbeddedNats, free_ports

LENGTHS = (100, 2048, 8192, 32768, 131072)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SETTLE_S = 0.5  # longer than the forecast's POLL_S (0.1 s) and one drain
_UNIQUE = itertools.count()  # leads every long prompt: none is ever seen twice (cold)
WORDS = ("cache", "router", "engine", "prefix", "token", "block", "hash", "worker", "latency")


# -- the engine: bench/proxy.py's canned server on several ports ---------------------------


def run_engine(ports: list[int], protocol: type[asyncio.Protocol] = _EngineProtocol) -> None:
    import uvloop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(protocol, "127.0.0.1", p, backlog=4096) for p in ports]
        await asyncio.gather(*(s.serve_forever() for s in servers))

    uvloop.run(serve())


# -- CPU of a process tree, in nanoseconds ---------------------------------------------------


def _tree(pid: int) -> list[int]:
    """The descendants of ``pid`` (not ``pid`` itself: until session 5 it was listed twice,
    with itself, so every CPU figure of a one-process router read double)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rfind(")") + 2 :].split()[1])
    out = []
    for p in parents:
        q = p
        while q and q != pid:
            q = parents.get(q, 0)
        if q == pid and p != pid:
            out.append(p)
    return out


def cpu_ns(pids: list[int]) -> int:
    """Run time of every live thread of ``pids`` and of every process below the first one
    now (schedstat: ns, not 10 ms ticks). Below it now: cache-router starts its tokenizer
    processes at its first prompt of 64K characters, after ``started`` listed its tree, and
    until session 11 their CPU was left out (a cold 128K-token chat read ~6 ms, not ~200)."""
    total = 0
    for pid in {*pids, *_tree(pids[0])} if pids else ():
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total


# -- requests --------------------------------------------------------------------------------


class Texts:
    """Distinct word salad of about ``n`` tokens, calibrated once on the tokenizer."""

    def __init__(self, tok: Any, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        sample = self.words(3000)
        self.tokens_per_word = len(tok.encode(sample, add_special_tokens=False).ids) / 3000

    def words(self, n: int) -> str:
        r = self.rng
        return " ".join(f"{r.choice(WORDS)}{r.randrange(100_000)}" for _ in range(n))

    def of(self, tokens: int) -> str:
        return self.words(max(1, round(tokens / self.tokens_per_word)))


def http(path: str, body: dict[str, Any], session: str | None = None) -> bytes:
    raw = orjson.dumps(body)
    extra = f"x-session-id: {session}\r\n" if session else ""
    head = (
        f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n{extra}"
        f"content-length: {len(raw)}\r\n\r\n"
    )
    return head.encode() + raw


def chat(text: str) -> bytes:
    body = {"model": "bench", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    return http("/v1/chat/completions", body)


def completion(text: str) -> bytes:
    return http("/v1/completions", {"model": "bench", "prompt": text, "max_tokens": 1})


async def sequential(port: int, requests: list[bytes]) -> tuple[list[float], int]:
    """Latencies (s) of ``requests`` one at a time on one keep-alive connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
    out, errors = [], 0
    try:
        for req in requests:
            t0 = time.perf_counter()
            writer.write(req)
            if await _read_response(reader) != 200:
                errors += 1
            out.append(time.perf_counter() - t0)
    finally:
        writer.close()
    return out, errors


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q / 100))]


# -- phases ----------------------------------------------------------------------------------


def phase_lengths(
    targets: dict[str, Running],
    bodies: dict[str, dict[int, list[bytes]]],
    floor: dict[int, str],
    tok: Any,
) -> dict[str, dict[str, Any]]:
    """Per kind and length, every target in turn (adjacent in time: the machine's load
    drifts), and the tokenizer alone on the same chat text just before them."""
    out: dict[str, dict[str, Any]] = {name: {} for name in targets}
    out["tokenizer_alone"] = {}
    out["tokenizer_alone_fast"] = {}
    for kind, by_length in bodies.items():
        for n, reqs in by_length.items():
            if kind == "chat":
                c0 = time.process_time()
                tok.encode(floor[n], add_special_tokens=False)
                out["tokenizer_alone"][str(n)] = (time.process_time() - c0) * 1e3
                # the same without offsets, as cache-router encodes (encode_batch_fast)
                c0 = time.process_time()
                tok.encode_batch_fast([floor[n]], add_special_tokens=False)
                out["tokenizer_alone_fast"][str(n)] = (time.process_time() - c0) * 1e3
            for name, run in targets.items():
                c0 = cpu_ns(run.pids)
                lat, errors = asyncio.run(sequential(run.port, reqs))
                cpu = (cpu_ns(run.pids) - c0) / len(reqs) / 1e6 if run.pids else None
                out[name][f"{kind}_{n}"] = {
                    "requests": len(reqs),
                    "errors": errors,
                    "cpu_ms_per_request": cpu,
                    "p50_ms": pct(lat, 50) * 1e3,
                    "p99_ms": pct(lat, 99) * 1e3,
                }
    return out


def phase_multi_turn(port: int, pids: list[int], turns: list[bytes]) -> dict[str, Any]:
    """Each turn's CPU in its own window; and the ``_settled`` figures: the router's
    CPU from the first turn (and from the fourth last, after a pause that lets the
    forecast's queue drain) to 0.5 s past the last, less its idle rate, per turn. The
    forecast analyses off the request path, every ``POLL_S``: its CPU lands in whichever
    turn's window a drain falls in, or between turns (32 vs 6 ms in two runs of session 5)."""
    cpu: list[float] = []
    lat: list[float] = []
    errors = 0
    marks: dict[int, tuple[int, float]] = {}  # turn -> (router CPU ns, wall) before it
    last = slice(-4, None)
    n_last = len(turns[last])

    async def run() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
        try:
            marks[0] = (cpu_ns(pids), time.perf_counter())
            for i, req in enumerate(turns):
                if i == len(turns) - n_last:
                    await asyncio.sleep(SETTLE_S)
                    marks[i] = (cpu_ns(pids), time.perf_counter())
                c0 = cpu_ns(pids)
                t0 = time.perf_counter()
                writer.write(req)
                if await _read_response(reader) != 200:
                    errors += 1
                lat.append(time.perf_counter() - t0)
                cpu.append((cpu_ns(pids) - c0) / 1e6)
            await asyncio.sleep(SETTLE_S)
            marks[len(turns)] = (cpu_ns(pids), time.perf_counter())
        finally:
            writer.close()

    asyncio.run(run())
    settled: dict[str, float] = {}
    idle = 0.0  # router ns of CPU per second of wall once idle, warmed up and drained
    if pids:
        c0, t0 = cpu_ns(pids), time.perf_counter()
        time.sleep(SETTLE_S)
        idle = (cpu_ns(pids) - c0) / (time.perf_counter() - t0)
        c_end, t_end = marks[len(turns)]
        for key, start, count in (
            ("cpu_ms_per_turn_mean_settled", 0, len(turns)),
            ("cpu_ms_last_4_turns_settled", len(turns) - n_last, n_last),
        ):
            c0, t0 = marks[start]  # idle CPU over the whole wall time, pauses included
            settled[key] = (c_end - c0 - idle * (t_end - t0)) / count / 1e6
    return {
        "turns": len(turns),
        "errors": errors,
        "cpu_ms_per_turn_mean": statistics.mean(cpu) if pids else None,
        "cpu_ms_last_4_turns": statistics.mean(cpu[last]) if pids else None,
        **settled,
        "idle_cpu_ms_per_s": idle / 1e6,
        "p50_ms": pct(lat, 50) * 1e3,
        "last_4_turns_ms": statistics.mean(lat[last]) * 1e3,
    }


def conversation(texts: Texts, target: int, session: str) -> tuple[list[bytes], int]:
    """A chat growing by ~1K tokens a turn (a user message, then the answer the next turn
    carries) to ``target``: each turn's request, and the tokens it ends at, about."""
    messages: list[dict[str, str]] = [{"role": "system", "content": texts.of(512)}]
    turns, turn_tokens = [], 512
    while turn_tokens < target:
        messages.append({"role": "user", "content": texts.of(512)})
        body = {"model": "bench", "messages": list(messages), "max_tokens": 1}
        turns.append(http("/v1/chat/completions", body, session=session))
        messages.append({"role": "assistant", "content": texts.of(512)})
        turn_tokens += 1024
    return turns, turn_tokens


def agent_turns(texts: Texts, target: int, sessions: int = 4) -> list[bytes]:
    """``sessions`` agents' requests (see ``shared_prefix`` in the module docstring), each
    the whole text so far in one user message, as a trace replay with ``hash_ids`` sends."""
    shared = texts.of(1024)
    out = []
    for s in range(sessions):
        history = shared
        for _ in range(max(1, (target - 1024) // 1024)):
            history += " " + texts.of(1024)
            body = {"model": "bench", "messages": [{"role": "user", "content": history}]}
            out.append(http("/v1/chat/completions", {**body, "max_tokens": 1}, f"agent{s}"))
    return out


def shared_prefix_in_process(tok_dir: str, turns: list[bytes]) -> dict[str, Any]:
    """The router's chat tokenizing and hashing alone (``PrefixCache.lookup``/``finish``,
    as ``Router.prepare`` runs them) over ``turns``, CPU ms per turn, with the segment
    cache's word cuts and without (``word_cuts`` None: segments cut at special tokens
    only, as before them); both checked equal to encoding each whole text."""
    from index.hashing import BlockHasher
    from router.tokens.prefix_cache import PrefixCache
    from router.tokens.tokenize import HFTokenizer

    bodies = [orjson.loads(t.split(b"\r\n\r\n", 1)[1]) for t in turns]
    out: dict[str, Any] = {"turns": len(bodies)}
    for name in ("word_cuts", "no_word_cuts"):
        hf = HFTokenizer(tok_dir)
        if name == "no_word_cuts":
            hf.word_cuts = None
        cache, hasher, equal, ns = PrefixCache(256 << 20), BlockHasher(16), True, 0
        for body in bodies:
            text = hf.chat_template.render(body)
            c0 = time.process_time_ns()
            ids, _ = cache.finish(cache.lookup(hf, text, hasher))
            ns += time.process_time_ns() - c0
            equal &= ids.tolist() == hf._tok.encode(text, add_special_tokens=False).ids
        out[f"{name}_cpu_ms_per_turn"] = ns / len(bodies) / 1e6
        out[f"{name}_identical_to_full_encoding"] = equal
        mode = None if hf.word_cuts is None else hf.word_cuts.mode
        out["word_mode"] = out.get("word_mode") or mode
    return out


def _mean_pass(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The passes' figures averaged, their turns and errors summed (a figure the phase
    has no value for, None, stays None)."""
    out: dict[str, Any] = {}
    for key, first in passes[0].items():
        values = [p[key] for p in passes]
        if key in ("turns", "errors"):
            out[key] = sum(values)
        elif all(isinstance(v, int | float) for v in values):
            out[key] = statistics.mean(values)
        else:
            out[key] = first
    return out


def phase_interference(port: int, short: list[bytes], long: list[str], seconds: float) -> Any:
    """Short requests one at a time for ``seconds`` alone, then for ``seconds`` while a
    second connection sends chats of the ``long`` texts back to back, each led by a
    number no request before had (``_UNIQUE``), so every one is cold: its text is one
    chat segment, and a repeated one is found whole in cache-router's segment and prefix
    caches (cycling 24 texts, it served 600-800 of them in 4 s, against 7-16 cold ones
    in session 7) and in SGLang's text tree. Only answers with status 200
    are timed: a refused or failed request (a 429 from a full tokenize queue, say) comes
    back fast and would pass for a fast one; it is counted in the ``*_errors`` instead."""

    async def shorts(stop: float) -> tuple[list[float], int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
        out, errors = [], 0
        try:
            i = 0
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                writer.write(short[i % len(short)])
                if await _read_response(reader) == 200:
                    out.append(time.perf_counter() - t0)
                else:
                    errors += 1
                i += 1
        finally:
            writer.close()
        return out, errors

    async def longs(stop: float) -> tuple[int, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
        sent = errors = 0
        try:
            while time.perf_counter() < stop:
                writer.write(chat(f"{next(_UNIQUE)} {long[sent % len(long)]}"))
                if await _read_response(reader) != 200:
                    errors += 1
                sent += 1
        finally:
            writer.close()
        return sent, errors

    async def run() -> dict[str, Any]:
        idle, idle_errors = await shorts(time.perf_counter() + seconds)
        stop = time.perf_counter() + seconds
        (busy, busy_errors), (sent, long_errors) = await asyncio.gather(shorts(stop), longs(stop))
        out: dict[str, Any] = {
            "short_errors_idle": idle_errors,
            "short_errors_busy": busy_errors,
            "long_prompts_sent": sent,
            "long_prompt_errors": long_errors,
            "short_requests_idle": len(idle),
            "short_requests_busy": len(busy),
        }
        if idle and busy:
            out.update(
                idle_p50_ms=pct(idle, 50) * 1e3,
                idle_p99_ms=pct(idle, 99) * 1e3,
                busy_p50_ms=pct(busy, 50) * 1e3,
                busy_p99_ms=pct(busy, 99) * 1e3,
                p99_busy_over_idle=pct(busy, 99) / pct(idle, 99),
            )
        return out

    return asyncio.run(run())


async def _concurrent(port: int, requests: list[bytes], concurrency: int) -> float:
    queue = iter(requests)

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for req in queue:
                writer.write(req)
                await _read_response(reader)
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(requests) / (time.perf_counter() - t0)


# -- the e2e shape: aiperf's chats, streamed by a canned engine at a pace -----------------

E2E_MODEL = "tiny"  # bench/e2e.py's served model name (tests/real_engines/vllm_engine.py)


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def _sse(obj: Any) -> bytes:
    return _chunked(b"data: " + orjson.dumps(obj) + b"\n\n")


def stream_events(n_out: int, n_prompt: int) -> list[bytes]:
    """A vLLM chat stream of ``n_out`` tokens as the writes it leaves the engine in: the
    role chunk with the first token, one chunk a token, the usage chunk and ``[DONE]``
    with the last (chunked transfer encoding, its terminator last)."""
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1,
            "model": E2E_MODEL}  # fmt: skip
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}  # fmt: skip
    out = [_sse({**base, "choices": [role]})]
    for i in range(n_out):
        fin = "length" if i == n_out - 1 else None
        choice = {"index": 0, "delta": {"content": " tok"}, "logprobs": None, "finish_reason": fin}
        out.append(_sse({**base, "choices": [choice]}))
    usage = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out,
             "completion_tokens": n_out, "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    out[-1] += _sse({**base, "choices": [], "usage": usage}) + _chunked(b"data: [DONE]\n\n")
    out[-1] += b"0\r\n\r\n"
    return [out[0] + out[1], *out[2:]]


_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
_E2E_MODEL_ROW = {"id": E2E_MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 4096}
_E2E_MODELS = _EngineProtocol.answer({"object": "list", "data": [_E2E_MODEL_ROW]})


class _StreamingEngine(_EngineProtocol):
    """bench/proxy.py's canned engine, but a streamed chat is answered as vLLM streams
    it, at a pace: ``TTFT`` s to the first token, ``ITL`` s between tokens."""

    TTFT = 0.0
    ITL = 0.0

    def _write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    def answer_request(self, path: bytes, body: bytes) -> bytes | None:
        if path == b"/v1/models":
            return _E2E_MODELS
        if path != b"/v1/chat/completions":
            return None
        req = orjson.loads(body)
        if not req.get("stream"):
            return None
        n = int(req.get("max_completion_tokens") or req.get("max_tokens") or 1)
        loop = asyncio.get_running_loop()
        at = self.TTFT
        for k, part in enumerate(stream_events(n, 512)):
            loop.call_later(at, self._write, part)
            if 0 < k < n:
                at += self.ITL
        return _STREAM_HEAD


def run_streaming_engine(ports: list[int], ttft_ms: float, itl_ms: float) -> None:
    _StreamingEngine.TTFT, _StreamingEngine.ITL = ttft_ms / 1e3, itl_ms / 1e3
    run_engine(ports, _StreamingEngine)


def aiperf_slice(dataset: Path) -> list[dict[str, Any]]:
    """aiperf's conversations from its dataset cache entry (``dataset.dat``, JSON objects
    one after another) as ``{"ts", "body"}``: the chat body its OpenAI chat endpoint
    builds for bench/e2e.py's flags (aiperf/endpoints/openai_chat.py, 0.13)."""
    raw = (dataset / "dataset.dat").read_text()
    dec = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    i = 0
    while True:
        while i < len(raw) and raw[i].isspace():
            i += 1
        if i >= len(raw):
            return out
        conv, i = dec.raw_decode(raw, i)
        turn = conv["turns"][0]
        body = {
            "messages": [{"role": "user", "content": turn["texts"][0]["contents"][0]}],
            "model": turn["model"],
            "stream": True,
            "max_completion_tokens": turn["max_tokens"],
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        out.append({"ts": turn["timestamp"], "body": body})


async def replay(
    port: int, timed: list[tuple[float, bytes]]
) -> tuple[int, float, list[float | None]]:
    """Each request at its time (s from the start) on a pooled keep-alive connection, as
    aiperf's pooled aiohttp connector: (errors, wall seconds, each request's time to its
    first chunk in s, None where it failed)."""
    pool: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    errors = 0
    ttft: list[float | None] = [None] * len(timed)
    t0 = time.monotonic()

    async def one(i: int, at: float, request: bytes) -> None:
        nonlocal errors
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        sent = time.perf_counter()
        conn = None
        while pool and conn is None:
            conn = pool.pop()
            if conn[0].at_eof() or conn[1].is_closing():  # the router closed it idle
                conn[1].close()
                conn = None
        if conn is None:
            conn = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
        conn[1].write(request)
        try:
            status, ttft[i] = await _read_timed(conn[0], sent)
        except (asyncio.IncompleteReadError, ConnectionError):
            conn[1].close()
            errors += 1
            return
        errors += status != 200
        pool.append(conn)

    await asyncio.gather(*(one(i, at, r) for i, (at, r) in enumerate(timed)))
    wall = time.monotonic() - t0
    for _, w in pool:
        w.close()
    return errors, wall, ttft


def phase_e2e_shape(
    commands_of: dict[str, list[str]],
    slices: dict[str, list[dict[str, Any]]],
    speedup: float,
    rounds: int,
    engine_ttft_s: float,
) -> dict[str, Any]:
    """Every target on every slice, fresh each replay (no warm-up), ``rounds`` times with
    the order reversed every other time: CPU per request net of idle, per replay and mean,
    and the time to first token each request spent outside the engine (its first chunk
    at the client less the engine's TTFT): mean, p90 and the first burst's mean."""
    out: dict[str, Any] = {}
    for r in range(rounds):
        order = list(commands_of) if r % 2 == 0 else list(commands_of)[::-1]
        for sname, rows in slices.items():
            for name in order:
                port, port2 = free_ports(2)
                argv = [a.format(port=port, port2=port2) for a in commands_of[name]]
                with process(argv) as proc:
                    wait_http(port, "/health")
                    time.sleep(1.5)  # SGLang activates its workers after /health answers
                    pids = [proc.pid]
                    c0, t0 = cpu_ns(pids), time.perf_counter()
                    time.sleep(IDLE_S)
                    idle = (cpu_ns(pids) - c0) / (time.perf_counter() - t0)  # ns per s
                    timed = [(row["ts"] / 1e3 / speedup, http_body(row["body"])) for row in rows]
                    c0 = cpu_ns(pids)
                    errors, wall, ttft = asyncio.run(replay(port, timed))
                    used = cpu_ns(pids) - c0
                # the time to first token the router added: less the engine's own TTFT
                added = [(t - engine_ttft_s) * 1e3 for t in ttft if t is not None]
                first = rows[0]["ts"]  # the first burst: the requests sent at the start
                burst = [
                    (t - engine_ttft_s) * 1e3
                    for t, row in zip(ttft, rows, strict=True)
                    if t is not None and row["ts"] == first
                ]
                entry = out.setdefault(sname, {}).setdefault(name, {"runs": []})
                entry["runs"].append({
                    "round": r,
                    "errors": errors,
                    "wall_s": round(wall, 3),
                    "idle_cpu_ms_per_s": round(idle / 1e6, 3),
                    "cpu_s": round(used / 1e9, 4),
                    "cpu_ms_per_request_net": round((used - idle * wall) / len(rows) / 1e6, 3),
                    "ttft_added_ms_mean": round(statistics.mean(added), 2) if added else None,
                    "ttft_added_ms_p90": round(pct(added, 90), 2) if added else None,
                    "first_burst_requests": len(burst),
                    "first_burst_ttft_added_ms_mean": (
                        round(statistics.mean(burst), 2) if burst else None
                    ),
                })  # fmt: skip
    for by_target in out.values():
        for entry in by_target.values():
            nets = [run["cpu_ms_per_request_net"] for run in entry["runs"]]
            entry["cpu_ms_per_request_net_mean"] = round(statistics.mean(nets), 3)
            for key in ("ttft_added_ms_mean", "first_burst_ttft_added_ms_mean"):
                got = [run[key] for run in entry["runs"] if run[key] is not None]
                entry[f"{key}_over_runs"] = round(statistics.mean(got), 2) if got else None
            entry["errors"] = sum(run["errors"] for run in entry["runs"])
    ratios: dict[str, Any] = {}
    for sname, by_target in out.items():
        ours = by_target.get("cache_router")
        for peer in ("sglang_router", "cache_router_baseline"):
            if ours is not None and peer in by_target:
                mine = ours["cpu_ms_per_request_net_mean"]
                theirs = by_target[peer]["cpu_ms_per_request_net_mean"]
                ratios.setdefault(sname, {})[f"cache_router_over_{peer}"] = round(mine / theirs, 3)
    return {"by_slice": out, "ratios": ratios}


IDLE_S = 3.0  # bench/e2e.py's idle watch before each run


def http_body(body: dict[str, Any]) -> bytes:
    return http("/v1/chat/completions", body)


# -- the routers -----------------------------------------------------------------------------


def commands(
    urls: list[str], tok_dir: str, peers_py: str | None, nats_url: str | None, processes: int
) -> dict[str, list[str]]:
    workers = [a for i, u in enumerate(urls) for a in ("--worker", f"w{i}={u}")]
    out = {
        "cache_router": [
            sys.executable, "-m", "router.cli", "serve", "--port", "{port}", *workers,
            "--policy", "cache_aware", "--tokenizer", tok_dir, "--log-level", "error",
        ],
    }  # fmt: skip
    if nats_url is not None:
        # several router processes on the port (router/http/processes.py), replicas over NATS
        out[f"cache_router_{processes}_processes"] = [
            *out["cache_router"], "--processes", str(processes), "--nats-url", nats_url,
        ]  # fmt: skip
    # the same with the capacity forecast off: what its analysis costs (session 5, in
    # Python: 16-21 % of the router's CPU at saturation; native since session 6)
    no_forecast = ["env", "CACHE_ROUTER_FORECAST_TRACKED=0", *out["cache_router"]]
    out["cache_router_no_forecast"] = no_forecast
    # and the prefix cache off too: what it saves (beside the forecast-off instance, as the
    # forecast's analysis bursts would hide it)
    out["cache_router_no_forecast_no_prefix_cache"] = [*no_forecast, "--prefix-cache-mb", "0"]
    if peers_py is not None:
        out["sglang_router"] = [
            peers_py, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
            "--policy", "cache_aware", "--host", "127.0.0.1", "--port", "{port}",
            "--prometheus-port", "{port2}", "--log-level", "error",
        ]  # fmt: skip
        vllm = Path(peers_py).parent / "vllm-router"
        if vllm.exists():
            out["vllm_router"] = [
                str(vllm), "--worker-urls", *urls, "--policy", "cache_aware",
                "--host", "127.0.0.1", "--port", "{port}", "--prometheus-port", "{port2}",
                "--log-level", "error",
            ]  # fmt: skip
    return out


class Running:
    def __init__(self, port: int, pids: list[int]) -> None:
        self.port = port
        self.pids = pids


@contextlib.contextmanager
def started(cmd: list[str]) -> Iterator[Running]:
    port, port2 = free_ports(2)
    argv = [a.format(port=port, port2=port2) for a in cmd]
    with process(argv) as proc:
        wait_http(port, "/health")
        if "--processes" in argv:  # /health answers once one of them is up
            _all_processes_up(port, int(argv[argv.index("--processes") + 1]))
        time.sleep(1.0)  # SGLang activates its workers after /health answers
        asyncio.run(sequential(port, _requests(port, 50)))  # warm up
        # cpu_ns reads the tree below it at each reading (a supervisor's children, the
        # tokenizer processes started later): all processes summed
        yield Running(port, [proc.pid])


def _all_processes_up(port: int, n: int, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        if len(re.findall(r'^cache_router_process_up\{process="\d+"\} 1\.0$', text, re.M)) >= n:
            return
        time.sleep(0.2)
    raise RuntimeError(f"not all {n} router processes came up in {timeout} s")


def tokenizer_dir(path: str, into: str) -> Any:
    from tokenizers import AddedToken, Tokenizer

    raw = Tokenizer.from_file(path)
    raw.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
    )
    raw.save(f"{into}/tokenizer.json")
    Path(into, "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tokenizer",
        required=True,
        help="a tokenizer.json (Llama SentencePiece); with --e2e-shape-only the e2e's model "
        "directory (its tokenizer.json and tokenizer_config.json)",
    )
    ap.add_argument("--peers-python", default="/work/venv-peers/bin/python")
    ap.add_argument("--quick", action="store_true", help="short lengths, few requests (smoke)")
    ap.add_argument("--seconds", type=float, default=4.0, help="each interference half")
    ap.add_argument("--saturation-requests", type=int, default=3000)
    ap.add_argument(
        "--saturation-only", action="store_true", help="only the saturation phase (and ratios)"
    )
    ap.add_argument(
        "--multi-turn-only", action="store_true", help="only the multi-turn phase (and ratios)"
    )
    ap.add_argument(
        "--shared-prefix-only",
        action="store_true",
        help="only agent chats sharing long texts in one message (and ratios)",
    )
    ap.add_argument(
        "--interference-only",
        action="store_true",
        help="only the short p99 under a client of cold 128K prompts, --repeat times",
    )
    ap.add_argument(
        "--repeat", type=int, default=3, help="repetitions of --interference-only (1-50)"
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=2,
        help="also cache-router with this many processes, replicas over an embedded "
        "nats-server (1: not run)",
    )
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="also cache_router_baseline: cache-router run from this checkout (before/after)",
    )
    ap.add_argument(
        "--targets", help="comma-separated routers to run (default: all; 'direct' always)"
    )
    ap.add_argument(
        "--e2e-shape-only",
        action="store_true",
        help="only bench/e2e.py's requests replayed on their schedule (--slice)",
    )
    ap.add_argument("--slice", action="append", default=[], help="a slice file (JSONL: ts, body)")
    ap.add_argument("--speedup", type=float, default=1.5, help="divides the slices' timestamps")
    ap.add_argument("--rounds", type=int, default=4, help="replays of each slice per target")
    ap.add_argument("--engine-ttft-ms", type=float, default=300.0)
    ap.add_argument("--engine-itl-ms", type=float, default=40.0)
    ap.add_argument(
        "--aiperf-dataset",
        metavar="DIR",
        help="write aiperf's dataset cache entry DIR as a slice file on stdout and exit",
    )
    if "--aiperf-dataset" in sys.argv:  # no --tokenizer needed
        at = sys.argv.index("--aiperf-dataset")
        for row in aiperf_slice(Path(sys.argv[at + 1])):
            print(json.dumps(row))
        return
    args = ap.parse_args()
    if args.e2e_shape_only:
        e2e_shape_main(args)
        return
    if not 1 <= args.repeat <= 50:
        ap.error("--repeat must be 1-50")
    one_phase = args.multi_turn_only or args.interference_only or args.shared_prefix_only
    peers_py = args.peers_python
    if peers_py and not Path(peers_py).exists():
        peers_py = None
    lengths = LENGTHS[:2] if args.quick else LENGTHS
    target = 4096 if args.quick else 32768
    seconds = 1.0 if args.quick else args.seconds
    sat_requests = 300 if args.quick else args.saturation_requests

    ports = free_ports(16)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with tempfile.TemporaryDirectory() as tok_dir:
        tok = tokenizer_dir(args.tokenizer, tok_dir)
        texts = Texts(tok)
        bodies: dict[str, dict[int, list[bytes]]] = {"chat": {}, "completion": {}}
        tokens: dict[int, int] = {}
        floor: dict[int, str] = {}  # a rendered chat text of each length
        for n in lengths:
            reps = 3 if args.quick else max(6, min(100, 400_000 // n))
            chat_texts = [texts.of(n) for _ in range(reps)]
            bodies["chat"][n] = [chat(t) for t in chat_texts]
            bodies["completion"][n] = [completion(texts.of(n)) for _ in range(reps)]
            rendered = f"<|im_start|>user\n{chat_texts[0]}<|im_end|>\n<|im_start|>assistant\n"
            floor[n] = rendered
            tokens[n] = len(tok.encode(rendered, add_special_tokens=False).ids)
        turns, turn_tokens = conversation(texts, target, "conv")
        # cold: distinct prompts (a repeated one would find its segments cached)
        long = [texts.of(lengths[-1]) for _ in range(3 if args.quick else 24)]

        result: dict[str, Any] = {
            "load_average_1m_start": os.getloadavg()[0],
            "cpu_count": os.cpu_count(),
            "tokenizer": args.tokenizer,
            "prompt_tokens": {str(n): tokens[n] for n in lengths},
            "multi_turn_final_tokens_about": turn_tokens,
        }
        multi = args.processes > 1 and (
            args.targets is None or f"cache_router_{args.processes}_processes" in args.targets
        )
        nats = EmbeddedNats(jetstream=False) if multi else None
        nats_url = None if nats is None else nats.start().url
        commands_of = commands(urls, tok_dir, peers_py, nats_url, args.processes)
        if args.baseline is not None:  # the same router from another checkout, side by side
            base = ["env", "-C", args.baseline, *commands_of["cache_router"]]
            commands_of["cache_router_baseline"] = base
        if args.targets is not None:
            wanted = args.targets.split(",")
            unknown = sorted(set(wanted) - set(commands_of))
            if unknown:
                ap.error(
                    f"--targets: unknown {', '.join(unknown)} (known: {', '.join(commands_of)})"
                )
            commands_of = {name: commands_of[name] for name in wanted}
        engine = [sys.executable, __file__, "--engine", *map(str, ports)]
        with process(engine, cwd=ROOT), nats or contextlib.nullcontext():
            for p in ports:
                wait_http(p, "/health")
            entries: dict[str, dict[str, Any]] = {"direct": {}, **{n: {} for n in commands_of}}
            for n_workers in (4,) if one_phase else (4, 1, 16):
                with contextlib.ExitStack() as stack:
                    targets = {
                        name: stack.enter_context(started(_with_workers(cmd, urls, n_workers)))
                        for name, cmd in commands_of.items()
                    }
                    if args.shared_prefix_only:  # ABC then CBA, fresh texts the second time
                        runs = {"direct": Running(ports[0], []), **targets}
                        size = 3072 if args.quick else 9216
                        agents = [agent_turns(texts, size) for _ in range(2)]
                        for order, conv in zip((list(runs), list(runs)[::-1]), agents, strict=True):
                            for name in order:
                                sp = phase_multi_turn(runs[name].port, runs[name].pids, conv)
                                entries[name].setdefault("shared_prefix_passes", []).append(sp)
                        for name in runs:
                            passes = entries[name]["shared_prefix_passes"]
                            entries[name]["shared_prefix"] = _mean_pass(passes)
                        alone = shared_prefix_in_process(tok_dir, agents[0])
                        result["shared_prefix_tokenize_alone"] = alone
                        continue
                    if args.multi_turn_only:
                        # ABC with this conversation, then CBA with a fresh one (a router
                        # has the first cached): the machine drifts, a router's figure
                        # moved ~30 % with its place in the order (BENCHMARKS.md session 15)
                        runs = {"direct": Running(ports[0], []), **targets}
                        again = conversation(texts, target, "conv2")[0]
                        for order, conv in ((list(runs), turns), (list(runs)[::-1], again)):
                            for name in order:
                                mt = phase_multi_turn(runs[name].port, runs[name].pids, conv)
                                entries[name].setdefault("multi_turn_passes", []).append(mt)
                        for name in runs:
                            passes = entries[name]["multi_turn_passes"]
                            entries[name]["multi_turn"] = _mean_pass(passes)
                        continue
                    if args.interference_only:
                        _interference_reps(entries, targets, long, seconds, args.repeat)
                        continue
                    if n_workers == 4 and not args.saturation_only:
                        _phases(
                            entries, targets, ports[0], bodies, floor, tok, turns, long, seconds
                        )
                    for order in (list(targets), list(targets)[::-1]):  # ABC then CBA
                        for name in order:
                            run = targets[name]
                            reqs = _requests(run.port, sat_requests)
                            c0 = cpu_ns(run.pids)
                            rps = asyncio.run(_concurrent(run.port, reqs, 32))
                            cpu_us = (cpu_ns(run.pids) - c0) / len(reqs) / 1e3
                            for key, value in (
                                (f"saturation_rps_{n_workers}_workers", rps),
                                (f"saturation_cpu_us_per_request_{n_workers}_workers", cpu_us),
                            ):
                                entries[name].setdefault(key, []).append(value)
                    for name, run in targets.items():
                        if name.endswith("_processes"):  # how SO_REUSEPORT spread them
                            split = _requests_by_process(run.port)
                            entries[name][f"requests_by_process_{n_workers}_workers"] = split
            for name in commands_of:
                for n_workers in () if one_phase else (1, 4, 16):
                    for key in (
                        f"saturation_rps_{n_workers}_workers",
                        f"saturation_cpu_us_per_request_{n_workers}_workers",
                    ):
                        passes = entries[name][key]
                        entries[name][key] = statistics.mean(passes)
                        entries[name][key + "_passes"] = passes  # the load drifts between
                if not args.saturation_only:
                    _added(entries[name], entries["direct"])
            if args.multi_turn_only or args.shared_prefix_only:
                pass
            elif args.interference_only:
                del entries["direct"]  # the engine alone has no 128K-prompt client
            elif not args.saturation_only:
                result["tokenizer_alone_cpu_ms"] = entries.pop("tokenizer_alone")
                result["tokenizer_alone_fast_cpu_ms"] = entries.pop("tokenizer_alone_fast")
            else:
                del entries["direct"]
            result.update(entries)
        result["ratios"] = _ratios(result, lengths)
        result["load_average_1m_end"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))


def e2e_shape_main(args: argparse.Namespace) -> None:
    """``--e2e-shape-only``: bench/e2e.py's router settings in front of two streaming
    canned engines; cache_router (this checkout), cache_router_baseline (``--baseline``)
    and sglang_router (``--peers-python``), or ``--targets``."""
    if not args.slice:
        sys.exit("--e2e-shape-only needs --slice FILE")
    slices = {
        Path(f).stem: [json.loads(line) for line in Path(f).read_text().splitlines() if line]
        for f in args.slice
    }
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    workers = [a for i, u in enumerate(urls) for a in ("--worker", f"e{i}={u}")]
    ours = [
        sys.executable, "-m", "router.cli", "serve", "--port", "{port}", *workers,
        "--policy", "round_robin", "--tokenizer", args.tokenizer, "--block-size", "32",
        "--admin-token", "bench", "--log-level", "warning",
    ]  # fmt: skip
    commands_of: dict[str, list[str]] = {"cache_router": ours}
    if args.baseline is not None:
        commands_of["cache_router_baseline"] = ["env", "-C", args.baseline, *ours]
    peers_py = args.peers_python
    if peers_py and Path(peers_py).exists():
        commands_of["sglang_router"] = [
            peers_py, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
            "--policy", "cache_aware", "--host", "127.0.0.1", "--port", "{port}",
            "--prometheus-port", "{port2}", "--log-level", "warn",
        ]  # fmt: skip
    if args.targets is not None:
        commands_of = {k: v for k, v in commands_of.items() if k in args.targets.split(",")}
    engine = [
        sys.executable, __file__, "--streaming-engine", str(args.engine_ttft_ms),
        str(args.engine_itl_ms), *map(str, ports),
    ]  # fmt: skip
    result: dict[str, Any] = {
        "load_average_1m_start": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
        "tokenizer": args.tokenizer,
        "policy": "round_robin",
        "speedup": args.speedup,
        "engine_ttft_ms": args.engine_ttft_ms,
        "engine_itl_ms": args.engine_itl_ms,
        "requests": {name: len(rows) for name, rows in slices.items()},
    }
    with process(engine, cwd=ROOT):
        for p in ports:
            wait_http(p, "/health")
        result["e2e_shape"] = phase_e2e_shape(
            commands_of, slices, args.speedup, args.rounds, args.engine_ttft_ms / 1e3
        )
    result["load_average_1m_end"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))


def _requests_by_process(port: int) -> dict[str, float]:
    """Requests each router process served so far (its /metrics, labelled ``process``)."""
    import httpx

    out: dict[str, float] = {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for m in re.finditer(r'^cache_router_requests_total\{.*process="(\d+)".*\} (\S+)$', text, re.M):
        out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


def _with_workers(cmd: list[str], urls: list[str], n: int) -> list[str]:
    """``cmd`` with only the first ``n`` worker urls."""
    keep = set(urls[:n])
    out: list[str] = []
    skip_value = False
    for i, a in enumerate(cmd):
        if skip_value:
            skip_value = False
            continue
        if a == "--worker" and cmd[i + 1].split("=", 1)[1] not in keep:
            skip_value = True
            continue
        if a.startswith("http://") and a not in keep:
            continue
        out.append(a)
    return out


def _phases(
    entries: dict[str, dict[str, Any]],
    targets: dict[str, Running],
    engine_port: int,
    bodies: dict[str, dict[int, list[bytes]]],
    floor: dict[int, str],
    tok: Any,
    turns: list[bytes],
    long: list[str],
    seconds: float,
) -> None:
    """The 4-worker phases, every router in turn within each; ``direct`` is the engine."""
    everyone = {"direct": Running(engine_port, []), **targets}
    time.sleep(0.5)
    c0 = {name: cpu_ns(run.pids) for name, run in targets.items()}
    time.sleep(2.0)
    for name, run in targets.items():
        # health checks, load scrapes: CPU no request asked for
        entries[name]["idle_cpu_ms_per_s"] = (cpu_ns(run.pids) - c0[name]) / 2e6
    by_target = phase_lengths(everyone, bodies, floor, tok)
    entries["tokenizer_alone"] = by_target.pop("tokenizer_alone")
    entries["tokenizer_alone_fast"] = by_target.pop("tokenizer_alone_fast")
    for name, rows in by_target.items():
        entries[name]["lengths"] = rows
    for name, run in everyone.items():
        entries[name]["multi_turn"] = phase_multi_turn(run.port, run.pids, turns)
    for name, run in targets.items():
        short = _requests(run.port, 64)
        entries[name]["interference"] = phase_interference(run.port, short, long, seconds)


def _interference_reps(
    entries: dict[str, dict[str, Any]],
    targets: dict[str, Running],
    long: list[str],
    seconds: float,
    repeat: int,
) -> None:
    """``phase_interference`` once per repetition for every router, the order reversed
    every other time (the load drifts); the spread of busy / idle p99 over repetitions."""
    for i in range(repeat):
        for name in list(targets)[:: 1 if i % 2 == 0 else -1]:
            run = targets[name]
            rep = phase_interference(run.port, _requests(run.port, 64), long, seconds)
            rep["load_average_1m"] = os.getloadavg()[0]
            entries[name].setdefault("interference", []).append(rep)
    for name in targets:
        reps = entries[name]["interference"]
        ratios = [r["p99_busy_over_idle"] for r in reps if "p99_busy_over_idle" in r]
        entries[name]["interference_spread"] = {
            "p99_busy_over_idle": ratios,
            "p99_busy_over_idle_median": statistics.median(ratios) if ratios else None,
            "idle_p99_ms": [r.get("idle_p99_ms") for r in reps],
            "busy_p99_ms": [r.get("busy_p99_ms") for r in reps],
            "errors": sum(
                r["short_errors_idle"] + r["short_errors_busy"] + r["long_prompt_errors"]
                for r in reps
            ),
        }


def _added(entry: dict[str, Any], direct: dict[str, Any]) -> None:
    for key, row in entry.get("lengths", {}).items():
        base = direct["lengths"][key]
        row["added_p50_ms"] = row["p50_ms"] - base["p50_ms"]
        row["added_p99_ms"] = row["p99_ms"] - base["p99_ms"]
    if "multi_turn" in entry:
        mt, base = entry["multi_turn"], direct["multi_turn"]
        mt["added_last_4_turns_ms"] = mt["last_4_turns_ms"] - base["last_4_turns_ms"]


def _ratios(result: dict[str, Any], lengths: tuple[int, ...]) -> dict[str, Any]:
    """cache-router over each peer, per measure (below 1: cache-router costs less)."""
    ours = result.get("cache_router")
    out: dict[str, Any] = {}
    for peer in ("sglang_router", "vllm_router", "cache_router_baseline"):
        theirs = result.get(peer)
        if not isinstance(ours, dict) or not isinstance(theirs, dict):
            continue
        r: dict[str, Any] = {}
        for key, row in ours.get("lengths", {}).items():
            other = theirs["lengths"][key]
            r[f"{key}_cpu"] = row["cpu_ms_per_request"] / other["cpu_ms_per_request"]
        if "multi_turn" in ours:
            mine, other = ours["multi_turn"], theirs["multi_turn"]
            r["multi_turn_cpu_mean"] = mine["cpu_ms_per_turn_mean"] / other["cpu_ms_per_turn_mean"]
            r["multi_turn_cpu_last_4"] = mine["cpu_ms_last_4_turns"] / other["cpu_ms_last_4_turns"]
            for key in ("cpu_ms_per_turn_mean_settled", "cpu_ms_last_4_turns_settled"):
                r[f"multi_turn_{key}"] = mine[key] / other[key]
        if "shared_prefix" in ours and "shared_prefix" in theirs:
            mine, other = ours["shared_prefix"], theirs["shared_prefix"]
            for key in ("cpu_ms_per_turn_mean", "cpu_ms_per_turn_mean_settled"):
                r[f"shared_prefix_{key}"] = mine[key] / other[key]
        for n in (1, 4, 16):
            for what in ("rps", "cpu_us_per_request"):
                key = f"saturation_{what}_{n}_workers"
                if key in ours:
                    r[key] = ours[key] / theirs[key]
        out[f"cache_router_over_{peer}"] = r
    multi = next((v for k, v in result.items() if k.endswith("_processes")), None)
    if isinstance(ours, dict) and isinstance(multi, dict):  # over one process, and the peers
        for other in ("cache_router", "sglang_router", "vllm_router"):
            theirs = result.get(other)
            if not isinstance(theirs, dict):
                continue
            out[f"processes_over_{other}"] = {
                key: multi[key] / theirs[key]
                for n in (1, 4, 16)
                for what in ("rps", "cpu_us_per_request")
                if (key := f"saturation_{what}_{n}_workers") in multi and key in theirs
            }
    on = result.get("cache_router_no_forecast", {}).get("multi_turn")
    off = result.get("cache_router_no_forecast_no_prefix_cache", {}).get("multi_turn")
    if on and off:  # both with the forecast off
        out["multi_turn_cpu_prefix_cache_on_over_off"] = {
            key: on[key] / off[key] for key in ("cpu_ms_per_turn_mean", "cpu_ms_last_4_turns")
        }
    with_forecast = ours.get("multi_turn") if isinstance(ours, dict) else None
    if with_forecast and on:
        out["multi_turn_cpu_forecast_on_over_off"] = {
            key: with_forecast[key] / on[key]
            for key in (
                "cpu_ms_per_turn_mean", "cpu_ms_last_4_turns",
                "cpu_ms_per_turn_mean_settled", "cpu_ms_last_4_turns_settled",
            )
        }  # fmt: skip
    spreads = {k: v["interference_spread"] for k, v in result.items()
               if isinstance(v, dict) and "interference_spread" in v}  # fmt: skip
    if spreads:  # the target: <= 1.5x
        out["short_p99_busy_over_idle_median"] = {
            name: spread["p99_busy_over_idle_median"] for name, spread in spreads.items()
        }
    if isinstance(ours, dict) and "lengths" in ours:
        alone = result["tokenizer_alone_cpu_ms"]
        out["cache_router_chat_cpu_over_tokenizer_alone"] = {
            n: ours["lengths"][f"chat_{n}"]["cpu_ms_per_request"] / ms for n, ms in alone.items()
        }
        fast = result["tokenizer_alone_fast_cpu_ms"]
        out["cache_router_chat_cpu_over_tokenizer_alone_fast"] = {
            n: ours["lengths"][f"chat_{n}"]["cpu_ms_per_request"] / ms for n, ms in fast.items()
        }
        out["short_p99_under_128k_client_over_idle"] = {
            name: result[name]["interference"].get("p99_busy_over_idle")
            for name in (
                "cache_router",
                "cache_router_no_forecast",
                "cache_router_no_forecast_no_prefix_cache",
                "sglang_router",
                "vllm_router",
            )
            if name in result
        }
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--engine":
        run_engine([int(p) for p in sys.argv[2:]])
    elif len(sys.argv) > 4 and sys.argv[1] == "--streaming-engine":
        ttft, itl = float(sys.argv[2]), float(sys.argv[3])
        run_streaming_engine([int(p) for p in sys.argv[4:]], ttft, itl)
    else:
        main()
