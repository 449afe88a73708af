"""The router's own cost at real prompt lengths and event rates, beside Dynamo's index.

Prints one JSON object (never asserts). Sections:

- ``prompt``: per request, at 2K / 8K / 32K / 128K tokens: the tokenizer alone (a real
  tokenizer.json, ``--tokenizer``), then what the router adds on top (block hashes and
  the index match), CPU seconds per request; and whether tokenizing holds the GIL (a
  thread tokenizing a 128K prompt while the main thread counts: ``encode`` and
  ``encode_batch``, which the router uses).
- ``multi_turn``: a ChatML conversation growing to 32K tokens (``--tokenizer`` with
  ``<|im_start|>``/``<|im_end|>`` added as special tokens), CPU per turn of the router's
  chat tokenization (segment cache, router/tokenize.py) against ``encode`` of the
  whole rendered text, and the two checked equal.
- ``ingest``: KV-event ingest alone, ``EventIngest.apply`` on msgpack vLLM batches
  (16 blocks of 16 tokens each) with the Python and the native index, and Dynamo's
  ``RadixTree.apply_event`` on the same stores (its JSON form), blocks/s; batches lost
  (not applied and not reported) counted.
- ``under_ingest``: match p50/p99 on the main thread, event-free and while a thread
  applies batches at ``--rate`` blocks/s (the native path releases the GIL).
- ``memory``: bytes per (block, worker) pair at ``--pairs`` (or each ``--memory-pairs``)
  unshared pairs: the native core's own heap count and RSS growth; Dynamo's RSS growth
  on the same stores; each side in a fresh process.

Run (Dynamo comes from the ``baselines`` extra; a separate venv works):

    flock /work/bench.lock nice -n 5 python bench/scale.py --tokenizer PATH/tokenizer.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
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

from index import BlockHasher, BlockStored, EventBatch, EventIngest, PrefixIndex, encode  # noqa: E402
from index.backend import NativePrefixIndex  # noqa: E402

os.environ.setdefault("DYN_LOG", "error")
try:
    from dynamo._core import RadixTree, compute_block_hash_for_seq
except ImportError:  # optional baseline
    RadixTree = compute_block_hash_for_seq = None

BLOCK = 16
EVENT_BLOCKS = 16
VOCAB = 32_000
LENGTHS = (2048, 8192, 32768, 131072)


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
    parent: int | None = None
    for i, (w, toks) in enumerate(data):
        if i % per_chain == 0:
            parent = None
        hashes = list(range(next_hash, next_hash + EVENT_BLOCKS))
        next_hash += EVENT_BLOCKS
        ev = BlockStored(hashes, parent, toks.tolist(), BLOCK, medium="GPU")
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


def ingest_ours(index_cls: type, batches: list[tuple[str, int, bytes]]) -> tuple[float, Any]:
    ingest = EventIngest(index_cls(), BlockHasher(BLOCK))
    apply = ingest.apply
    lost = 0
    t0 = time.perf_counter()
    for worker, seq, payload in batches:
        r = apply(worker, seq, payload)
        lost += r.applied != 1
    dt = time.perf_counter() - t0
    if lost or ingest.errors or ingest.gaps:
        raise SystemExit(f"ingest did not apply cleanly: {lost} {dict(ingest.errors)}")
    return dt, ingest


def bench_ingest(pairs: int, workers: int, chain: int, reps: int) -> dict[str, Any]:
    data = stores(pairs, workers, chain, 1)
    batches = our_batches(data, chain)
    out: dict[str, Any] = {
        "pairs": pairs,
        "batches": len(batches),
        "blocks_per_batch": EVENT_BLOCKS,
    }
    impls: dict[str, type] = {"python": PrefixIndex}
    if NativePrefixIndex is not None:
        impls["native"] = NativePrefixIndex
    for name, cls in impls.items():
        times = []
        for _ in range(reps):
            gc.collect()
            t, ing = ingest_ours(cls, batches)
            times.append(t)
            del ing
        out[f"{name}_blocks_per_s"] = pairs / statistics.median(times)
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
        out["dynamo_blocks_per_s"] = pairs / statistics.median(times)
        for name in impls:
            out[f"ratio_{name}_over_dynamo"] = (
                out[f"{name}_blocks_per_s"] / out["dynamo_blocks_per_s"]
            )
    return out


def memory_side(side: str, pairs: int, workers: int, chain: int) -> dict[str, float]:
    """One side's bytes per pair, in this (fresh) process: RSS growth while it ingests."""
    data = stores(pairs, workers, chain, 2)
    if side == "native":
        batches = our_batches(data, chain)
        del data
        gc.collect()
        before = rss()
        _, ing = ingest_ours(NativePrefixIndex, batches)
        grown = rss() - before
        index_bytes = sum(core.bytes()[0] for core in ing.index.cores)
        maps_bytes = sum(core.bytes()[1] for core in ing.index.cores)
        return {
            "native_heap_bytes_per_pair": (index_bytes + maps_bytes) / pairs,
            "native_index_heap_bytes_per_pair": index_bytes / pairs,
            "native_maps_heap_bytes_per_pair": maps_bytes / pairs,
            "native_rss_bytes_per_pair": grown / pairs,
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
    sides = [s for s, ok in (("native", NativePrefixIndex), ("dynamo", RadixTree)) if ok]
    for side in sides:
        cmd = [sys.executable, __file__, "--memory-side", side, "--pairs", str(pairs)]
        cmd += ["--workers", str(workers)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
        out.update(json.loads(done.stdout))
    if "native_rss_bytes_per_pair" in out and "dynamo_rss_bytes_per_pair" in out:
        out["ratio_native_over_dynamo_rss"] = (
            out["native_rss_bytes_per_pair"] / out["dynamo_rss_bytes_per_pair"]
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
    ingest = EventIngest(NativePrefixIndex(), BlockHasher(BLOCK))
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

    from router.tokenize import HFTokenizer

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
    p.add_argument("--memory-side", choices=["native", "dynamo"], help=argparse.SUPPRESS)
    p.add_argument(
        "--memory-pairs",
        type=int,
        action="append",
        help="memory at these pair counts instead of --pairs (repeatable: 1M and 5M)",
    )
    p.add_argument(
        "--only",
        help="comma-separated sections to run (prompt,multi_turn,ingest,under_ingest,memory)",
    )
    args = p.parse_args(argv)
    if args.memory_side:  # the child process of bench_memory
        print(json.dumps(memory_side(args.memory_side, args.pairs, args.workers, 512)))
        return 0
    if args.quick:
        args.pairs, args.ingest_pairs, args.reps, args.rate = 32_768, 16_384, 1, 16_000
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
