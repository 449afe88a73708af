"""Benchmark of the prefix index: hashing, match, ingest and memory, side by side with
Dynamo's Rust ``RadixTree`` (``ai-dynamo-runtime``) when it is importable.

Prints one JSON object. Both indexes get the same data in the same process:

- the same (block, worker) stores, as 16-block ``BlockStored`` events: ours as msgpack
  ``EventBatch`` bytes (``index.codec.encode``) fed to ``EventIngest.apply``, Dynamo's as
  its ``apply_event`` JSON; each side's timing includes decoding its own wire form;
- the same 32K-token (512-block) queries: ours as router hashes (``BlockHasher``), Dynamo's
  as its own local block hashes (``compute_block_hash_for_seq`` of the same tokens);
- warm-up first, then several repetitions, medians reported; the two sides alternate.

The answers are compared query by query (``dynamo.agree``), which proves the data match.

``--engine-hashes sha256`` publishes our side's events as a default vLLM 0.32 does: each
block hash the 32-byte sha256 of its content, ``extra_keys`` one ``None`` per block.
Dynamo's side keeps its u64 hashes (its engine integrations convert before publishing),
so the ratio is each router on what it is sent.

Run: ``python bench/index.py [--quick]`` (see bench/README.md).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import random
import statistics
import sys
import time
import tracemalloc
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

# This script shares its name with the ``index`` package it measures: take its own folder
# off the import path so ``import index`` finds the package, checkout first.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]
sys.path.insert(0, str(_ROOT))

from index import (  # noqa: E402
    BlockHasher,
    BlockStored,
    EventBatch,
    EventIngest,
    PrefixIndex,
    encode,
)
from index.backend import NativePrefixIndex, make_ingest  # noqa: E402

# The index under test (--index): the native core when built, else the Python one.
INDEX: type = NativePrefixIndex or PrefixIndex

os.environ.setdefault("DYN_LOG", "error")  # Dynamo logs every skipped store otherwise
try:
    from dynamo._core import RadixTree, compute_block_hash_for_seq
except ImportError:  # optional baseline: the bench must run without it
    RadixTree = compute_block_hash_for_seq = None

BLOCK = 64
PROMPT_BLOCKS = 512  # a 32K-token prompt
EVENT_BLOCKS = 16
SYSTEM_BLOCKS = 24  # a 1.5K-token system prompt every worker holds
VOCAB = 128_000
MASK64 = (1 << 64) - 1
_MEDIUM = {"gpu": "GPU", "cpu": "CPU", "disk": "DISK"}


# -- the data set -------------------------------------------------------------------------


@dataclass(slots=True)
class Store:
    """One BlockStored event: ``worker`` now holds ``blocks`` (a chain piece) in ``tier``."""

    worker: int
    blocks: list[int]
    parent: int | None  # block id of the parent, None at the root
    tier: str


@dataclass(slots=True)
class Query:
    tokens: np.ndarray  # PROMPT_BLOCKS * BLOCK token ids
    kind: str


@dataclass(slots=True)
class Dataset:
    tokens: np.ndarray  # (blocks, BLOCK) uint32, row = block id
    stores: list[Store]
    queries: list[Query]
    pairs: int
    tiers: dict[str, int]

    def engine_hash(self, block: int) -> int:
        """A content-like engine hash: the same block has the same hash on every worker."""
        return (block + 1) * 0x9E37_79B9_7F4A_7C15 & MASK64


class _Builder:
    """Grows a forest of prefix chains and the per-worker stores that cover them.

    Shape: every worker holds the shared system prompt; conversations and documents
    branch off it (or off earlier chains: multi-turn, same document new question) with
    log-uniform depths up to a full prompt; one primary holder per chain (usually the
    holder of the chain it continues) plus sometimes replicas holding a shorter prefix;
    tails sometimes offloaded to CPU or disk.
    """

    def __init__(self, workers: int, rng: random.Random, nrng: np.random.Generator) -> None:
        self.workers = workers
        self.rng = rng
        self.nrng = nrng
        self.parent: list[int] = []
        self.chains: list[tuple[list[int], int]] = []  # (chain, primary worker)
        self.held: list[set[int]] = [set() for _ in range(workers)]
        self.stores: list[Store] = []
        self.tiers = {"gpu": 0, "cpu": 0, "disk": 0}

    def fresh(self, prefix: list[int], depth: int) -> list[int]:
        chain = list(prefix)
        while len(chain) < depth:
            self.parent.append(chain[-1] if chain else -1)
            chain.append(len(self.parent) - 1)
        return chain

    def hold(self, worker: int, chain: list[int], depth: int) -> None:
        """``worker`` caches ``chain[:depth]``; emit events for the blocks it lacked."""
        held = self.held[worker]
        start = 0
        while start < depth and chain[start] in held:
            start += 1
        if start == depth:
            return
        u = self.rng.random()
        gpu_end = cpu_end = depth
        if u > 0.7:  # offloaded tail
            gpu_end = self.rng.randint(start, depth)
            cpu_end = depth if u < 0.9 else self.rng.randint(gpu_end, depth)
        for lo, hi, tier in (
            (start, gpu_end, "gpu"),
            (gpu_end, cpu_end, "cpu"),
            (cpu_end, depth, "disk"),
        ):
            for i in range(lo, hi, EVENT_BLOCKS):
                piece = chain[i : min(hi, i + EVENT_BLOCKS)]
                self.stores.append(Store(worker, piece, chain[i - 1] if i else None, tier))
                self.tiers[tier] += len(piece)
        held.update(chain[start:depth])

    def grow(self, target_blocks: int) -> None:
        rng = self.rng
        system = self.fresh([], SYSTEM_BLOCKS)
        for w in range(self.workers):
            self.hold(w, system, SYSTEM_BLOCKS)
        # A few long documents several workers hold in full: the deepest matches.
        for _ in range(4):
            chain = self.fresh(system, PROMPT_BLOCKS)
            holders = rng.sample(range(self.workers), min(3, self.workers))
            for w in holders:
                self.hold(w, chain, PROMPT_BLOCKS)
            self.chains.append((chain, holders[0]))
        while len(self.parent) < target_blocks:
            u = rng.random()
            primary = rng.randrange(self.workers)
            if u < 0.5:
                base, base_primary = rng.choice(self.chains)
                prefix = base[: rng.randint(1, len(base))]
                if rng.random() < 0.6:
                    primary = base_primary  # the router sent the conversation back
            elif u < 0.9:
                prefix = system
            else:
                prefix = []
            depth = round(math.exp(rng.uniform(math.log(8), math.log(PROMPT_BLOCKS))))
            depth = min(PROMPT_BLOCKS, max(depth, len(prefix) + rng.randint(1, 32)))
            if depth <= len(prefix):
                continue
            chain = self.fresh(prefix, depth)
            self.chains.append((chain, primary))
            self.hold(primary, chain, depth)
            if rng.random() < 0.35:
                others = [w for w in range(self.workers) if w != primary]
                for w in rng.sample(others, min(len(others), rng.randint(1, 3))):
                    self.hold(w, chain, rng.randint(max(1, len(prefix)), depth))

    def queries(self, count: int, tokens: np.ndarray) -> list[Query]:
        """512-block prompts: a cached prefix of some depth, then never-seen blocks."""
        rng = self.rng
        # The tail after the first new block is never matched by anyone, so all queries
        # share one pool of tail blocks; each gets its own first new block.
        tail = self.nrng.integers(0, VOCAB, size=(PROMPT_BLOCKS, BLOCK), dtype=np.uint32)
        out = []
        for _ in range(count):
            u = rng.random()
            if u < 0.05:
                chain, kind = self.chains[rng.randrange(4)][0], "full_hit"
            elif u < 0.15:
                chain, kind = [], "cold"
            elif u < 0.3:
                chain, kind = self.chains[0][0][:SYSTEM_BLOCKS], "system_prompt"
            else:
                chain = rng.choice(self.chains)[0]
                if rng.random() < 0.5:
                    chain = chain[: rng.randint(1, len(chain))]
                kind = "continue"
            rows = [tokens[chain]] if chain else []
            new = PROMPT_BLOCKS - len(chain)
            if new:
                first = self.nrng.integers(0, VOCAB, size=(1, BLOCK), dtype=np.uint32)
                rows += [first, tail[: new - 1]]
            out.append(Query(np.concatenate(rows).ravel(), kind))
        return out


def build_dataset(blocks: int, workers: int, queries: int, seed: int) -> Dataset:
    builder = _Builder(workers, random.Random(seed), np.random.default_rng(seed))
    builder.grow(blocks)
    n = len(builder.parent)
    tokens = builder.nrng.integers(0, VOCAB, size=(n, BLOCK), dtype=np.uint32)
    pairs = sum(len(h) for h in builder.held)
    return Dataset(
        tokens=tokens,
        stores=builder.stores,
        queries=builder.queries(queries, tokens),
        pairs=pairs,
        tiers=builder.tiers,
    )


# -- wire forms ---------------------------------------------------------------------------


def worker_name(worker: int) -> str:
    return f"worker-{worker}"


def sha256_hash(block: int) -> bytes:
    """vLLM's default engine hash form: 32 bytes, the same block the same on every worker."""
    return hashlib.sha256(block.to_bytes(8, "little")).digest()


