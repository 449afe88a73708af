"""What one hostile publisher costs the native core (issue 32's fuzz findings), as JSON.

Each case is what the first fuzz campaign found slow, against the same shape from a
well-behaved engine where there is one:

- ``clear_spam``: AllBlocksCleared for a worker that holds nothing, ``--clears`` of them
  in one batch, while ``--blocks`` are indexed for other workers (the time is the
  core's mutex held: every match waits for it);
- ``crafted_hashes``: 40K stores into one worker whose engine hashes collide under the
  tables' old public slot hash (MurmurHash3's finalizer), against random ones;
- ``nil_events``: a 1 MB batch of 1M ``nil`` events (each a bad event), against a benign
  1 MB batch;
- ``chain_eviction``: a chain of 2x the index bound stored at once, native and Python;
- ``benign_ingest``: 16-block batches of 16 tokens through ``ingest_many``, the hot path,
  so the keyed hash's cost shows.

Run it against any build: ``PYTHONPATH=<checkout> python3 bench/native_attacks.py``
(the checkout's ``index/_native*.so`` is the one measured).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack

# bench/index.py is no package: this tree's (or PYTHONPATH's checkout's) ``index`` is
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(_HERE.parent))

from index import (  # noqa: E402
    AllBlocksCleared,
    BlockHasher,
    BlockStored,
    EventBatch,
    EventIngest,
    encode,
)
from index.backend import NativePrefixIndex  # noqa: E402
from index.prefix_index import PrefixIndex  # noqa: E402

B = 16
MASK = (1 << 64) - 1


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def stores(hashes: list[int], per_event: int = 64, salt: int = 0) -> list[bytes]:
    """One worker's stores of ``hashes`` (one block each, chained), ``per_event`` a batch;
    ``salt`` starts the chain's tokens (another worker's chain is other blocks)."""
    out = []
    for first in range(0, len(hashes), per_event):
        chunk = hashes[first : first + per_event]
        tokens = [(salt + first + i) % 50_000 for i in range(len(chunk) * B)]
        event = BlockStored(chunk, hashes[first - 1] if first else None, tokens, B, medium="GPU")
        out.append(encode(EventBatch(0.0, [event], None)))
    return out


def clear_spam(blocks: int, clears: int) -> dict[str, float]:
    index = NativePrefixIndex()
    ingest = EventIngest(index, BlockHasher(B))
    per_worker = blocks // 8
    for w in range(8):
        hashes = [w << 40 | i for i in range(per_worker)]
        for seq, payload in enumerate(stores(hashes, 1024, salt=7 * w + 1)):
            ingest.apply(f"w{w}", seq, payload)
    spam = encode(EventBatch(0.0, [AllBlocksCleared()] * clears, None))
    seconds = timed(lambda: ingest.apply("idle", 0, spam))
    return {
        "blocks": len(index),
        "clears": clears,
        "payload_bytes": len(spam),
        "seconds": round(seconds, 4),
        "us_per_clear": round(seconds / clears * 1e6, 3),
        "seconds_for_58000": round(seconds / clears * 58_000, 3),
    }


def fmix_inverse(h: int) -> int:
    h ^= h >> 33
    h = h * 0x9CB4B2F8129337DB & MASK
    h ^= h >> 33
    h = h * 0x4F74430C22A54005 & MASK
    h ^= h >> 33
    return h


def crafted_hashes(n: int) -> dict[str, float]:
    rng = random.Random(1)
    out: dict[str, float] = {"stores": n}
    for name, keys in (
        ("random", [rng.getrandbits(64) for _ in range(n)]),
        ("crafted", [fmix_inverse(i) for i in range(n)]),
    ):
        ingest = EventIngest(NativePrefixIndex(), BlockHasher(B))
        batches = stores(keys, 1024)

        def run(ingest: EventIngest = ingest, batches: list[bytes] = batches) -> None:
            for seq, payload in enumerate(batches):
                ingest.apply("w", seq, payload)

        out[f"{name}_seconds"] = round(timed(run), 4)
    return out


def nil_events() -> dict[str, float]:
    core = NativePrefixIndex()._core(0)
    nils = msgpack.packb([0.0, [None] * 1_000_000, None])
    benign = encode(
        EventBatch(0.0, [BlockStored([i], None, [7] * B, B) for i in range(30_000)], None)
    )
    return {
        "nil_payload_bytes": len(nils),
        "nil_seconds": round(timed(lambda: core.parse(nils)), 4),
        "benign_payload_bytes": len(benign),
        "benign_seconds": round(timed(lambda: core.parse(benign)), 4),
    }


def chain_eviction(bound: int, py_bound: int) -> dict[str, float]:
    nat = NativePrefixIndex(max_blocks=bound)
    py = PrefixIndex(max_blocks=py_bound)
    return {
        "native_bound": bound,
        "native_seconds": round(timed(lambda: nat.store("w", list(range(1, 2 * bound)))), 4),
        "python_bound": py_bound,
        "python_seconds": round(timed(lambda: py.store("w", list(range(1, 2 * py_bound)))), 4),
    }


def benign_ingest(batches: int) -> dict[str, float]:
    index = NativePrefixIndex()
    EventIngest(index, BlockHasher(B))  # configures the core's event path
    rng = random.Random(2)
    payloads = []
    for seq in range(batches):
        hashes = [rng.getrandbits(63) for _ in range(16)]
        tokens = [rng.randrange(50_000) for _ in range(16 * B)]
        event = BlockStored(hashes, None, tokens, B)
        payloads.append((seq, encode(EventBatch(0.0, [event], None))))
    core, slot = index.locate("w")
    items = [(slot, None, seq, None, p) for seq, p in payloads]
    seconds = timed(lambda: [core.ingest_many(items[i : i + 64]) for i in range(0, batches, 64)])
    return {"batches": batches, "us_per_batch": round(seconds / batches * 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=410_000)
    ap.add_argument("--clears", type=int, default=58_000)
    ap.add_argument("--stores", type=int, default=40_000)
    ap.add_argument("--bound", type=int, default=200_000)
    ap.add_argument("--py-bound", type=int, default=20_000)
    ap.add_argument("--batches", type=int, default=20_000)
    args = ap.parse_args()
    report = {
        "clear_spam": clear_spam(args.blocks, args.clears),
        "crafted_hashes": crafted_hashes(args.stores),
        "nil_events": nil_events(),
        "chain_eviction": chain_eviction(args.bound, args.py_bound),
        "benign_ingest": benign_ingest(args.batches),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
