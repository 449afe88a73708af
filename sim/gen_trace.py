"""``cache-router gen-trace``: seeded agent-shaped traces (multi-turn chat, agent loops).

The Mooncake traces are one workload; the traffic a cache-aware router is bought for
looks different: long shared prefixes and per-session contexts that grow request after
request. Two shapes, written as Mooncake lines (one id per 512-token block, equal ids
mean equal tokens) plus a ``session_id``, so ``cache-router replay`` reads them as it
reads Mooncake:

- ``chat``: ``--system-prompts`` shared system prompts of 2-8K tokens (popularity
  Zipf 1: a few are used by most sessions), sessions of 3-10 turns; each turn appends
  the previous answer and a user message of 200-2000 tokens (log-uniform); answers are
  100-600 tokens; the next turn comes 3-30 s (log-uniform, ``--think-time``) after the
  last one arrived.
- ``agent``: sessions start from one of 4 shared tool prompts (2-6K) plus a private task
  of 3-14K (5-20K in all); each step appends a tool result of 0.5-4K tokens and a call
  of 50-300 tokens, until the context reaches a cap of 30-100K; steps follow each other
  0.5-5 s apart (tool run time).

Sessions start as a Poisson process (``--rate`` sessions/s). A request arrives at its
session's clock regardless of how long the previous one took (open loop, like every
trace replay); ``replay --speedup`` scales the arrival rate. Same arguments and seed,
same file, byte for byte.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from sim.traces import MOONCAKE_BLOCK

SHAPES = ("chat", "agent")
# Sessions per second that keep 8 default engines (sim.simulator.SimConfig) busy but not
# saturated (busy_mean 0.5-0.7 under least_load); --rate or replay --speedup to change.
DEFAULT_RATE = {"chat": 1.0, "agent": 0.12}
DEFAULT_SESSIONS = {"chat": 500, "agent": 120}


@dataclass(slots=True)
class _Context:
    """A prompt as Mooncake blocks: full 512-token block ids, then a partial tail."""

    blocks: list[int]
    tail: int  # tokens after the last full block

    @property
    def tokens(self) -> int:
        return len(self.blocks) * MOONCAKE_BLOCK + self.tail


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def __call__(self) -> int:
        self.next += 1
        return self.next - 1


def _append(ctx: _Context, tokens: int, ids: _Ids) -> _Context:
    """``ctx`` followed by ``tokens`` new ones: the partial tail block becomes new blocks."""
    blocks = list(ctx.blocks)
    tail = ctx.tail + tokens
    while tail >= MOONCAKE_BLOCK:
        blocks.append(ids())
        tail -= MOONCAKE_BLOCK
    return _Context(blocks, tail)


def _prompt(ctx: _Context, ids: _Ids) -> tuple[int, list[int]]:
    """(input_length, hash_ids) of a request whose prompt is ``ctx``."""
    return ctx.tokens, ctx.blocks + ([ids()] if ctx.tail else [])


def _loguniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _zipf_weights(n: int) -> list[float]:
    return [1.0 / (k + 1) for k in range(n)]


def _shared(rng: random.Random, ids: _Ids, n: int, lo: int, hi: int) -> list[_Context]:
    return [_append(_Context([], 0), rng.randint(lo, hi), ids) for _ in range(n)]


Row = tuple[float, int, int, list[int], str]


def _chat(
    rng: random.Random,
    ids: _Ids,
    sessions: int,
    rate: float,
    prompts: int,
    think: tuple[float, float] = (3.0, 30.0),
) -> Iterator[Row]:
    systems = _shared(rng, ids, prompts, 2048, 8192)
    weights = _zipf_weights(prompts)
    start = 0.0
    for s in range(sessions):
        start += rng.expovariate(rate) * 1000.0
        ctx = rng.choices(systems, weights)[0]
        t = start
        answer = 0
        for _turn in range(rng.randint(3, 10)):
            ctx = _append(ctx, answer + round(_loguniform(rng, 200, 2000)), ids)
            answer = rng.randint(100, 600)
            n, hash_ids = _prompt(ctx, ids)
            yield t, n, answer, hash_ids, f"chat{s}"
            t += _loguniform(rng, think[0] * 1000.0, think[1] * 1000.0)


def _agent(
    rng: random.Random, ids: _Ids, sessions: int, rate: float, prompts: int
) -> Iterator[Row]:
    tools = _shared(rng, ids, prompts, 2048, 6144)
    start = 0.0
    for s in range(sessions):
        start += rng.expovariate(rate) * 1000.0
        base = rng.choice(tools)
        ctx = _append(base, max(0, rng.randint(5120, 20480) - base.tokens), ids)
        cap = rng.randint(30_720, 102_400)
        t = start
        call = 0
        while True:
            n, hash_ids = _prompt(ctx, ids)
            call = rng.randint(50, 300)
            yield t, n, call, hash_ids, f"agent{s}"
            grow = call + rng.randint(512, 4096)
            if ctx.tokens + grow > cap:
                break
            ctx = _append(ctx, grow, ids)
            t += rng.uniform(500.0, 5000.0)


def generate(
    shape: str,
    *,
    sessions: int | None = None,
    rate: float | None = None,
    system_prompts: int | None = None,
    think_s: tuple[float, float] | None = None,
    seed: int = 0,
) -> list[dict[str, object]]:
    """The trace's lines (dicts), sorted by arrival. ``think_s``: chat's think time
    between turns, (low, high) seconds, log-uniform (default 3-30 s)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    sessions = DEFAULT_SESSIONS[shape] if sessions is None else sessions
    rate = DEFAULT_RATE[shape] if rate is None else rate
    prompts = (20 if shape == "chat" else 4) if system_prompts is None else system_prompts
    if sessions < 1 or not rate > 0 or prompts < 1:
        raise ValueError("sessions and system prompts must be >= 1, rate > 0")
    if think_s is not None:
        if shape != "chat":
            raise ValueError("think time: chat only (agent steps follow tool run times)")
        if not 0 < think_s[0] <= think_s[1]:
            raise ValueError(f"think time must be 0 < low <= high, got {think_s}")
    rng = random.Random(f"{shape}:{seed}")
    ids = _Ids()
    if shape == "chat":
        made = _chat(rng, ids, sessions, rate, prompts, think_s or (3.0, 30.0))
    else:
        made = _agent(rng, ids, sessions, rate, prompts)
    rows = sorted(made, key=lambda r: r[0])
    return [
        {
            "timestamp": round(t, 3),
            "input_length": n,
            "output_length": out,
            "hash_ids": hash_ids,
            "session_id": session,
        }
        for t, n, out, hash_ids, session in rows
    ]