def our_batches(data: Dataset, engine_hashes: str = "u64") -> list[tuple[str, int, bytes]]:
    """(worker, seq, msgpack EventBatch) per store, as the engine would publish them."""
    seqs = [0] * (max(s.worker for s in data.stores) + 1)
    vllm = engine_hashes == "sha256"
    name: Callable[[int], int | bytes] = sha256_hash if vllm else data.engine_hash
    out = []
    for s in data.stores:
        event = BlockStored(
            block_hashes=[name(b) for b in s.blocks],
            parent_block_hash=None if s.parent is None else name(s.parent),
            token_ids=data.tokens[s.blocks].ravel().tolist(),
            block_size=BLOCK,
            medium=_MEDIUM[s.tier],
            extra_keys=[None] * len(s.blocks) if vllm else None,
        )
        payload = encode(EventBatch(ts=time.time(), events=[event]))
        out.append((worker_name(s.worker), seqs[s.worker], payload))
        seqs[s.worker] += 1
    return out


def dynamo_local_hashes(tokens: np.ndarray) -> list[int]:
    """Dynamo's local hash of every block (row); chunked to bound the list it needs."""
    out: list[int] = []
    for lo in range(0, len(tokens), 4096):
        out += compute_block_hash_for_seq(tokens[lo : lo + 4096].ravel().tolist(), BLOCK)
    return out


