"""Request traces for the simulator: Mooncake JSONL and a plain JSONL of token ids or text.

Mooncake lines are ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}`` with one id per 512-token block, prefix-chained (equal ids mean an
equal prompt up to there). Tokens are synthesized deterministically: every full 512-block
id always yields the same 512 tokens, and the final partial block comes from a source
private to the request, so only whole Mooncake blocks are shared. The engine's block size
is independent (e.g. 64): a 512-block holds 8 engine blocks.

Mooncake has no session ids (a line may carry one, ``session_id``, as ``cache-router
gen-trace`` writes). A client would tag a conversation, so one is derived the way a
client knows it, from the past only: a request whose prompt extends an earlier
request's whole-block chain (longer than one block, so a shared system prompt is not a
conversation) continues that request's session.

Plain lines are ``{"token_ids": [...]}`` or ``{"text": "..."}`` (UTF-8 bytes are the
tokens: deterministic, no tokenizer files), with optional ``timestamp`` (ms, default 0),
``output_length`` (default 16) and ``session_id``.

Everything a replay needs per request is computed once here (router and engine block
hashes), so each policy run only regenerates tokens when a request arrives.
"""

from __future__ import annotations

import argparse
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from index.hashing import BlockHasher
from sim.cache import engine_block_hashes

MOONCAKE_BLOCK = 512
VOCAB = 100_000
DEFAULT_OUTPUT = 16
_TAIL_TAG = np.uint64(1 << 63)  # keeps per-request tail ids apart from hash ids


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the line."""


@dataclass(slots=True)
class TraceRequest:
    arrival_ms: float
    input_len: int
    output_len: int
    session: str | None
    router_hashes: array[int]  # the router's rolling hashes of the prompt's full blocks
    engine_hashes: array[int]  # the engines' own hashes of the same blocks
    hash_ids: list[int] | None = None  # Mooncake ids (token source)
    line: int = 0  # position in the file: keys the Mooncake tail's token source
    token_ids: list[int] | None = None  # plain traces keep their tokens


@dataclass(slots=True)
class Trace:
    name: str
    block_size: int
    seed: int
    requests: list[TraceRequest]

    def tokens(self, i: int) -> array[int]:
        """The prompt of request ``i`` as ``array('I')`` (Mooncake ones are regenerated)."""
        req = self.requests[i]
        if req.token_ids is not None:
            return array("I", req.token_ids)
        tokens = mooncake_tokens(req.hash_ids or [], req.input_len, req.line, self.seed)
        return array("I", tokens.tobytes())

    def ideal_hit_rate(self) -> float:
        """Token-weighted hit rate of one infinite cache shared by every worker.

        The ceiling for any policy: a block hits if any earlier request produced it.
        The engine always computes the last prompt token, so hits stop one short.
        """
        seen: set[int] = set()
        hit = total = 0
        for req in self.requests:
            hit += _leading_hits(req, self.block_size, seen) * self.block_size
            total += req.input_len
            seen.update(req.router_hashes)
        return hit / total if total else 0.0

    def pooled_lru_hit_rate(self, capacity_blocks: int) -> float:
        """Hit rate of one LRU cache of ``capacity_blocks`` shared by every worker.

        The reference for finite memory: what the pool's total capacity keeps under LRU
        if routing could make it act as one cache (no duplicates, no imbalance).
        """
        lru: OrderedDict[int, None] = OrderedDict()
        hit = total = 0
        for req in self.requests:
            hit += _leading_hits(req, self.block_size, lru) * self.block_size
            total += req.input_len
            for h in req.router_hashes:
                if h in lru:
                    lru.move_to_end(h)
                else:
                    lru[h] = None
                    if len(lru) > capacity_blocks:
                        lru.popitem(last=False)
        return hit / total if total else 0.0


def _leading_hits(
    req: TraceRequest, block_size: int, held: set[int] | OrderedDict[int, None]
) -> int:
    hashes = req.router_hashes
    cap = min(len(hashes), max(0, (req.input_len - 1) // block_size))
    n = 0
    while n < cap and hashes[n] in held:
        n += 1
    return n


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def mooncake_tokens(hash_ids: list[int], input_len: int, index: int, seed: int) -> np.ndarray:
    """The prompt of one Mooncake request as uint32 token ids."""
    full = min(len(hash_ids), input_len // MOONCAKE_BLOCK)
    ids = np.empty(len(hash_ids) if input_len % MOONCAKE_BLOCK else full, dtype=np.uint64)
    ids[:full] = np.asarray(hash_ids[:full], dtype=np.uint64)
    if len(ids) > full:
        ids[full:] = _TAIL_TAG | np.uint64(index)
    pos = np.arange(MOONCAKE_BLOCK, dtype=np.uint64)
    with np.errstate(over="ignore"):
        keys = (ids[:, None] * np.uint64(MOONCAKE_BLOCK) + pos) ^ np.uint64(seed)
        tokens = _splitmix64(keys) % np.uint64(VOCAB)
    return tokens.reshape(-1)[:input_len].astype(np.uint32)


def _read_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not JSON ({exc})") from exc
            if not isinstance(obj, dict):
                raise TraceError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, obj


def _int(obj: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = obj.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return value


def _number(obj: dict[str, Any], key: str, where: str) -> float:
    value = obj.get(key, 0)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{where}: {key!r} must be a non-negative number, got {value!r}")
    return float(value)


class _Sessions:
    """Derives Mooncake conversations from prefix extension (see the module doc)."""

    def __init__(self) -> None:
        self._by_last_block: dict[int, str] = {}
        self._count = 0

    def key(self, hash_ids: list[int], input_len: int) -> str:
        full = min(len(hash_ids), input_len // MOONCAKE_BLOCK)
        session = None
        for k in range(full, 1, -1):
            session = self._by_last_block.get(hash_ids[k - 1])
            if session is not None:
                break
        if session is None:
            session = f"s{self._count}"
            self._count += 1
        if full >= 2:
            self._by_last_block[hash_ids[full - 1]] = session
        return session


def load_trace(
    path: str | Path,
    block_size: int = 64,
    *,
    seed: int = 0,
    engine_seed: int = 0,
    speedup: float = 1.0,
    limit: int | None = None,
) -> Trace:
    """Read a Mooncake or plain JSONL trace; arrivals are divided by ``speedup``."""
    if speedup <= 0:
        raise TraceError(f"speedup must be positive, got {speedup}")
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    hasher = BlockHasher(block_size)
    sessions = _Sessions()
    requests: list[TraceRequest] = []
    for lineno, obj in _read_lines(path):
        if limit is not None and len(requests) >= limit:
            break
        where = f"{path}:{lineno}"
        if "hash_ids" in obj:
            req = _mooncake(obj, where, len(requests), seed, sessions)
            tokens = mooncake_tokens(req.hash_ids or [], req.input_len, req.line, seed).tobytes()
        else:
            req = _plain(obj, where)
            tokens = array("I", req.token_ids or []).tobytes()
        req.arrival_ms /= speedup
        req.router_hashes = array("Q", hasher.hash_tokens(tokens))
        req.engine_hashes = array("Q", engine_block_hashes(tokens, block_size, engine_seed))
        requests.append(req)
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    requests.sort(key=lambda r: r.arrival_ms)  # stable: equal times keep file order
    return Trace(name=path.name, block_size=block_size, seed=seed, requests=requests)


def _mooncake(
    obj: dict[str, Any], where: str, index: int, seed: int, sessions: _Sessions
) -> TraceRequest:
    input_len = _int(obj, "input_length", where)
    output_len = _int(obj, "output_length", where)
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of non-negative integers")
    if input_len == 0 or len(hash_ids) != -(-input_len // MOONCAKE_BLOCK):
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids do not cover input_length {input_len} "
            f"in blocks of {MOONCAKE_BLOCK}"
        )
    session = obj.get("session_id")
    return TraceRequest(
        arrival_ms=_number(obj, "timestamp", where),
        input_len=input_len,
        output_len=max(1, output_len),
        session=sessions.key(hash_ids, input_len) if session is None else str(session),
        router_hashes=array("Q"),
        engine_hashes=array("Q"),
        hash_ids=hash_ids,
        line=index,
    )


def _plain(obj: dict[str, Any], where: str) -> TraceRequest:
    if "token_ids" in obj:
        tokens = obj["token_ids"]
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens
        ):
            raise TraceError(f"{where}: 'token_ids' must be a list of u32 integers")
    elif isinstance(obj.get("text"), str):
        tokens = list(obj["text"].encode())
    else:
        raise TraceError(f"{where}: expected 'hash_ids', 'token_ids' or 'text'")
    if not tokens:
        raise TraceError(f"{where}: empty prompt")
    session = obj.get("session_id")
    return TraceRequest(
        arrival_ms=_number(obj, "timestamp", where),
        input_len=len(tokens),
        output_len=max(1, _int(obj, "output_length", where, DEFAULT_OUTPUT)),
        session=None if session is None else str(session),
        router_hashes=array("Q"),
        engine_hashes=array("Q"),
        token_ids=tokens,
    )


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every trace command (replay, forecast, tune) reads its trace with."""
    parser.add_argument("--trace", required=True, help="Mooncake or plain JSONL trace file")
    parser.add_argument("--block-size", type=int, default=64, help="engine page size (tokens)")
    parser.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by X")
    parser.add_argument("--seed", type=int, default=0, help="token synthesis and policy RNG")
    parser.add_argument("--limit", type=int, help="only the first N requests")


def trace_from(args: argparse.Namespace) -> Trace:
    """The trace ``add_trace_arguments``' flags name; TraceError when it cannot be read."""
    return load_trace(
        args.trace,
        args.block_size,
        seed=args.seed,
        engine_seed=args.seed,
        speedup=args.speedup,
        limit=args.limit,
    )
