"""A match never sees half a batch of one worker (issue 12), with ingest on its own thread.

One thread applies KV-event batches through the production ingest path
(``NativeEventIngest.apply_many``, what the router's ingest thread runs: runs of batches
per ``Core.ingest_many`` call, GIL released, one batch per mutex hold; LoRA batches go
through Python's decoder and ``Core.ingest_events``). Two other threads match all the
while with the request path's call (``NativePrefixIndex.match_tiers``). Every worker's
observed ``TierMatch`` must be the one the Python reference index gives after some whole
number of that worker's batches, within the batches applied when the match began and
those handed to the native call when it ended.

The batches are made so that a torn batch shows: each one changes a worker's match in
several events (a chain grown block by block, a tail removed leaf first, a tail removed
and stored again, a tail moved from GPU to CPU, a clear and a new chain), and every
intermediate state of a batch is one no batch boundary of that worker has in its window.

The Python index is not run this way: the router applies its batches on the event loop,
never beside a match (router/events/consumer.py applies on the ingest thread only when
``ingest.native``).
"""

from __future__ import annotations

import random
import sys
import threading
import time
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest

from index import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    EventBatch,
    PrefixIndex,
    SeqStatus,
    TierMatch,
    encode,
)
from index.backend import NATIVE, NativePrefixIndex, make_ingest
from index.codec import Event
from index.ingest import Batch

pytestmark = pytest.mark.skipif(not NATIVE, reason="native core not built")

B = 4
CHAIN = 40  # blocks in the chain every worker's blocks are drawn from
TOKENS = list(range(CHAIN * B))
# Two workers in the first core and two past the 64th slot: a match asks two cores.
FILLERS = 64
WORKERS = (("w0", None), ("w1", "ada"), ("w2", None), ("w3", "ada"))  # name, LoRA
BATCHES = 6000
MAX_RUN = 16  # batches per apply_many call; the router's thread hands at most 64


@dataclass
class Model:
    """What one engine holds: block index -> media. Only to make valid batches; the
    expected matches come from the reference index."""

    name: str
    lora: str | None
    tag: int
    held: dict[int, set[str]] = field(default_factory=dict)
    seq: int = 0

    @property
    def top(self) -> int:
        return max(self.held, default=-1) + 1

    def eh(self, block: int) -> int:
        return self.tag << 32 | block + 1  # the engine's opaque hash of a block

    def store(self, blocks: range, medium: str, rng: random.Random) -> list[Event]:
        """Stored events for ``blocks``, one to three blocks each, parents chained."""
        out: list[Event] = []
        at = blocks.start
        while at < blocks.stop:
            n = min(rng.randint(1, 3), blocks.stop - at)
            out.append(
                BlockStored(
                    [self.eh(b) for b in range(at, at + n)],
                    self.eh(at - 1) if at else None,
                    TOKENS[at * B : (at + n) * B],
                    B,
                    medium=medium,
                    lora_name=self.lora,
                )
            )
            for b in range(at, at + n):
                self.held.setdefault(b, set()).add(medium)
            at += n
        return out

    def remove(self, blocks: range, media: tuple[str, ...]) -> list[Event]:
        """One removed event per block and medium held, leaf first."""
        out: list[Event] = []
        for b in reversed(blocks):
            for medium in media:
                if medium in self.held.get(b, ()):
                    out.append(BlockRemoved([self.eh(b)], medium))
                    self.held[b].discard(medium)
            if not self.held.get(b, True):
                del self.held[b]
        return out

    def batch(self, rng: random.Random) -> bytes:
        top = self.top
        kinds = ["grow"] if top + 2 <= CHAIN else []
        if top >= 2:
            kinds += ["shrink", "churn", "offload", "reset"]
        kind = rng.choice(kinds)
        if kind == "grow":
            events = self.store(range(top, top + rng.randint(2, min(6, CHAIN - top))), "GPU", rng)
        elif kind == "shrink":
            events = self.remove(range(top - rng.randint(2, min(6, top)), top), ("GPU", "CPU"))
        elif kind in ("churn", "offload"):
            # the tail gone from GPU, then stored again (on GPU, or on CPU: an offload)
            tail = range(top - rng.randint(1, min(4, top - 1)), top)
            events = self.remove(tail, ("GPU",))
            events += self.store(tail, "GPU" if kind == "churn" else "CPU", rng)
        else:
            self.held.clear()
            events = [AllBlocksCleared(), *self.store(range(rng.randint(2, 8)), "GPU", rng)]
        self.seq += 1
        return encode(EventBatch(float(self.seq), events, None))


def script(seed: int) -> list[Batch]:
    rng = random.Random(seed)
    models = [Model(name, lora, tag) for tag, (name, lora) in enumerate(WORKERS, 1)]
    out: list[Batch] = []
    for _ in range(BATCHES):
        m = rng.choice(models)
        seq = m.seq
        out.append((m.name, seq, m.batch(rng), None, None))
    return out