def dynamo_events(data: Dataset, local: list[int]) -> list[tuple[int, bytes]]:
    """(worker, apply_event JSON) per store; Dynamo's events carry hashes, not tokens."""
    seqs = [0] * (max(s.worker for s in data.stores) + 1)
    out = []
    for s in data.stores:
        stored = {
            "parent_hash": None if s.parent is None else data.engine_hash(s.parent),
            "blocks": [
                {"block_hash": data.engine_hash(b), "tokens_hash": local[b]} for b in s.blocks
            ],
        }
        event = {"event_id": seqs[s.worker], "data": {"stored": stored}}
        out.append((s.worker, json.dumps(event).encode()))
        seqs[s.worker] += 1
    return out


# -- measuring ----------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    rank = max(0, math.ceil(q / 100 * len(sorted_values)) - 1)
    return sorted_values[rank]


def rate(fn: Callable[[], object], units: float, reps: int) -> float:
    """Units per second of ``fn``: median of ``reps`` timed calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return units / statistics.median(times)


def bench_hash(reps: int) -> dict[str, Any]:
    ids = np.random.default_rng(1).integers(0, VOCAB, PROMPT_BLOCKS * BLOCK, dtype=np.uint32)
    as_list = ids.tolist()
    as_array = array("I", ids.tobytes())
    hasher = BlockHasher(BLOCK)
    n = len(as_list)
    out: dict[str, Any] = {
        "prompt_tokens": n,
        "ours_list_mtok_s": rate(lambda: hasher.hash_tokens(as_list), n, reps) / 1e6,
        "ours_array_mtok_s": rate(lambda: hasher.hash_tokens(as_array), n, reps) / 1e6,
    }
    if compute_block_hash_for_seq is not None:
        dyn = rate(lambda: compute_block_hash_for_seq(as_list, BLOCK), n, reps)
        out["dynamo_list_mtok_s"] = dyn / 1e6
    return out


def ingest_ours(batches: list[tuple[str, int, bytes]]) -> tuple[float, EventIngest]:
    ingest = make_ingest(INDEX(), BlockHasher(BLOCK))
    apply = ingest.apply
    t0 = time.perf_counter()
    for worker, seq, payload in batches:
        apply(worker, seq, payload)
    return time.perf_counter() - t0, ingest


def ingest_dynamo(events: list[tuple[int, bytes]]) -> tuple[float, Any]:
    tree = RadixTree()
    apply = tree.apply_event
    t0 = time.perf_counter()
    for worker, payload in events:
        apply(worker, payload)  # synchronous: a bad event raises here
    return time.perf_counter() - t0, tree


@dataclass(slots=True)
class IngestRuns:
    ours: list[float]
    dynamo: list[float]
    ingest: EventIngest
    tree: Any
    dynamo_rss: int  # RSS growth while Dynamo's tree was built (approximate)


def time_ingest(
    batches: list[tuple[str, int, bytes]], events: list[tuple[int, bytes]] | None, reps: int
) -> IngestRuns:
    """Warm both sides up on a slice, then alternate which side runs first."""
    warm = max(1, len(batches) // 20)
    ingest_ours(batches[:warm])
    if events is not None:
        ingest_dynamo(events[:warm])
    ours: list[float] = []
    dynamo: list[float] = []
    ingest, tree, dynamo_rss = None, None, 0
    for rep in range(reps):
        for side in ("dynamo", "ours") if rep % 2 else ("ours", "dynamo"):
            if side == "ours":
                ingest = None  # free the previous run's index before timing the next
                gc.collect()
                t, ingest = ingest_ours(batches)
                ours.append(t)
            elif events is not None:
                tree = None
                gc.collect()
                rss = rss_bytes()
                t, tree = ingest_dynamo(events)
                dynamo_rss = rss_bytes() - rss
                dynamo.append(t)
    if ingest is None or ingest.errors or ingest.batches_applied != len(batches) or ingest.gaps:
        raise SystemExit(f"ingest did not apply cleanly: {ingest and dict(ingest.errors)}")
    return IngestRuns(ours, dynamo, ingest, tree, dynamo_rss)


def time_matches(
    calls: dict[str, Callable[[int], object]], kinds: list[str], reps: int
) -> dict[str, dict[str, float]]:
    """p50/p99 latency per call over all queries, and p50 of the full 512-block hits.

    One pass over all queries per call, the calls' order rotated each repetition: a call
    never runs on CPU caches its predecessor warmed with the same query. One warm-up
    pass over a tenth of the queries first; the median of the passes is reported.
    """
    n = len(kinds)
    names = list(calls)
    for name in names:
        for i in range(max(1, n // 10)):
            calls[name](i)
    full = [i for i, k in enumerate(kinds) if k == "full_hit"]
    passes: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            call = calls[name]
            ns = [0] * n
            for i in range(n):
                t0 = clock()
                call(i)
                ns[i] = clock() - t0
            ordered = sorted(ns)
            stats = {
                "p50_us": percentile(ordered, 50) / 1e3,
                "p99_us": percentile(ordered, 99) / 1e3,
            }
            if full:
                stats["full_hit_p50_us"] = statistics.median(ns[i] for i in full) / 1e3
            passes[name].append(stats)
    return {
        name: {k: statistics.median(p[k] for p in runs) for k in runs[0]}
        for name, runs in passes.items()
    }


def router_hashes(data: Dataset, hasher: BlockHasher) -> list[int]:
    """Our hash of every stored block (a parent is stored before its children)."""
    out = [0] * len(data.tokens)
    for s in data.stores:
        parent = None if s.parent is None else out[s.parent]
        keys = hasher.hash_tokens(data.tokens[s.blocks].tobytes(), parent=parent)
        for b, h in zip(s.blocks, keys, strict=True):
            out[b] = h
    return out


def index_memory(data: Dataset, hasher: BlockHasher) -> tuple[int, int]:
    """(bytes, blocks) the PrefixIndex alone retains after every store.

    Keys are hashed while tracing so their int objects are counted, as in real use.
    """
    router = router_hashes(data, hasher)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = INDEX()
    for s in data.stores:
        parent = None if s.parent is None else router[s.parent]
        keys = hasher.hash_tokens(data.tokens[s.blocks].tobytes(), parent=parent)
        index.store(worker_name(s.worker), keys, s.tier, parent=parent)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    # tracemalloc sees Python's allocator only; the native core counts its own heap.
    native = sum(core.bytes()[0] for core in getattr(index, "cores", ()))
    return used + native, len(index)


def ingest_memory(batches: list[tuple[str, int, bytes]]) -> int:
    """Bytes the whole ingest keeps: the index plus the per-worker engine-hash maps."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    _, ingest = ingest_ours(batches)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    index = ingest.index
    native = index.memory_bytes() if hasattr(index, "memory_bytes") else 0
    del ingest, index
    return used + native


