"""The router's own cost at real prompt lengths and event rates, beside Dynamo's index.

Prints one JSON object (never asserts). Sections:

- ``prompt``: per request, at 2K / 8K / 32K / 128K tokens: the tokenizer alone (a real
  tokenizer.json, ``--tokenizer``), then what the router adds on top (block hashes and
  the index match), CPU seconds per request; and whether tokenizing holds the GIL (a
  thread tokenizing a 128K prompt while the main thread counts: ``encode`` and
  ``encode_batch``, which the router uses).
- ``multi_turn``: a ChatML conversation growing to 32K tokens (``--tokenizer`` with
  ``<|im_start|>``/``<|im_end|>`` added as special tokens), CPU per turn of the router's
  chat tokenization (segment cache, router/tokens/tokenize.py) against ``encode`` of the
  whole rendered text, and the two checked equal.
- ``ingest``: KV-event ingest alone, ``EventIngest.apply`` on msgpack vLLM batches
  (16 blocks of 16 tokens each) with the Python and the native index, the native one
  also through ``apply_many`` in runs of 64 (``native_runs``: the router's live path),
  and Dynamo's ``RadixTree.apply_event`` on the same stores (its JSON form), blocks/s;
  batches lost (not applied and not reported) counted.
- ``under_ingest``: match p50/p99 on the main thread, event-free and while a plain
  thread applies batches at ``--rate`` blocks/s, one ``apply`` per batch: the native
  core's mutex and the GIL alone, without NATS or the event loop (``nats`` has those).
- ``nats``: the router's own event path (``Bus`` -> ``EventFeed`` -> ``EventSync`` ->
  ``IngestThread`` -> the native ingest), core NATS (read by nats-py and by the native
  reader, ``--nats-readers``, one after the other) and JetStream, a publisher process
  at each of ``--nats-rates`` (32K / 128K / 512K blocks/s): batches lost silently (not
  applied, the worker still "in sync") and detected, the ingest's lag, the catch-up
  after publishing, and a request's index part on the same event loop (arrivals from
  another process) p50/p99, event-free and under the events.
- ``memory``: bytes per (block, worker) pair at ``--pairs`` (or each ``--memory-pairs``)
  unshared pairs: the native core's own heap count and RSS growth; Dynamo's RSS growth
  on the same stores; each side in a fresh process.

- ``targets``: wide pools (issue 34), at each of ``--target-sizes`` (16, 64, 256, 1,024
  targets: nodes of 8 DP ranks) over a shared-prefix population (``population``: 16
  families of 2K-token prefixes, two 8K-32K-token conversations a target): the index's
  match (``match_tiers``, and ``pick``: the walk and the load board, the pruned path's one
  call) beside Dynamo's ``RadixTree.find_matches`` on the same holdings; the router's
  decision per request (``for_model`` + ``decide`` + ``hit_blocks``) pruned and unpruned
  on two identical routers for ``cache_aware``, ``least_load`` and ``dynamo_kv``, with how
  many of their decisions agree; ingest (``ingest`` above, at that many workers) and memory
  (``memory`` above); ratios of the largest size to the smallest. ``--target-baseline
  DIR``: another checkout's match and decision at each size beside ours, each in a child.

``--nats-pin`` (2+ CPUs) gives the router's process and the prober CPU 0, nats-server and
the publisher CPU 1: the router with a core of its own, as where the engines publish
from their own hosts, so its p99 under events is its own and not the publisher's time
slice (without it, every process shares both CPUs). The prober shares the router's CPU
because it takes each arrival's time before it writes: beside the publisher, its own
preemptions between the two counted as the router's (128K blocks/s, quiet machine: p99
830-1,641 us with the prober on CPU 1, 248-455 us on CPU 0; it costs the router's core
~2,000 short wakes a second).

``--engine-hashes sha256`` sends our side's events as a default vLLM 0.32 does (each
block hash a 32-byte sha256, ``extra_keys`` one ``None`` per block) in every section;
Dynamo's side keeps u64 hashes (its engine integrations convert before publishing).

Run (Dynamo comes from the ``baselines`` extra; a separate venv works):

    flock /work/bench.lock nice -n 5 python bench/scale.py --tokenizer PATH/tokenizer.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import math
import os
import random
import statistics
import struct
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]
sys.path.insert(0, str(_ROOT))

from index import BlockHasher, BlockStored, EventBatch, PrefixIndex, encode  # noqa: E402
from index.backend import NativePrefixIndex, make_ingest  # noqa: E402

os.environ.setdefault("DYN_LOG", "error")
try:
    from dynamo._core import RadixTree, compute_block_hash_for_seq
except ImportError:  # optional baseline
    RadixTree = compute_block_hash_for_seq = None

BLOCK = 16
EVENT_BLOCKS = 16
VOCAB = 32_000
LENGTHS = (2048, 8192, 32768, 131072)
RUN = 64  # batches per native call in the ``native_runs`` ingest (router/events/ingest_thread.py)
ENGINE_HASHES = "u64"  # --engine-hashes: u64, or sha256 (a default vLLM's bytes hashes)
PIN = False  # --nats-pin: the router (and prober) on CPU 0, nats-server and publisher on CPU 1


def pin(cpu: int) -> None:
    """This thread (and the threads and processes it starts) on ``cpu``, with --nats-pin."""
    if PIN:
        os.sched_setaffinity(0, {cpu})


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


# -- the data: unshared chains, one per (worker, prompt) ------------------------------------


def stores(pairs: int, workers: int, chain: int, seed: int) -> list[tuple[int, np.ndarray]]:
    """(worker, tokens) per 16-block event; each worker's chains are its own."""
    rng = np.random.default_rng(seed)
    per_event = EVENT_BLOCKS * BLOCK
    n_events = pairs // EVENT_BLOCKS
    tokens = rng.integers(0, VOCAB, size=(n_events, per_event), dtype=np.uint32)
    per_chain = chain // EVENT_BLOCKS
    return [((i // per_chain) % workers, tokens[i]) for i in range(n_events)]


def our_batches(data: list[tuple[int, np.ndarray]], chain: int) -> list[tuple[str, int, bytes]]:
    per_chain = chain // EVENT_BLOCKS
    seqs: dict[int, int] = {}
    out = []
    next_hash = 1
    parent: int | bytes | None = None
    for i, (w, toks) in enumerate(data):
        if i % per_chain == 0:
            parent = None
        ids = range(next_hash, next_hash + EVENT_BLOCKS)
        next_hash += EVENT_BLOCKS
        hashes: list[int | bytes] = list(ids)
        extra: list[None] | None = None
        if ENGINE_HASHES == "sha256":
            hashes = [hashlib.sha256(h.to_bytes(8, "little")).digest() for h in ids]
            extra = [None] * EVENT_BLOCKS
        ev = BlockStored(hashes, parent, toks.tolist(), BLOCK, medium="GPU", extra_keys=extra)
        seq = seqs.get(w, 0)
        seqs[w] = seq + 1
        out.append((f"worker-{w}", seq, encode(EventBatch(float(i), [ev], None))))
        parent = hashes[-1]
    return out


def dynamo_batches(data: list[tuple[int, np.ndarray]], chain: int) -> list[tuple[int, bytes]]:
    per_chain = chain // EVENT_BLOCKS
    seqs: dict[int, int] = {}
    out = []
    next_hash = 1
    parent: int | None = None
    for i, (w, toks) in enumerate(data):
        if i % per_chain == 0:
            parent = None
        local = compute_block_hash_for_seq(toks.tolist(), BLOCK)
        hashes = list(range(next_hash, next_hash + EVENT_BLOCKS))
        next_hash += EVENT_BLOCKS
        stored = {
            "parent_hash": parent,
            "blocks": [
                {"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, local, strict=True)
            ],
        }
        seq = seqs.get(w, 0)
        seqs[w] = seq + 1
        out.append((w, json.dumps({"event_id": seq, "data": {"stored": stored}}).encode()))
        parent = hashes[-1]
    return out


# -- sections -------------------------------------------------------------------------------


def ingest_ours(
    index_cls: type, batches: list[tuple[str, int, bytes]], run: int = 1, names: bool = True
) -> tuple[float, Any]:
    """``apply`` batch by batch (``run`` 1), or ``apply_many`` in runs of ``run`` (the
    router's live path: router/events/ingest_thread.py hands queued batches over in runs).
    ``names``: keep the engines' bytes names (a router whose policies send prefetch hints)."""
    ingest = make_ingest(index_cls(), BlockHasher(BLOCK), keep_names=names)
    apply = ingest.apply
    lost = 0
    if run > 1:
        runs = [
            [(w, seq, p, None, None) for w, seq, p in batches[i : i + run]]
            for i in range(0, len(batches), run)
        ]
        t0 = time.perf_counter()
        for part in runs:
            lost += sum(r.applied != 1 for r in ingest.apply_many(part))
    else:
        t0 = time.perf_counter()
        for worker, seq, payload in batches:
            r = apply(worker, seq, payload)
            lost += r.applied != 1
    dt = time.perf_counter() - t0
    if lost or ingest.errors or ingest.gaps:
        raise SystemExit(f"ingest did not apply cleanly: {lost} {dict(ingest.errors)}")
    return dt, ingest


def bench_ingest(
    pairs: int, workers: int, chain: int, reps: int, python: bool = True
) -> dict[str, Any]:
    data = stores(pairs, workers, chain, 1)
    batches = our_batches(data, chain)
    out: dict[str, Any] = {
        "pairs": pairs,
        "batches": len(batches),
        "blocks_per_batch": EVENT_BLOCKS,
    }
    impls: dict[str, type] = {"python": PrefixIndex} if python else {}
    if NativePrefixIndex is not None:
        impls["native"] = NativePrefixIndex
    for name, cls in impls.items():
        times = []
        for _ in range(reps):
            gc.collect()
            t, ing = ingest_ours(cls, batches)
            times.append(t)
            del ing
        _rates(out, name, pairs, times)
    if NativePrefixIndex is not None:
        times = []
        for _ in range(reps):
            gc.collect()
            t, ing = ingest_ours(NativePrefixIndex, batches, RUN)
            times.append(t)
            del ing
        impls["native_runs"] = NativePrefixIndex
        _rates(out, "native_runs", pairs, times)
        out["native_runs_batches_per_call"] = RUN
    out["lost_batches"] = 0  # ingest_ours exits unless every batch was applied
    if RadixTree is not None:
        dyn = dynamo_batches(data, chain)
        times = []
        for _ in range(reps):
            gc.collect()
            tree = RadixTree()
            t0 = time.perf_counter()
            for w, payload in dyn:
                tree.apply_event(w, payload)
            times.append(time.perf_counter() - t0)
            del tree
        _rates(out, "dynamo", pairs, times)
        for name in impls:
            for kind in ("", "_best"):
                out[f"ratio_{name}_over_dynamo{kind}"] = (
                    out[f"{name}_blocks_per_s{kind}"] / out[f"dynamo_blocks_per_s{kind}"]
                )
    return out


def _rates(out: dict[str, Any], name: str, pairs: int, times: list[float]) -> None:
    """The median rate, the best one and each repetition's. Dynamo's ``RadixTree`` runs in
    two modes from one fresh tree to the next in the same process (session 8, load 0.4-0.7:
    0.21, 2.51, 0.26, 2.18 M blocks/s in turn, every event applied each time), so a median
    of three follows the parity of the repetitions; ``_best`` compares the fast runs."""
    out[f"{name}_blocks_per_s"] = pairs / statistics.median(times)
    out[f"{name}_blocks_per_s_best"] = pairs / min(times)
    out[f"{name}_blocks_per_s_reps"] = [round(pairs / t) for t in times]


def memory_side(side: str, pairs: int, workers: int, chain: int) -> dict[str, float]:
    """One side's bytes per pair, in this (fresh) process: RSS growth while it ingests."""
    data = stores(pairs, workers, chain, 2)
    if side in ("native", "native_no_names"):
        batches = our_batches(data, chain)
        del data
        gc.collect()
        before = rss()
        _, ing = ingest_ours(NativePrefixIndex, batches, names=side == "native")
        grown = rss() - before
        index_bytes = sum(core.bytes()[0] for core in ing.index.cores)
        maps_bytes = sum(core.bytes()[1] for core in ing.index.cores)
        return {
            f"{side}_heap_bytes_per_pair": (index_bytes + maps_bytes) / pairs,
            f"{side}_index_heap_bytes_per_pair": index_bytes / pairs,
            f"{side}_maps_heap_bytes_per_pair": maps_bytes / pairs,
            f"{side}_rss_bytes_per_pair": grown / pairs,
        }
    dyn = dynamo_batches(data, chain)
    del data
    gc.collect()
    before = rss()
    tree = RadixTree()
    for w, payload in dyn:
        tree.apply_event(w, payload)
    return {"dynamo_rss_bytes_per_pair": (rss() - before) / pairs}


def bench_memory(pairs: int, workers: int, chain: int) -> dict[str, Any]:
    # Each side in a fresh process: measured in this one, after the other sections (or
    # the other side) freed their heap, Dynamo's allocations reuse those pages and its
    # RSS growth reads low (57 B a pair against 89 B in a fresh process, 1M pairs).
    out: dict[str, Any] = {"pairs": pairs, "workers": workers, "fresh_process_each": True}
    # bytes names (sha256) are kept only by a router whose policies send prefetch hints,
    # which Dynamo has none of: both sides of ours against it
    ours = ["native", "native_no_names"] if ENGINE_HASHES == "sha256" else ["native"]
    candidates = [*((s, NativePrefixIndex) for s in ours), ("dynamo", RadixTree)]
    sides = [s for s, ok in candidates if ok]
    for side in sides:
        cmd = [sys.executable, __file__, "--memory-side", side, "--pairs", str(pairs)]
        cmd += ["--engine-hashes", ENGINE_HASHES]
        cmd += ["--workers", str(workers)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
        out.update(json.loads(done.stdout))
    for side in ours:
        if f"{side}_rss_bytes_per_pair" in out and "dynamo_rss_bytes_per_pair" in out:
            out[f"ratio_{side}_over_dynamo_rss"] = (
                out[f"{side}_rss_bytes_per_pair"] / out["dynamo_rss_bytes_per_pair"]
            )
    return out


def memory_at(sizes: list[int], workers: int) -> dict[str, Any] | list[dict[str, Any]]:
    memory = [bench_memory(n, workers, 512) for n in sizes]
    return memory[0] if len(memory) == 1 else memory


def bench_under_ingest(rate: float, seconds: float, workers: int) -> dict[str, Any]:
    """Match latency on the main thread, with and without an ingest thread at ``rate``."""
    if NativePrefixIndex is None:
        return {}
    chain = 512
    pairs = int(rate * seconds) + EVENT_BLOCKS * 64
    data = stores(pairs, workers, chain, 3)
    batches = our_batches(data, chain)
    warm, live = batches[:64], batches[64:]
    ingest = make_ingest(NativePrefixIndex(), BlockHasher(BLOCK))
    for w, s, p in warm:
        ingest.apply(w, s, p)
    hasher = BlockHasher(BLOCK)
    prompt = np.concatenate([t for _, t in data[:32]]).tolist()  # 8K tokens held by worker 0
    query = hasher.hash_tokens(prompt)

    def lat(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            ingest.index.match_tiers(query)
            out.append((time.perf_counter_ns() - t0) / 1e3)
            time.sleep(0.0005)
        return out

    idle = lat(2000)
    stop = threading.Event()
    applied = [0]

    def feed() -> None:
        per_batch = EVENT_BLOCKS / rate
        start = time.perf_counter()
        for i, (w, s, p) in enumerate(live):
            if stop.is_set():
                break
            delay = start + i * per_batch - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            ingest.apply(w, s, p)
            applied[0] += 1

    t = threading.Thread(target=feed)
    t0 = time.perf_counter()
    t.start()
    busy = lat(2000)
    stop.set()
    t.join()
    achieved = applied[0] * EVENT_BLOCKS / (time.perf_counter() - t0)
    return {
        "target_blocks_per_s": rate,
        "achieved_blocks_per_s": achieved,
        "match_8k_idle_p50_us": pct(idle, 50),
        "match_8k_idle_p99_us": pct(idle, 99),
        "match_8k_under_ingest_p50_us": pct(busy, 50),
        "match_8k_under_ingest_p99_us": pct(busy, 99),
        "p99_ratio_under_ingest_over_idle": pct(busy, 99) / pct(idle, 99),
    }


# -- wide pools: match, ingest, memory and the decision at 16 to 1,024 targets --------------

TARGET_SIZES = (16, 64, 256, 1024)
DP = 8  # data-parallel ranks per node: 1,024 targets are 128 nodes x 8
FAMILIES = 16  # shared prefixes (system prompts, documents) over the pool
FAMILY_TOKENS = 2048
PROMPT_TOKENS = (8192, 32768)  # a conversation's context, uniform in [lo, hi)
TARGET_POLICIES = ("cache_aware", "least_load", "dynamo_kv")


def population(
    n: int, block: int, seed: int
) -> tuple[list[tuple[int, list[int]]], list[tuple[list[int], int, str]]]:
    """Holdings and requests over ``n`` targets: ``FAMILIES`` shared prefixes, two
    conversations of 8K-32K tokens per target (each a family's prefix and its own
    context, held whole by its home target, its prefix alone by two more), and 64
    requests: a held conversation's next turn (8 new blocks), or 1 in 4 a new
    conversation of a family. Hashes are random u64s chained by construction."""
    rng = random.Random(seed)
    fam = [[rng.getrandbits(63) for _ in range(FAMILY_TOKENS // block)] for _ in range(FAMILIES)]
    held: list[tuple[int, list[int]]] = []
    convs: list[tuple[list[int], int]] = []
    for c in range(2 * n):
        f = fam[rng.randrange(FAMILIES)]
        ntok = rng.randrange(*PROMPT_TOKENS)
        chain = f + [rng.getrandbits(63) for _ in range((ntok - FAMILY_TOKENS) // block)]
        held.append((c % n, chain))
        held.extend((rng.randrange(n), f) for _ in range(2))
        convs.append((chain, ntok))
    requests = []
    for i in range(64):
        if i % 4 == 3:
            f = fam[rng.randrange(FAMILIES)]
            ntok = rng.randrange(*PROMPT_TOKENS)
            chain = f + [rng.getrandbits(63) for _ in range((ntok - FAMILY_TOKENS) // block)]
        else:
            chain, ntok = convs[rng.randrange(len(convs))]
            chain = chain + [rng.getrandbits(63) for _ in range(8)]
            ntok += 8 * block
        requests.append((chain, ntok, f"s{i}"))
    return held, requests


def target_router(n: int, block: int, policy: str, seed: int) -> tuple[Any, list[Any]]:
    """A router over ``n // DP`` nodes of ``DP`` ranks holding ``population``, loads
    set (flights of random prefill on each rank, engine reports), and its requests
    prepared; the policy's random draws seeded."""
    from policies.base import RouteRequest
    from router.config import RouterConfig, WorkerSpec
    from router.http.app import RouterState
    from router.routing.decide import Parsed
    from router.workers.load import EngineLoad

    specs = [
        WorkerSpec(f"n{i}", f"http://127.0.0.1:{9000 + i}", model="m", dp_size=DP)
        for i in range(max(1, n // DP))
    ]
    cfg = RouterConfig(workers=specs, forecast_tracked=0, block_size=block, policy=policy)
    st = RouterState(cfg)
    router, reg = st.router, st.registry
    rng = random.Random(seed)
    held, requests = population(n, block, seed)
    targets = [t for w in reg for t in w.targets]
    pool = next(iter(reg)).pool
    for t, chain in held:
        pool.index.store(targets[t], chain)
    for w in reg:
        w.load.report(EngineLoad(running=rng.randrange(16), waiting=rng.randrange(4)))
        for load in w.rank_loads:
            for _ in range(rng.randrange(4)):
                load.begin(rng.randrange(0, 16384))
    preps = []
    workers = reg.for_model("m")
    for i, (chain, ntok, _session) in enumerate(requests):
        parsed = Parsed("chat", {"model": "m"}, "m", False, None, f"r{i}", None)
        request = RouteRequest(f"r{i}", "m", ntok, chain, block)
        preps.append(router.prepared(parsed, workers, request))
    router.experiment.policy_for(preps[0].arm).rng = random.Random(seed)
    return st, preps


def _per_call(f: Any, items: list[Any], reps: int) -> float:
    """Microseconds a call of ``f`` over ``items``, best of ``reps`` passes."""
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        for x in items:
            f(x)
        best = min(best, time.perf_counter() - t0)
    return best / len(items) * 1e6


def tie_class(policy: str, views: list[Any], d: Any, tie_ms: float) -> set[str]:
    """The candidates the unpruned ``policy`` could have drawn (``d``: its decision)."""
    if policy == "least_load":
        lo = min((v.inflight_requests, v.inflight_prefill_tokens) for v in views)
        return {
            v.worker_id for v in views if (v.inflight_requests, v.inflight_prefill_tokens) == lo
        }
    if policy == "dynamo_kv":
        ranked = {w: s["logit"] for w, s in d.scores.items()}
    elif policy == "cache_aware":
        ranked = {
            w: s["ttft_ms"] + s["recompute_ms"]
            + (s["prefetch_risk_ms"] + tie_ms if s["prefetch_blocks"] else 0.0)
            for w, s in d.scores.items()
        }  # fmt: skip
    else:
        return {d.worker_id}
    lo = min(ranked.values()) + (tie_ms if policy == "cache_aware" else 0.0)
    return {w for w, r in ranked.items() if r <= lo}


def decide_at(n: int, block: int, policy: str, reps: int) -> dict[str, Any]:
    """The router's path per request (``for_model`` + ``decide`` + ``hit_blocks``), the
    pruned one and the unpruned one side by side on two identical routers, and how many
    of their decisions agree, each from the same policy state and draws (a difference is
    another draw from a tie the kept set holds in part, or a miss: router/routing/prune.py)."""
    from router.routing.decide import hit_blocks

    st, preps = target_router(n, block, policy, 7)
    full_st, full_preps = target_router(n, block, policy, 7)
    mine = st.router.experiment.policy_for(preps[0].arm)
    full_policy = full_st.router.experiment.policy_for(full_preps[0].arm)
    full_policy.prunable = lambda request: False  # type: ignore[method-assign]
    same = drawn = kept = 0
    tie_ms = getattr(full_policy, "tie_ms", 0.0)
    for p, q in zip(preps, full_preps, strict=True):
        # each decision from the same policy state (and draws) on both
        state = {k: v for k, v in vars(full_policy).items() if k != "prunable"}
        vars(mine).update(copy.deepcopy(state))
        d, views = st.router.decide(p)
        e, all_views = full_st.router.decide(q)
        kept = max(kept, len(views))
        if (d.worker_id, d.reason, d.prefetch) == (e.worker_id, e.reason, e.prefetch):
            same += 1
        elif d.worker_id in tie_class(policy, all_views, e, tie_ms):
            drawn += 1

    def path(router: Any, reg: Any) -> Any:
        def run(prep: Any) -> None:
            reg.for_model("m")
            d, v = router.decide(prep)
            hit_blocks(v, d)

        return run

    return {
        "pruned_us": _per_call(path(st.router, st.registry), preps, reps),
        "unpruned_us": _per_call(path(full_st.router, full_st.registry), full_preps, reps),
        "candidates": len(all_views),
        "kept_candidates_max": kept,
        "same_decisions": same,
        # another draw from the unpruned winner's tie class (the kept set held part of it)
        "same_tie_class": drawn,
        "missed": len(preps) - same - drawn,
        "decisions": len(preps),
    }


def match_at(n: int, block: int, reps: int) -> dict[str, Any]:
    """The index's match of every request (the unpruned path's ``match_tiers``; the
    pruned path's ``pick``, the walk and the load board in one call) and Dynamo's
    ``RadixTree.find_matches`` on the same holdings."""
    from index._native import LoadBoard

    st, preps = target_router(n, block, "least_load", 7)
    index = preps[0].pool.index
    board = LoadBoard()
    for w in st.registry:
        for tid, load in w.candidates:
            board.set(index.slot(tid), load.inflight_requests, load.inflight_prefill_tokens)
    hashes = [p.request.block_hashes for p in preps]
    out: dict[str, Any] = {
        "targets": n,
        "index_groups": len(index.cores),
        "holders_mean": statistics.mean(len(index.match_tiers(h)) for h in hashes),
        "match_tiers_us": _per_call(index.match_tiers, hashes, reps),
        "pick_us": _per_call(lambda h: index.pick(board, h, 4, 32), hashes, reps),
    }
    if hasattr(board, "least"):  # the min trees: a policy that weighs no hit (least_load)
        out["least_us"] = _per_call(lambda h: board.least(4, 32), hashes, reps)
        tid = next(iter(st.registry)).targets[0]
        out["match_of_us"] = _per_call(lambda h: index.match_of(tid, h), hashes, reps)
    if RadixTree is not None:
        tree = RadixTree()
        held, _ = population(n, block, 7)
        for seq, (t, chain) in enumerate(held):
            blocks = [{"block_hash": h, "tokens_hash": h} for h in chain]
            stored = {"parent_hash": None, "blocks": blocks}
            tree.apply_event(t, json.dumps({"event_id": seq, "data": {"stored": stored}}).encode())
        # its events apply on another thread: wait for the last one (bounded)
        last_t, last_chain = held[-1]
        deadline = time.monotonic() + 60
        while tree.find_matches(last_chain).scores.get((last_t, 0)) != len(last_chain):
            if time.monotonic() > deadline:
                raise SystemExit("Dynamo's RadixTree did not apply the stores within 60 s")
            time.sleep(0.05)
        out["dynamo_holders_mean"] = statistics.mean(
            len(tree.find_matches(h).scores) for h in hashes
        )
        out["dynamo_find_matches_us"] = _per_call(tree.find_matches, hashes, reps)
    return out


def baseline_targets(tree: str, n: int, block: int, reps: int) -> dict[str, Any]:
    """The checkout ``tree``'s own ``targets`` section at ``n`` targets (its match and
    decision, no ingest or memory), in a child process importing that tree first."""
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, str(Path(tree) / "bench" / "scale.py"), "--only", "targets",
           "--target-sizes", str(n), "--target-block", str(block), "--reps", str(reps),
           "--target-pairs", "0", "--target-memory-pairs", "0"]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
    row: dict[str, Any] = json.loads(done.stdout)["targets"]["by_size"][str(n)]
    row["tree"] = tree
    row["commit"] = subprocess.run(
        ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return row


def bench_targets(
    sizes: list[int],
    block: int,
    reps: int,
    pairs: int,
    memory_pairs: int,
    baseline: str | None = None,
) -> dict[str, Any]:
    """Each part at each size; ratios of the largest size to the smallest. ``baseline``:
    another checkout's match and decision at each size too (same machine, same minute:
    ``before`` and ``after`` side by side), each side in a fresh child process, in turn
    first (in this process ours ran after the sizes before it, on a larger heap)."""
    out: dict[str, Any] = {
        "sizes": sizes,
        "dp_ranks_per_node": DP,
        "block_size": block,
        "families": FAMILIES,
        "family_tokens": FAMILY_TOKENS,
        "prompt_tokens": list(PROMPT_TOKENS),
        "by_size": {},
    }
    if NativePrefixIndex is None:
        return out
    for i, n in enumerate(sizes):
        row: dict[str, Any]
        if baseline is None:
            row = {"match": match_at(n, block, reps)}
            row["decide"] = {p: decide_at(n, block, p, reps) for p in TARGET_POLICIES}
        else:  # both in a fresh child each, first one then the other in turn
            trees = [("baseline", baseline), ("ours", str(_ROOT))]
            runs = {
                name: baseline_targets(tree, n, block, reps)
                for name, tree in (trees if i % 2 == 0 else trees[::-1])
            }
            row = {k: runs["ours"][k] for k in ("match", "decide")}
            row["baseline"] = runs["baseline"]
        if pairs:
            row["ingest"] = bench_ingest(pairs, n, 512, reps, python=False)
        if memory_pairs:
            row["memory"] = bench_memory(memory_pairs, n, 512)
        out["by_size"][str(n)] = row
    lo, hi = out["by_size"][str(sizes[0])], out["by_size"][str(sizes[-1])]
    ratios: dict[str, float] = {}
    for key in ("match_tiers_us", "pick_us", "least_us", "match_of_us", "dynamo_find_matches_us"):
        if key in lo["match"]:
            ratios[f"match.{key}"] = hi["match"][key] / lo["match"][key]
    for p in TARGET_POLICIES:
        for key in ("pruned_us", "unpruned_us"):
            ratios[f"decide.{p}.{key}"] = hi["decide"][p][key] / lo["decide"][p][key]
        if "baseline" in hi:
            for key in ("pruned_us", "unpruned_us"):
                ratios[f"baseline.decide.{p}.{key}"] = (
                    hi["baseline"]["decide"][p][key] / lo["baseline"]["decide"][p][key]
                )
    out[f"ratio_{sizes[-1]}_over_{sizes[0]}"] = ratios
    return out


# -- the router's own event path: NATS -> EventSync -> the ingest thread ---------------------

NATS_RATES = (32_000, 128_000, 512_000)


def publish_side(url: str, rate: float, seconds: float, workers: int, warm: int) -> dict[str, Any]:
    """The engines' side, in its own process: ``warm`` batches at once, then (after a
    line on stdin) the rest at ``rate`` blocks/s, every batch with its ``Kv-Seq``."""
    import asyncio

    import nats

    from index.wire import EPOCH_HEADER, SEQ_HEADER, Subjects

    pairs = int(rate * seconds) + EVENT_BLOCKS * warm
    batches = our_batches(stores(pairs, workers, 512, 5), 512)
    subjects = Subjects()
    msgs = [(subjects.events(w), p, {SEQ_HEADER: str(s), EPOCH_HEADER: "e"}) for w, s, p in batches]

    async def run() -> dict[str, Any]:
        nc = await nats.connect(url, max_reconnect_attempts=0)
        for subject, payload, headers in msgs[:warm]:
            await nc.publish(subject, payload, headers=headers)
        await nc.flush()
        print(json.dumps({"warm": warm}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        live = msgs[warm:]
        per_tick = max(1, round(rate / EVENT_BLOCKS / 1000))  # batches per ms
        start = time.perf_counter()
        for i in range(0, len(live), per_tick):
            delay = start + i * EVENT_BLOCKS / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            for subject, payload, headers in live[i : i + per_tick]:
                await nc.publish(subject, payload, headers=headers)
        await nc.flush()
        took = time.perf_counter() - start
        await nc.close()
        return {"published": len(msgs), "live": len(live), "live_seconds": took}

    return asyncio.run(run())


def probe_side(fd: int, interval: float) -> None:
    """The clients' side, in its own process: a request arrival every ``interval`` s,
    written to ``fd`` as its send time (CLOCK_MONOTONIC, shared by processes) until
    stdin closes. The router's loop wakes for it as for a socket."""
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    while not done.is_set():
        os.write(fd, struct.pack("d", time.monotonic()))
        time.sleep(interval)


async def router_side(
    url: str, transport: str, reader: str, rate: float, seconds: float, workers: int
) -> dict[str, Any]:
    """One run of the router's event path at ``rate``: request p99 event-free and while
    the publisher sends, batches lost (silently or detected), lag, catch-up.

    The path is the router's own: ``Bus`` -> ``EventFeed`` (core subscription or the
    JetStream reader) -> ``EventSync.on_event`` on the event loop -> ``IngestThread``
    -> the native ingest, with its slow-consumer and gap handling; with ``reader``
    "native" (core NATS) the native reader's thread reads and applies the in-order
    batches itself (``router.events.native_reader``). A request here is
    its index part on the same loop: an arrival from another process (a pipe, woken
    like a socket) -> ``match_tiers`` of an 8K-token prompt held by worker 0; its time
    runs from the arrival to the match's end, so a loop busy with events shows in it.
    """
    import asyncio

    from router.config import RouterConfig, WorkerSpec
    from router.events.bus import Bus
    from router.events.consumer import EventSync, last_seq
    from router.events.feed import EventFeed
    from router.workers.registry import WorkerRegistry

    warm = 64
    registry = WorkerRegistry(RouterConfig(block_size=BLOCK))
    for w in range(workers):
        registry.add(WorkerSpec(f"worker-{w}", f"http://127.0.0.1:9/{w}", model="m"))
    pool = registry.pools["default"]
    if not pool.ingest.native:
        return {"skipped": "no native core"}
    events = EventSync(registry)
    cfg = RouterConfig(
        nats_url=url,
        events_transport=transport,  # type: ignore[arg-type]
        events_reader=reader,  # type: ignore[arg-type]
        events_max_bytes=1 << 31,
    )
    feed = EventFeed.from_config(cfg, events)
    bus = Bus(url)
    bus.on_connect(feed.on_connect)
    bus.on_reconnect(feed.on_reconnect)
    bus.on_disconnect(feed.on_disconnect)
    bus.on_error(events.on_nats_error)
    bus.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (
        feed.using and feed.up_to_date and (feed.native is None or feed.native_live)
    ):
        await asyncio.sleep(0.01)  # subscribed: the warm batches are not published before
    cmd = [sys.executable, __file__, "--publish-side", url, "--rate", str(rate)]
    cmd += ["--engine-hashes", ENGINE_HASHES] + ["--nats-pin"] * PIN
    cmd += ["--workers", str(workers), "--nats-seconds", str(seconds)]
    pub = await asyncio.create_subprocess_exec(
        *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert pub.stdin is not None and pub.stdout is not None
    await asyncio.wait_for(pub.stdout.readline(), 120)  # warm batches published

    def batches_of(n: int) -> list[int]:
        """Batches per worker among the first ``n`` (``stores``: chains of 32 in turn)."""
        per = [0] * workers
        for i in range(n):
            per[(i // (512 // EVENT_BLOCKS)) % workers] += 1
        return per

    def applied(w: int) -> int:
        """Batches applied in order (the native reader's counts reach the ingest later)."""
        last = last_seq(pool.ingest, f"worker-{w}")
        return 0 if last is None else last + 1

    def missing(w: int, want: list[int]) -> int:
        return want[w] - applied(w)

    warm_per = batches_of(warm)
    deadline = time.monotonic() + 10
    while any(missing(w, warm_per) for w in range(workers)):
        if time.monotonic() > deadline:
            raise SystemExit("the warm batches never arrived")
        await asyncio.sleep(0.01)
    # worker 0's first chain: the first 32 batches of ``stores(.., 5)``
    first = stores(EVENT_BLOCKS * 32, workers, 512, 5)
    query = BlockHasher(BLOCK).hash_tokens(np.concatenate([t for _, t in first]).tolist())
    index = pool.index
    held = index.match_tiers(query)
    if list(held) != ["worker-0"] or held["worker-0"].total != len(query):
        raise SystemExit(f"worker 0 does not hold the probe's prompt: {held}")

    total: list[float] = []  # arrival -> match done, us
    match: list[float] = []  # the match alone, us
    rfd, wfd = os.pipe()
    loop = asyncio.get_running_loop()

    def on_request() -> None:
        for (sent,) in struct.iter_unpack("d", os.read(rfd, 8 * 256)):
            t0 = time.monotonic()
            index.match_tiers(query)
            t1 = time.monotonic()
            total.append((t1 - sent) * 1e6)
            match.append((t1 - t0) * 1e6)

    prober = subprocess.Popen(
        [sys.executable, __file__, "--probe-side", str(wfd), *["--nats-pin"] * PIN],
        pass_fds=(wfd,),
        stdin=subprocess.PIPE,
    )
    os.close(wfd)
    loop.add_reader(rfd, on_request)
    deadline = time.monotonic() + 10
    while len(total) < 2000 and time.monotonic() < deadline:  # event-free (~1 s)
        await asyncio.sleep(0.01)
    idle_total, idle_match = total[:], match[:]
    total.clear()
    match.clear()
    lag_max = [0, 0.0, 0]

    async def watch_lag() -> None:
        while True:
            await asyncio.sleep(0.001)
            queued, age = events.lag()
            pending = feed.reader.pending if feed.using == "jetstream" else 0
            lag_max[:] = max(lag_max[0], queued), max(lag_max[1], age), max(lag_max[2], pending)

    watcher = asyncio.create_task(watch_lag())
    applied_before = sum(applied(w) for w in range(workers))
    pub.stdin.write(b"go\n")
    await pub.stdin.drain()
    t0 = time.monotonic()
    line = await asyncio.wait_for(pub.stdout.readline(), seconds * 10 + 60)
    live_end = time.monotonic()
    busy_total, busy_match = total[:], match[:]
    applied_live = sum(applied(w) for w in range(workers)) - applied_before
    loop.remove_reader(rfd)
    assert prober.stdin is not None
    prober.stdin.close()
    prober.wait(10)
    os.close(rfd)
    sent = json.loads(line)
    await asyncio.wait_for(pub.wait(), 10)
    want = batches_of(sent["published"])

    def synced(w: int) -> bool:
        return pool.ingest.in_sync(f"worker-{w}")

    deadline = time.monotonic() + 30
    while any(missing(w, want) and synced(w) for w in range(workers)):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    caught_up = time.monotonic() - live_end
    watcher.cancel()
    # Not applied, the worker out of sync (no agent answers replays here): detected.
    # Not applied, the worker still "in sync": lost silently.
    lost_detected = sum(missing(w, want) for w in range(workers) if not synced(w))
    lost_silent = sum(missing(w, want) for w in range(workers) if synced(w))
    counts = {k: v for k, v in events.counts.items() if k != "messages"}
    await feed.close()
    await events.close()
    await bus.close()
    return {
        "transport": feed.using,
        "reader": "native" if feed.native_live else "python",
        "target_blocks_per_s": rate,
        "published_batches": sent["published"],
        "published_blocks_per_s": sent["live"] * EVENT_BLOCKS / sent["live_seconds"],
        "applied_blocks_per_s_while_publishing": applied_live * EVENT_BLOCKS / (live_end - t0),
        "batches_lost_detected": lost_detected,
        "batches_lost_silently": lost_silent,
        "seconds_to_catch_up_after_publishing": caught_up,
        "lag_max_batches_queued": lag_max[0],
        "lag_max_seconds": lag_max[1],
        "lag_max_stream_pending": lag_max[2],
        "requests_idle": len(idle_total),
        "requests_under_ingest": len(busy_total),
        "request_idle_p50_us": pct(idle_total, 50),
        "request_idle_p99_us": pct(idle_total, 99),
        "request_under_ingest_p50_us": pct(busy_total, 50),
        "request_under_ingest_p99_us": pct(busy_total, 99),
        "p99_ratio_under_ingest_over_idle": pct(busy_total, 99) / pct(idle_total, 99),
        "match_idle_p99_us": pct(idle_match, 99),
        "match_under_ingest_p99_us": pct(busy_match, 99),
        "counts": counts,
    }


def bench_nats(
    rates: list[float], seconds: float, workers: int, readers: list[str], transports: list[str]
) -> list[dict[str, Any]]:
    """The router's own event path, core NATS and JetStream, each with each of
    ``readers`` (JetStream's native reader: after the hand-off, router/events/feed.py) one after
    the other at each rate, for ratios side by side."""
    import asyncio

    from sim.mock.natsd import EmbeddedNats

    if NativePrefixIndex is None:
        return []
    out = []
    cpus = os.sched_getaffinity(0)
    for transport in transports:
        for rate in rates:
            for reader in readers:
                pin(1)  # nats-server's CPU, with --nats-pin
                with EmbeddedNats() as server:  # a fresh server (and stream) per run
                    pin(0)
                    run = router_side(server.url, transport, reader, rate, seconds, workers)
                    out.append(asyncio.run(run))
                    pin(1)
    os.sched_setaffinity(0, cpus)
    return out


def text_of(tok: Any, n_tokens: int, rng: random.Random) -> str:
    words = [
        "cache",
        "router",
        "engine",
        "prefix",
        "token",
        "block",
        "hash",
        "worker",
        "latency",
        "memory",
        "event",
    ]
    text = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(n_tokens // 3))
    while len(tok.encode(text, add_special_tokens=False).ids) < n_tokens:
        text += " " + text[: len(text) // 2]
    return text


def bench_prompt(path: str | None, workers: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    if path is None:
        return {"skipped": "no --tokenizer"}
    tok = Tokenizer.from_file(path)
    rng = random.Random(4)
    hasher = BlockHasher(BLOCK)
    index = (NativePrefixIndex or PrefixIndex)()
    out: dict[str, Any] = {"tokenizer": Path(path).name, "index": type(index).__name__}
    for n in LENGTHS:
        text = text_of(tok, n, rng)
        ids = tok.encode(text, add_special_tokens=False).ids
        hashes = hasher.hash_tokens(ids)
        for w in range(workers):  # every worker holds a prefix of a different depth
            index.store(f"worker-{w}", hashes[: len(hashes) * (w + 1) // (workers + 1)])
        reps = max(3, 400_000 // n)
        c0 = time.process_time()
        for _ in range(reps):
            tok.encode(text, add_special_tokens=False)
        t_tok = (time.process_time() - c0) / reps
        c0 = time.process_time()
        for _ in range(reps):
            index.match_tiers(hasher.hash_tokens(ids))
        t_router = (time.process_time() - c0) / reps
        out[str(n)] = {
            "tokens": len(ids),
            "tokenizer_cpu_ms": t_tok * 1e3,
            "hash_and_match_cpu_ms": t_router * 1e3,
            "router_share_of_tokenizer": t_router / t_tok,
        }
    # Does encode hold the GIL? Count main-thread iterations while a thread tokenizes.
    text = text_of(tok, 131072, rng)

    def spin(seconds: float) -> int:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        return n

    alone = spin(0.5)
    done = threading.Event()

    def work() -> None:
        while not done.is_set():
            tok.encode(text, add_special_tokens=False)

    th = threading.Thread(target=work)
    th.start()
    with_thread = spin(0.5)
    done.set()
    th.join()
    done.clear()

    def work_batch() -> None:
        while not done.is_set():
            tok.encode_batch([text], add_special_tokens=False)

    th = threading.Thread(target=work_batch)
    th.start()
    with_batch = spin(0.5)
    done.set()
    th.join()
    out["gil"] = {
        "main_thread_progress_while_encoding": with_thread / alone,
        "main_thread_progress_while_encode_batch": with_batch / alone,
        "note": "1.0: the call releases the GIL; ~0: it holds it (2 cores: ~0.5 is shared)",
    }
    return out


CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def bench_multi_turn(path: str | None, target: int = 32768, turn: int = 1024) -> dict[str, Any]:
    """Per-turn CPU of the router's chat tokenization vs encoding the whole text."""
    import tempfile

    from tokenizers import AddedToken, Tokenizer

    from router.tokens.tokenize import HFTokenizer

    if path is None:
        return {"skipped": "no --tokenizer"}
    raw = Tokenizer.from_file(path)
    raw.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
    )
    rng = random.Random(5)
    with tempfile.TemporaryDirectory() as d:
        raw.save(f"{d}/tokenizer.json")
        Path(d, "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
        hf = HFTokenizer(d)
    messages: list[dict[str, str]] = [{"role": "system", "content": text_of(raw, 512, rng)}]
    ours, full, lengths = [], [], []
    equal = True
    while not lengths or lengths[-1] < target:
        messages.append({"role": "user", "content": text_of(raw, turn // 2, rng)})
        body = {"messages": messages}
        c0 = time.process_time()
        ids, rendered = hf.chat(body)
        ours.append(time.process_time() - c0)
        c0 = time.process_time()
        want = raw.encode(rendered, add_special_tokens=False).ids
        full.append(time.process_time() - c0)
        equal &= ids == want
        lengths.append(len(ids))
        messages.append({"role": "assistant", "content": text_of(raw, turn // 2, rng)})
    last = slice(-4, None)  # the turns near the target length
    return {
        "turns": len(lengths),
        "final_tokens": lengths[-1],
        "identical_to_full_encoding": equal,
        "router_cpu_ms_per_turn_mean": statistics.mean(ours) * 1e3,
        "full_encode_cpu_ms_per_turn_mean": statistics.mean(full) * 1e3,
        "router_cpu_ms_last_turns": statistics.mean(ours[last]) * 1e3,
        "full_encode_cpu_ms_last_turns": statistics.mean(full[last]) * 1e3,
        "ratio_router_over_full_last_turns": statistics.mean(ours[last])
        / statistics.mean(full[last]),
        "segment_cache": {"hits": hf.segments.hits, "misses": hf.segments.misses},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", help="a tokenizer.json (Llama-style SentencePiece BPE)")
    p.add_argument("--pairs", type=int, default=1_000_000, help="memory: unshared pairs")
    p.add_argument("--ingest-pairs", type=int, default=400_000)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--rate", type=float, default=128_000, help="under_ingest: blocks/s")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    p.add_argument(
        "--engine-hashes",
        choices=("u64", "sha256"),
        default="u64",
        help="our events' block hashes: 64-bit ints, or a default vLLM's 32-byte sha256s",
    )
    p.add_argument(
        "--memory-side", choices=["native", "native_no_names", "dynamo"], help=argparse.SUPPRESS
    )
    p.add_argument("--publish-side", metavar="URL", help=argparse.SUPPRESS)
    p.add_argument("--probe-side", type=int, metavar="FD", help=argparse.SUPPRESS)
    p.add_argument(
        "--nats-rates",
        default=",".join(str(r) for r in NATS_RATES),
        help="nats: comma-separated blocks/s (default 32K, 128K, 512K)",
    )
    p.add_argument("--nats-seconds", type=float, default=4.0, help="nats: seconds per rate")
    p.add_argument(
        "--nats-pin",
        action="store_true",
        help="nats: the router and the prober on CPU 0; nats-server and the publisher on CPU 1",
    )
    p.add_argument(
        "--nats-readers",
        default="python,native",
        help="nats: who reads the live events, comma-separated (events_reader: python, native)",
    )
    p.add_argument(
        "--nats-transports",
        default="core,jetstream",
        help="nats: comma-separated transports (core, jetstream)",
    )
    p.add_argument(
        "--memory-pairs",
        type=int,
        action="append",
        help="memory at these pair counts instead of --pairs (repeatable: 1M and 5M)",
    )
    p.add_argument(
        "--only",
        help="comma-separated sections to run "
        "(prompt,multi_turn,ingest,under_ingest,memory,nats,targets)",
    )
    p.add_argument(
        "--target-sizes",
        default=",".join(str(n) for n in TARGET_SIZES),
        help="targets: pool sizes in targets (nodes x 8 DP ranks), comma-separated",
    )
    p.add_argument("--target-block", type=int, default=16, help="targets: block size (16, 32)")
    p.add_argument("--target-pairs", type=int, default=200_000, help="targets: ingest pairs")
    p.add_argument(
        "--target-memory-pairs", type=int, default=500_000, help="targets: memory pairs (0: skip)"
    )
    p.add_argument(
        "--target-baseline",
        metavar="DIR",
        help="targets: also this checkout's match and decision at each size (before/after)",
    )
    args = p.parse_args(argv)
    global ENGINE_HASHES, PIN
    ENGINE_HASHES = args.engine_hashes
    PIN = args.nats_pin
    if PIN and (os.cpu_count() or 1) < 2:
        p.error("--nats-pin needs two CPUs")
    if args.memory_side:  # the child process of bench_memory
        print(json.dumps(memory_side(args.memory_side, args.pairs, args.workers, 512)))
        return 0
    if args.probe_side is not None:  # the clients' process of bench_nats
        pin(0)
        probe_side(args.probe_side, 0.0005)
        return 0
    if args.publish_side:  # the publisher process of bench_nats
        pin(1)
        sent = publish_side(args.publish_side, args.rate, args.nats_seconds, args.workers, 64)
        print(json.dumps(sent))
        return 0
    if args.quick:
        args.pairs, args.ingest_pairs, args.reps, args.rate = 32_768, 16_384, 1, 16_000
        args.nats_rates = "16000"
        args.target_pairs, args.target_memory_pairs = 16_384, 32_768
        args.target_sizes = "16,72"  # past PRUNE_ABOVE (64): the pruned path runs
    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "config": {
            "block_size": BLOCK,
            "blocks_per_event": EVENT_BLOCKS,
            "workers": args.workers,
            "python": sys.version.split()[0],
            "native": NativePrefixIndex is not None,
            "dynamo": metadata.version("ai-dynamo-runtime") if RadixTree is not None else None,
            "load_average_at_start": os.getloadavg(),
            "engine_hashes": ENGINE_HASHES,
            "nats_pin": PIN,
        },
    }
    sections = {
        "prompt": lambda: bench_prompt(args.tokenizer, args.workers) if not args.quick else {},
        "multi_turn": lambda: bench_multi_turn(args.tokenizer) if not args.quick else {},
        "ingest": lambda: bench_ingest(args.ingest_pairs, args.workers, 512, args.reps),
        "under_ingest": lambda: bench_under_ingest(
            args.rate, 2.0 if args.quick else 8.0, args.workers
        ),
        "memory": lambda: memory_at(args.memory_pairs or [args.pairs], args.workers),
        "nats": lambda: bench_nats(
            [float(r) for r in args.nats_rates.split(",")],
            1.0 if args.quick else args.nats_seconds,
            args.workers,
            args.nats_readers.split(","),
            args.nats_transports.split(","),
        ),
        "targets": lambda: bench_targets(
            [int(n) for n in args.target_sizes.split(",")],
            args.target_block,
            args.reps,
            args.target_pairs,
            args.target_memory_pairs,
            args.target_baseline,
        ),
    }
    wanted = args.only.split(",") if args.only else list(sections)
    for name in wanted:
        if name not in sections:
            p.error(f"--only: no section {name!r} (one of {', '.join(sections)})")
        out[name] = sections[name]()
    out["config"]["wall_seconds"] = time.perf_counter() - t0
    out["config"]["load_average_at_end"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