def write(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=SHAPES, required=True, help="workload shape")
    parser.add_argument("--out", required=True, metavar="PATH|-", help="JSONL file to write")
    parser.add_argument("--sessions", type=int, help=f"sessions (default: {DEFAULT_SESSIONS})")
    parser.add_argument("--rate", type=float, help=f"sessions per second (default: {DEFAULT_RATE})")
    parser.add_argument(
        "--system-prompts", type=int, help="shared prompts (default: 20 chat, 4 agent)"
    )
    parser.add_argument(
        "--think-time",
        type=_think,
        metavar="LOW-HIGH",
        help="chat: seconds between an answer and the next turn, log-uniform (default 3-30)",
    )
    parser.add_argument("--seed", type=int, default=0, help="same seed, same trace")


def _think(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition("-")
    try:
        return (float(lo), float(hi)) if sep else (float(lo), float(lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH seconds, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    try:
        lines = generate(
            args.shape,
            sessions=args.sessions,
            rate=args.rate,
            system_prompts=args.system_prompts,
            think_s=args.think_time,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"cache-router gen-trace: error: {exc}", file=sys.stderr)
        return 2
    if args.out == "-":
        sys.stdout.buffer.write(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    else:
        write(Path(args.out), lines)
        tokens = sum(int(line["input_length"]) for line in lines)  # type: ignore[call-overload]
        print(
            f"gen-trace: {len(lines)} requests, {tokens:,} prompt tokens -> {args.out}",
            file=sys.stderr,
        )
    return 0