def dynamo_hash_seconds(data: Dataset) -> float:
    """What hashing the stored tokens costs Dynamo (its engine-side publisher does it)."""
    total = 0.0
    for s in data.stores:
        ids = data.tokens[s.blocks].ravel().tolist()
        t0 = time.perf_counter()
        compute_block_hash_for_seq(ids, BLOCK)
        total += time.perf_counter() - t0
    return total


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- the run ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    data = build_dataset(args.blocks, args.workers, args.queries, args.seed)
    hasher = BlockHasher(BLOCK)
    batches = our_batches(data, args.engine_hashes)
    q_ours = [hasher.hash_tokens(q.tokens.tobytes()) for q in data.queries]
    kinds = [q.kind for q in data.queries]
    have_dynamo = RadixTree is not None
    events = q_dyn = None
    if have_dynamo:
        events = dynamo_events(data, dynamo_local_hashes(data.tokens))
        q_dyn = [compute_block_hash_for_seq(q.tokens.tolist(), BLOCK) for q in data.queries]

    runs = time_ingest(batches, events, args.reps)
    index, tree = runs.ingest.index, runs.tree
    bisect_at = index.bisect_min_blocks
    linear_at = PROMPT_BLOCKS + 1  # workers with holes take the linear walk: time it for all

    def match(i: int, limit: int = bisect_at) -> object:
        index.bisect_min_blocks = limit
        return index.match(q_ours[i])

    def match_tiers(i: int) -> object:
        index.bisect_min_blocks = bisect_at
        return index.match_tiers(q_ours[i])

    calls: dict[str, Callable[[int], object]] = {
        "match": match,
        "match_tiers": match_tiers,
        "match_linear": lambda i: match(i, linear_at),
    }
    if have_dynamo:
        calls["dynamo"] = lambda i: tree.find_matches(q_dyn[i]).scores
    lat = time_matches(calls, kinds, args.reps)
    index.bisect_min_blocks = bisect_at
    depths = [max(index.match(q).values(), default=0) for q in q_ours]

    ours_s = statistics.median(runs.ours)
    index_bytes, blocks = index_memory(data, hasher)
    out: dict[str, Any] = {
        "config": {
            "block_size": BLOCK,
            "prompt_blocks": PROMPT_BLOCKS,
            "blocks_per_event": EVENT_BLOCKS,
            "workers": args.workers,
            "queries": len(q_ours),
            "reps": args.reps,
            "index_blocks": len(index),
            "pairs": data.pairs,
            "store_events": len(batches),
            "tier_pairs": data.tiers,
            "query_kinds": dict(Counter(kinds)),
            "mean_match_depth_blocks": statistics.mean(depths),
            "python": sys.version.split()[0],
            "index": INDEX.__name__,
            "engine_hashes": args.engine_hashes,
            "dynamo": metadata.version("ai-dynamo-runtime") if have_dynamo else None,
        },
        "hash": bench_hash(args.hash_reps),
        "match": lat["match"],
        "match_tiers": lat["match_tiers"],
        "match_linear": lat["match_linear"],
        "ingest": {"blocks_per_s": data.pairs / ours_s, "events_per_s": len(batches) / ours_s},
        "memory": {
            "index_bytes_per_block": index_bytes / blocks,
            "index_bytes_per_pair": index_bytes / data.pairs,
            "ingest_bytes_per_pair": ingest_memory(batches) / data.pairs,
        },
        "dynamo": None,
        "ratios": None,
    }
    if have_dynamo:
        out["dynamo"], out["ratios"] = compare(out, data, runs, lat["dynamo"], q_ours, q_dyn)
    out["config"]["wall_seconds"] = time.perf_counter() - t_start
    return out


