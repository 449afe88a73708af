"""One simulated engine: vLLM-style continuous batching on a virtual clock.

Each step spends a token budget (``max_batch_tokens``): one token per decoding request,
then prefill chunks of admitted requests, then new requests in arrival order (the head
waits while its pages cannot be freed, so later ones wait too, as in vLLM; what a
schedule leaves waiting is what the engine reports waiting, ``reported_waiting``). The
step lasts ``EngineCosts.step_ms`` plus the prefill of its chunks (attention over the
context already in place) plus host-to-GPU loads of newly admitted requests' host hits.

Steps that only decode are run in bulk: up to the next request's last token, cut short
at the next step boundary when a request arrives. That keeps the event count near the
request count instead of the token count. A bulk step's length is priced with the KV
context at its start (it grows by one token per sequence per step, a small error).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Protocol

from index.codec import Event
from policies.cost_model import EngineCosts
from sim.cache import CacheFullError, PrefixCache
from sim.request import SimRequest


class EngineHooks(Protocol):
    """What an engine tells the simulation (all at the engine's current time)."""

    def at(self, time_ms: float, fn: Callable[..., None], *args: object) -> None: ...
    def first_token(self, req: SimRequest, now: float) -> None: ...
    def finished(self, req: SimRequest, now: float) -> None: ...
    def rejected(self, req: SimRequest, now: float) -> None: ...
    def publish(self, engine: BatchEngine, events: list[Event], now: float) -> None: ...


class BatchEngine:
    def __init__(
        self,
        worker_id: str,
        cache: PrefixCache,
        costs: EngineCosts,
        hooks: EngineHooks,
        *,
        max_num_seqs: int = 256,
    ) -> None:
        self.worker_id = worker_id
        # what the router's index calls this engine's events: the engine itself, or (a
        # router blind to DP ranks) its worker with the rank as the seq space
        self.source = worker_id
        self.dp_rank: int | None = None
        self.cache = cache
        self.costs = costs
        self.hooks = hooks
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[tuple[int, int, SimRequest]] = []  # (last step, id, request)
        self.steps = 0  # scheduler steps completed
        self.seq = 0  # next KV event batch number
        self.busy = False
        self.prefill_tokens = 0  # prompt tokens computed (the engine's prefill load)
        self.busy_ms = 0.0
        self._chunks: list[tuple[SimRequest, int]] = []
        self._start = 0.0
        self._step_ms = 0.0
        self._k = 0  # steps in the step (or bulk of decode steps) under way
        self._version = 0
        # Decoding context: sum over decoding requests of (prompt + 1 - step they began).
        self._kv_base = 0
        self._left_waiting = 0  # requests the last schedule left waiting

    # -- load as the engine reports it ------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def reported_waiting(self) -> int:
        """Waiting as vLLM reports it: those its last schedule left waiting. A request
        that arrives during a step sits in vLLM's input queue, not in ``waiting``, until
        the next schedule takes it (vllm/v1/engine/core.py ``run_busy_loop``; the stats
        are made after the step, in ``update_from_output``), so it counts as waiting
        only if that schedule leaves it there too."""
        return self._left_waiting if self.busy else len(self.waiting)

    def _decode_kv_tokens(self) -> int:
        return self._kv_base + len(self.decoding) * self.steps

    # -- input --------------------------------------------------------------------------
    def submit(self, req: SimRequest, now: float) -> None:
        self.waiting.append(req)
        if not self.busy:
            self._start_step(now)
        elif self._k > 1:
            self._cut_bulk(now)

    def _cut_bulk(self, now: float) -> None:
        """End a bulk of decode steps at the next step boundary so a newcomer can join."""
        done = int((now - self._start) // self._step_ms)
        k = done + 1
        if k < self._k:
            self._k = k
            self._version += 1
            self.hooks.at(self._start + k * self._step_ms, self._end_step, self._version)

    # -- steps --------------------------------------------------------------------------
    def _admit(self, now: float, budget: int) -> tuple[list[tuple[SimRequest, int]], float]:
        """Plan the step's prefill chunks; the planned compute and load time."""
        costs = self.costs
        bs = self.cache.block_size
        chunks: list[tuple[SimRequest, int]] = []
        ms = 0.0
        for req in self.prefilling:
            if budget <= 0:
                break
            take = min(budget, req.input_len - req.computed)
            ms += costs.prefill_ms(take, req.computed)
            chunks.append((req, take))
            budget -= take
        waiting = self.waiting
        while budget > 0 and waiting and self.running < self.max_num_seqs:
            req = waiting[0]
            try:
                alloc = self.cache.allocate(
                    req.rid,
                    req.tokens,
                    block_hashes=req.engine_hashes,
                    reserve_tokens=req.output_len,
                )
            except CacheFullError:
                waiting.popleft()
                self.hooks.rejected(req, now)
                continue
            if alloc is None:
                break
            waiting.popleft()
            req.admit_ms = now
            req.hit_gpu_blocks = alloc.gpu_hit_blocks
            req.hit_host_blocks = alloc.host_hit_blocks
            req.computed = (alloc.gpu_hit_blocks + alloc.host_hit_blocks) * bs
            ms += costs.load_ms("cpu", alloc.host_hit_blocks * bs)
            self.prefilling.append(req)
            take = min(budget, req.input_len - req.computed)
            ms += costs.prefill_ms(take, req.computed)
            chunks.append((req, take))
            budget -= take
        return chunks, ms

    def _start_step(self, now: float) -> None:
        n_dec = len(self.decoding)
        chunks, prefill_ms = self._admit(now, self.costs.max_batch_tokens - n_dec)
        self._left_waiting = len(self.waiting)
        if not chunks and not n_dec:
            self.busy = False
            return
        step = self.costs.step_ms(decode_seqs=n_dec, decode_kv_tokens=self._decode_kv_tokens())
        if chunks:
            for req, take in chunks:
                self.cache.commit(req.rid, req.computed + take)
            k = 1
            step += prefill_ms
        else:
            k = self.decoding[0][0] - self.steps
        self._chunks = chunks
        self._start, self._step_ms, self._k = now, step, k
        self.busy = True
        self._version += 1
        self.hooks.at(now + k * step, self._end_step, self._version)

    def _end_step(self, version: int) -> None:
        if version != self._version:
            return  # superseded by a cut bulk
        now = self._start + self._k * self._step_ms
        self.busy_ms += now - self._start
        self.steps += self._k
        hooks = self.hooks
        prefilled = False
        for req, take in self._chunks:
            req.computed += take
            self.prefill_tokens += take
            if req.computed >= req.input_len:
                prefilled = True
                hooks.first_token(req, now)
                if req.output_len <= 1:
                    self._finish(req, now)
                else:
                    req.decode_from = self.steps
                    self._kv_base += req.input_len + 1 - self.steps
                    heapq.heappush(self.decoding, (self.steps + req.output_len - 1, req.idx, req))
        if prefilled:
            self.prefilling = [r for r in self.prefilling if r.computed < r.input_len]
        decoding = self.decoding
        while decoding and decoding[0][0] <= self.steps:
            _, _, req = heapq.heappop(decoding)
            self._kv_base -= req.input_len + 1 - req.decode_from
            self._finish(req, now)
        events = self.cache.drain_events()
        if events:
            hooks.publish(self, events, now)
        self._start_step(now)

    def _finish(self, req: SimRequest, now: float) -> None:
        self.cache.release(req.rid)
        self.hooks.finished(req, now)

    def publish_now(self, now: float) -> None:
        """Send events produced outside a step (a prefetch landing) right away."""
        events = self.cache.drain_events()
        if events:
            self.hooks.publish(self, events, now)
