"""The mock engine's continuous-batching scheduler over the shared ``PrefixCache``.

Like vLLM's scheduler, each step spends a token budget: one token for every decoding
request, then prefill chunks for running requests, then new requests from the head of
the waiting queue (the head waits when its pages cannot be freed, so later ones wait
too) while fewer than ``max_num_seqs`` run. The step then "runs" for a modelled time:

    (1 / decode_tps + prefill tokens / prefill_tps + host blocks loaded * load_s) / speed

so prefill latency grows with uncached tokens, a lone request decodes at ``decode_tps``
and everything speeds up by ``speed`` for tests. Blocks are cached as their prefill
chunk is scheduled; the step's KV events go out as one batch after it. Its ``/metrics``
say waiting as vLLM does (``reported_waiting``): what the last schedule left waiting,
not a request that came during the step.

The waiting queue's order is vLLM's ``--scheduling-policy`` (vllm/v1/core/sched/
scheduler.py and request_queue.py, read in vLLM 0.32.0 and at main of 2026): ``fcfs``,
arrival order; ``priority``, a request's ``priority`` (lower first), then its arrival.
Under either, a waiting request never preempts a running one when ``max_num_seqs``
run: vLLM's waiting loop stops there whatever the priorities (vLLM issue 40004, open;
its PRs 45558, 45561 and 54530 to preempt there are not merged), so an urgent request
takes the *next* slot that frees on its engine, ahead of every less urgent request
waiting there, and never a slot someone holds. vLLM preempts only when a running
request cannot get a KV block for its next tokens (the victim is the least urgent,
latest arrival under ``priority``, the last scheduled under ``fcfs``); this scheduler
reserves a request's whole answer when it is admitted, so a running request never needs
a block and that case never arises here.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from index.codec import Event
from sim.cache import CacheFullError, PrefixCache

log = logging.getLogger(__name__)
_ids = itertools.count()  # request ids, "seq-N"
_arrivals = itertools.count()  # submission order, the tie-break within a priority
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


@dataclass(slots=True)
class Timing:
    speed: float = 1.0
    decode_tps: float = 50.0  # tokens/s of one request decoding alone
    prefill_tps: float = 10_000.0  # uncached prompt tokens/s
    load_s_per_block: float = 0.0005  # host -> GPU copy of one block
    transfer_s_per_block: float = 0.001  # a prefetched block arriving from elsewhere

    def scaled(self, seconds: float) -> float:
        return seconds / self.speed


@dataclass(eq=False)
class Sequence:
    """One request from admission to its last token."""

    prompt: list[int]
    hashes: list[int]
    max_tokens: int
    pieces: list[str]  # the output text, one piece per token
    finish_reason: str
    stop_reason: str | None = None  # the stop string that ended it
    lora: str | None = None  # the LoRA adapter it runs with (its own prefix space)
    keys: dict[int, list[Any]] | None = None  # per block, its multimodal items' keys
    id: str = field(default_factory=lambda: f"seq-{next(_ids)}")
    priority: int = 0  # the body's ``priority`` (lower first; only under ``priority``)
    arrival: int = 0  # set when submitted
    cached_tokens: int = 0
    computed: int = 0  # prompt tokens done (hits included)
    generated: int = 0
    error: str | None = None
    aborted: bool = False
    done: bool = False
    # Each step's new output pieces; None closes the stream.
    out: asyncio.Queue[list[str] | None] = field(default_factory=asyncio.Queue)


class Scheduler:
    def __init__(
        self,
        cache: PrefixCache,
        timing: Timing,
        publish: Callable[[list[Event]], None],
        *,
        max_num_seqs: int = 256,
        max_batched_tokens: int = 2048,
        policy: SchedulingPolicy = "fcfs",
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.policy = policy
        self.cache = cache
        self.timing = timing
        self.publish = publish
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        # in the order they are scheduled: arrival (fcfs), or (priority, arrival)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.prefix_hits = 0  # of which cached, GPU or host (vllm:prefix_cache_hits)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._left = 0  # requests the last step's schedule left waiting
        self._wake = asyncio.Event()

    @property
    def reported_waiting(self) -> int:
        """Waiting as vLLM's ``/metrics`` says it: those its last schedule left waiting.
        A request that arrives during a step sits in vLLM's input queue until the next
        schedule takes it (vllm/v1/engine/core.py ``run_busy_loop``; the stats are made
        after the step), so it counts only if that schedule leaves it waiting too: a
        router reading waiting > 0 then knows a slot, the KV cache or the step's token
        budget kept it there, not the moment it came."""
        return min(self._left, len(self.waiting))

    def submit(self, seq: Sequence) -> None:
        seq.arrival = next(_arrivals)
        if self.policy == "priority":
            # behind every request at least as urgent, ahead of every less urgent one
            at = bisect.bisect_right(self.waiting, seq.priority, key=_priority)
            self.waiting.insert(at, seq)
        else:
            self.waiting.append(seq)
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        """The client went away: free its pages at the next step."""
        if seq.done:
            return
        seq.aborted = True
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._finish(seq)
        self._wake.set()

    def flush_events(self) -> None:
        """Publish events made outside a step (a prefetch landing) right away."""
        events = self.cache.drain_events()
        if events:
            self.publish(events)

    async def run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            try:
                if not await self._step():
                    # The head of the queue cannot fit and nothing runs to free pages:
                    # wait for a new request or an abort instead of spinning.
                    self._wake.clear()
                    await self._wake.wait()
            except Exception:  # a bug in one step must not leave every client hanging
                log.exception("scheduler step failed; failing its requests")
                for seq in [*self.running, *self.waiting]:
                    seq.error = "internal scheduler error"
                    self._finish(seq)
                self.running.clear()
                self.waiting.clear()

    async def _step(self) -> bool:
        """One engine step; False when it could do nothing at all."""
        budget = self.max_batched_tokens
        emitting: list[Sequence] = []
        for seq in self.running:
            if seq.computed == len(seq.prompt) and not seq.aborted:
                emitting.append(seq)
        budget -= len(emitting)
        decoding = len(emitting)
        prefill = 0
        for seq in self.running:
            if seq.computed < len(seq.prompt) and not seq.aborted and budget > 0:
                chunk = self._prefill(seq, budget)
                budget -= chunk
                prefill += chunk
                if seq.computed == len(seq.prompt):
                    emitting.append(seq)
        loaded = 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            try:
                alloc = self.cache.allocate(
                    seq.id,
                    seq.prompt,
                    block_hashes=seq.hashes,
                    reserve_tokens=seq.max_tokens,
                    lora=seq.lora,
                    keys=seq.keys,
                )
            except CacheFullError as exc:
                self.waiting.popleft()
                seq.error = str(exc)
                self._finish(seq)
                continue
            if alloc is None:
                break  # nobody overtakes the head (the most urgent under ``priority``)
            self.waiting.popleft()
            self.running.append(seq)
            hit = (alloc.gpu_hit_blocks + alloc.host_hit_blocks) * self.cache.block_size
            seq.cached_tokens = seq.computed = hit
            loaded += alloc.host_hit_blocks
            self.prefix_queries += len(seq.prompt)
            self.prefix_hits += hit
            self.prompt_tokens += len(seq.prompt)
            chunk = self._prefill(seq, budget)
            budget -= chunk
            prefill += chunk
            if seq.computed == len(seq.prompt):
                emitting.append(seq)
        self._left = len(self.waiting)
        t = self.timing
        cost = 1 / t.decode_tps if decoding or prefill else 0.0
        cost += prefill / t.prefill_tps + loaded * t.load_s_per_block
        await asyncio.sleep(t.scaled(cost))
        for seq in emitting:
            seq.out.put_nowait([seq.pieces[seq.generated]])
            seq.generated += 1
            self.generation_tokens += 1
        finished = [s for s in self.running if s.aborted or s.generated >= s.max_tokens]
        for seq in finished:
            self.running.remove(seq)
            self.cache.release(seq.id)
            self._finish(seq)
        self.flush_events()
        return bool(emitting or prefill or finished)

    def _prefill(self, seq: Sequence, budget: int) -> int:
        chunk = min(len(seq.prompt) - seq.computed, budget)
        seq.computed += chunk
        self.cache.commit(seq.id, seq.computed)
        return chunk

    def _finish(self, seq: Sequence) -> None:
        seq.done = True
        seq.out.put_nowait(None)


def _priority(seq: Sequence) -> int:
    return seq.priority