def compare(
    out: dict[str, Any],
    data: Dataset,
    runs: IngestRuns,
    dyn_lat: dict[str, float],
    q_ours: list[list[int]],
    q_dyn: list[list[int]],
) -> tuple[dict[str, Any], dict[str, float]]:
    """Dynamo's numbers, and ours over Dynamo's (latency: < 1 is ours faster; rate: > 1)."""
    index, tree = runs.ingest.index, runs.tree
    mismatches = sum(
        index.match(q) != {worker_name(w): n for (w, _), n in tree.find_matches(qd).scores.items()}
        for q, qd in zip(q_ours, q_dyn, strict=True)
    )
    dyn_s = statistics.median(runs.dynamo)
    hash_s = dynamo_hash_seconds(data)
    dynamo = {
        "find_matches": dyn_lat,
        "ingest": {"blocks_per_s": data.pairs / dyn_s, "events_per_s": len(data.stores) / dyn_s},
        "ingest_with_hash": {"blocks_per_s": data.pairs / (dyn_s + hash_s)},
        "rss_bytes_per_pair_approx": runs.dynamo_rss / data.pairs,
        "agree": mismatches == 0,
        "mismatches": mismatches,
    }
    ours_rate = out["ingest"]["blocks_per_s"]
    ratios = {
        "match_p50_latency_ours_over_dynamo": out["match"]["p50_us"] / dyn_lat["p50_us"],
        "match_p99_latency_ours_over_dynamo": out["match"]["p99_us"] / dyn_lat["p99_us"],
        "match_tiers_p50_latency_ours_over_dynamo": out["match_tiers"]["p50_us"]
        / dyn_lat["p50_us"],
        "match_tiers_p99_latency_ours_over_dynamo": out["match_tiers"]["p99_us"]
        / dyn_lat["p99_us"],
        "match_linear_p50_latency_ours_over_dynamo": out["match_linear"]["p50_us"]
        / dyn_lat["p50_us"],
        "ingest_rate_ours_over_dynamo": ours_rate / dynamo["ingest"]["blocks_per_s"],
        "ingest_rate_ours_over_dynamo_with_hash": ours_rate
        / dynamo["ingest_with_hash"]["blocks_per_s"],
        "hash_rate_ours_over_dynamo": out["hash"]["ours_list_mtok_s"]
        / out["hash"]["dynamo_list_mtok_s"],
    }
    return dynamo, ratios