def add_workers(index: PrefixIndex | NativePrefixIndex) -> None:
    for name, _ in WORKERS[:2]:
        index.add_worker(name)
    for i in range(FILLERS - 2):
        index.add_worker(f"filler{i}")
    for name, _ in WORKERS[2:]:
        index.add_worker(name)


State = TierMatch | None


def reference(
    batches: list[Batch], queries: Mapping[str | None, Sequence[int]]
) -> dict[str, list[State]]:
    """Per worker, its match after each whole number of its batches (0: none yet)."""
    ingest = make_ingest(PrefixIndex(), BlockHasher(B))
    add_workers(ingest.index)
    lora = dict(WORKERS)
    states: dict[str, list[State]] = {name: [None] for name, _ in WORKERS}
    for w, seq, payload, rank, epoch in batches:
        assert ingest.apply(w, seq, payload, dp_rank=rank, epoch=epoch).status is SeqStatus.OK
        states[w].append(observed(ingest.index.match_tiers(queries[lora[w]]), w))
    return states


def observed(matches: dict[str, TierMatch], worker: str) -> State:
    m = matches.get(worker)
    return None if m is None or not m.total else m  # no entry and an empty one alike


@pytest.mark.parametrize("seed", [0, 1])
def test_a_match_beside_the_ingest_thread_never_sees_half_a_batch(seed: int) -> None:
    hasher = BlockHasher(B)
    queries = {lora: hasher.hash_tokens(TOKENS, lora_name=lora) for lora in ("ada", None)}
    batches = script(seed)
    want = reference(batches, queries)
    # where each worker's j-th batch sits in the script: its batches among the first p
    ends = {name: [i + 1 for i, b in enumerate(batches) if b[0] == name] for name, _ in WORKERS}
    by_query = {lora: [name for name, x in WORKERS if x == lora] for lora in queries}

    index = NativePrefixIndex()
    add_workers(index)
    ingest = make_ingest(index, hasher)
    # [batches applied in full, batches handed to the native call]: the window a match
    # that read the first before it and the second after it must fall in
    progress = [0, 0]
    rounds = [0]  # the matchers' rounds so far
    during: list[tuple[int, int, list[dict[str, TierMatch]]]] = []  # (lo, hi, matches)
    failures: list[str] = []
    done = threading.Event()

    def matcher() -> None:
        # Kept now, checked after: the less Python between two matches, the more often
        # a match waits on the mutex while a batch is applied. Only rounds while a run
        # was in flight are kept: a match between two runs sees nothing in between.
        try:
            while not done.is_set():
                lo = progress[0]
                matches = [index.match_tiers(query) for query in queries.values()]
                hi = progress[1]
                rounds[0] += 1
                if lo < hi:
                    during.append((lo, hi, matches))
        except BaseException as exc:  # reported by the test, not lost with the thread
            failures.append(repr(exc))

    def applier() -> None:
        rng = random.Random(seed)
        try:
            i = 0
            while i < len(batches) and not failures:
                before = rounds[0]
                run = batches[i : i + rng.randint(1, MAX_RUN)]
                progress[1] = i + len(run)
                results = ingest.apply_many(run)
                progress[0] = i + len(run)
                bad = [r for r in results if r.status is not SeqStatus.OK or r.errors]
                if bad:
                    failures.append(f"batches {i}..{i + len(run)}: {bad}")
                i += len(run)
                # the matchers run all along the script, not only where the scheduler
                # lets them: the next run waits for one more round
                while rounds[0] == before and not failures and any(t.is_alive() for t in matchers):
                    time.sleep(0)
        except BaseException as exc:
            failures.append(repr(exc))
        finally:
            done.set()

    # Two matchers: while one waits on a core's mutex (GIL released) the other's next
    # match tries it, so more tries land in a gap a torn batch would leave. A mutex let
    # go for an instant between two events of a batch (no yield) failed this test on 17
    # of 20 (seed, run) pairs with two, on 14 of 20 with one and more batches.
    matchers = [threading.Thread(target=matcher) for _ in range(2)]
    threads = [*matchers, threading.Thread(target=applier)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads take turns with the GIL often
    try:
        for t in threads:
            t.start()
        for t in threads[::-1]:
            t.join(120)
    finally:
        sys.setswitchinterval(switch)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures
    assert rounds[0] >= len(batches) // MAX_RUN  # at least one between any two runs
    # and at rest, the native index is the reference's
    at_rest = [index.match_tiers(query) for query in queries.values()]
    for lo, hi, matches in [*during, (len(batches), len(batches), at_rest)]:
        for lora, got in zip(queries, matches, strict=True):
            for w in by_query[lora]:
                state = observed(got, w)
                j_lo, j_hi = bisect_right(ends[w], lo), bisect_right(ends[w], hi)
                assert state in want[w][j_lo : j_hi + 1], (
                    f"{w}: {state} with script batches {lo}..{hi} applied, "
                    f"its whole batches give {want[w][j_lo : j_hi + 1]}"
                )