_FULL = {"blocks": 200_000, "workers": 16, "queries": 1000, "reps": 5, "hash_reps": 50}
_QUICK = {"blocks": 3000, "workers": 4, "queries": 40, "reps": 2, "hash_reps": 3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, help="distinct blocks to store (default 200000)")
    p.add_argument("--workers", type=int, help="workers (default 16)")
    p.add_argument("--queries", type=int, help="512-block prompts to match (default 1000)")
    p.add_argument("--reps", type=int, help="timed repetitions, median reported (default 5)")
    p.add_argument("--hash-reps", type=int, help="timed hash calls (default 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    p.add_argument(
        "--engine-hashes",
        choices=("u64", "sha256"),
        default="u64",
        help="our events' block hashes: 64-bit ints, or 32-byte sha256s with vLLM 0.32's"
        " per-block extra_keys (a default vLLM)",
    )
    p.add_argument(
        "--index",
        choices=("native", "python"),
        default="native" if NativePrefixIndex is not None else "python",
        help="the index under test (default: native when built)",
    )
    args = p.parse_args(argv)
    # Explicit flags win over the preset.
    for name, value in (_QUICK if args.quick else _FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    global INDEX
    args = parse_args(argv)
    if args.index == "native" and NativePrefixIndex is None:
        raise SystemExit("--index native: the native core is not built (see README)")
    INDEX = NativePrefixIndex if args.index == "native" else PrefixIndex
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
