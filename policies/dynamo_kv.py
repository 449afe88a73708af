"""A faithful re-implementation of NVIDIA Dynamo's KV-router cost (KvRouterConfig defaults).

Per candidate worker, lower is better::

    prefill_blocks = (active_prefill_tokens + isl) / block_size
    credit         = overlap_score_credit * decay * gpu_overlap
                   + host_cache_hit_weight * host_overlap + disk_cache_hit_weight * disk_overlap
                   + shared_cache_multiplier * shared_overlap
    logit          = prefill_load_scale * max(0, prefill_blocks - credit)
                   + decode_blocks + decode_active_request_weight * active_requests

``decode_blocks`` is the KV blocks the worker would hold with this request: the unique
blocks of its active sequences plus this request's blocks not already among them (the
trailing partial block always counts). Like Dynamo's router, the policy tracks active
sequences itself from its own decisions, so callers must call ``on_finish``. The overlap
comes from the index through ``WorkerView.match`` (Dynamo reads its KV indexer the same
way); ``active_prefill_tokens`` is ``WorkerView.inflight_prefill_tokens``.

``temperature == 0``: argmin, ties uniformly at random. ``> 0``: softmax sampling over
the costs normalised to [0, 1] by their range, negated and divided by the temperature.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Sequence

from .base import Decision, Policy, RouteRequest, WorkerView, prefix_depth
from .selection import argmin_random, healthy


class _Active:
    """One worker's active sequences: refcount per block hash, unique block count."""

    __slots__ = ("blocks", "refs")

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        self.blocks = 0

    def shared_prefix(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` already held by an active sequence.

        Every active sequence holds its chain from block 0, so membership is
        prefix-closed and a binary search over depth finds the boundary.
        """
        refs = self.refs
        if not refs:
            return 0
        return prefix_depth(len(hashes), lambda i: hashes[i] in refs)

    def add(self, hashes: Sequence[int], partial: int) -> None:
        refs = self.refs
        for h in hashes:
            n = refs.get(h, 0)
            refs[h] = n + 1
            if not n:
                self.blocks += 1
        self.blocks += partial

    def release(self, hashes: Sequence[int], partial: int) -> None:
        refs = self.refs
        for h in hashes:
            n = refs.get(h, 0)
            if n > 1:
                refs[h] = n - 1
            elif n == 1:
                del refs[h]
                self.blocks -= 1
        self.blocks -= partial


class DynamoKv(Policy):
    """Dynamo's KV cost function and selector (see module doc)."""

    name = "dynamo_kv"

    def __init__(
        self,
        rng: random.Random | None = None,
        *,
        prefill_load_scale: float = 1.0,
        overlap_score_credit: float = 1.0,
        overlap_score_credit_decay: float = 0.0,
        host_cache_hit_weight: float = 0.75,
        disk_cache_hit_weight: float = 0.25,
        shared_cache_multiplier: float = 0.0,
        decode_active_request_weight: float = 0.0,
        temperature: float = 0.0,
    ) -> None:
        super().__init__(rng)
        params = {
            "prefill_load_scale": prefill_load_scale,
            "overlap_score_credit": overlap_score_credit,
            "overlap_score_credit_decay": overlap_score_credit_decay,
            "host_cache_hit_weight": host_cache_hit_weight,
            "disk_cache_hit_weight": disk_cache_hit_weight,
            "shared_cache_multiplier": shared_cache_multiplier,
            "decode_active_request_weight": decode_active_request_weight,
            "temperature": temperature,
        }
        for key, value in params.items():
            if not value >= 0:
                raise ValueError(f"dynamo_kv: {key} must be >= 0, got {value}")
        self.prefill_load_scale = prefill_load_scale
        self.overlap_score_credit = overlap_score_credit
        self.overlap_score_credit_decay = overlap_score_credit_decay
        self.host_cache_hit_weight = host_cache_hit_weight
        self.disk_cache_hit_weight = disk_cache_hit_weight
        self.shared_cache_multiplier = shared_cache_multiplier
        self.decode_active_request_weight = decode_active_request_weight
        self.temperature = temperature
        self._active: dict[str, _Active] = {}
        self._requests: dict[str, tuple[str, Sequence[int], int]] = {}
        # first block -> worker -> its active sequences starting with it: where a new
        # request's decode term is lowered by a shared prefix (``must_see``)
        self._leading: dict[int, dict[str, int]] = {}

    def prunable(self, request: RouteRequest) -> bool:
        # with a decay the credit reads the least prefill load of all; with a temperature
        # the draw spans every candidate
        return self.overlap_score_credit_decay == 0 and self.temperature == 0

    def must_see(self, request: RouteRequest) -> Collection[str]:
        hashes = request.block_hashes
        return self._leading.get(hashes[0], ()) if hashes else ()

    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        cands = healthy(workers)
        bs = request.block_size
        isl = request.num_tokens
        hashes = request.block_hashes
        partial = 1 if isl % bs else 0
        request_blocks = len(hashes) + partial
        decay_k = self.overlap_score_credit_decay
        min_apt = min(w.inflight_prefill_tokens for w in cands) if decay_k > 0 else 0
        active = self._active
        logits: list[float] = []
        scores: dict[str, dict[str, float]] = {}
        for w in cands:
            m = w.match
            prefill = (w.inflight_prefill_tokens + isl) / bs
            decay = 1.0
            if decay_k > 0 and request_blocks:
                excess = max(w.inflight_prefill_tokens - min_apt, 0) / bs
                decay = 1.0 / (1.0 + decay_k * excess / request_blocks)
            credit = (
                self.overlap_score_credit * decay * m.gpu
                + self.host_cache_hit_weight * (m.cpu - m.gpu)
                + self.disk_cache_hit_weight * (m.disk - m.cpu)
                + self.shared_cache_multiplier * (m.total - m.disk)
            )
            seqs = active.get(w.worker_id)
            decode = float(request_blocks)
            if seqs is not None:
                decode += seqs.blocks - seqs.shared_prefix(hashes)
            adjusted = prefill - credit
            logit = (
                self.prefill_load_scale * (adjusted if adjusted > 0 else 0.0)
                + decode
                + self.decode_active_request_weight * w.inflight_requests
            )
            logits.append(logit)
            scores[w.worker_id] = {
                "logit": logit,
                "prefill_blocks": prefill,
                "credit_blocks": credit,
                "decode_blocks": decode,
                "overlap_blocks": m.total,
            }
        if self.temperature > 0:
            i, reason = self._sample(logits), "sampled"
        else:
            i, reason = argmin_random(logits, self.rng), "min cost"
        chosen = cands[i].worker_id
        self._track(request, chosen, partial)
        return Decision(chosen, scores=scores, reason=reason)

    def _sample(self, logits: list[float]) -> int:
        """Softmax over range-normalised, negated costs; one uniform draw (inverse CDF)."""
        lo, hi = min(logits), max(logits)
        if hi == lo:
            return self.rng.randrange(len(logits))
        scale = (hi - lo) * self.temperature
        weights = [math.exp(-(x - lo) / scale) for x in logits]
        r = self.rng.random() * sum(weights)
        for i, wt in enumerate(weights):
            r -= wt
            if r < 0:
                return i
        return len(weights) - 1

    def _track(self, request: RouteRequest, worker_id: str, partial: int) -> None:
        seqs = self._active.get(worker_id)
        if seqs is None:
            seqs = self._active[worker_id] = _Active()
        old = self._requests.pop(request.request_id, None)
        if old is not None:  # a retried request id: its earlier placement is void
            self._release(old)
        seqs.add(request.block_hashes, partial)
        self._requests[request.request_id] = (worker_id, request.block_hashes, partial)
        if request.block_hashes:
            lead = self._leading.setdefault(request.block_hashes[0], {})
            lead[worker_id] = lead.get(worker_id, 0) + 1

    def _release(self, entry: tuple[str, Sequence[int], int]) -> None:
        worker_id, hashes, partial = entry
        seqs = self._active.get(worker_id)
        if seqs is not None:
            seqs.release(hashes, partial)
        lead = self._leading.get(hashes[0]) if hashes else None
        if lead is not None and worker_id in lead:
            if lead[worker_id] > 1:
                lead[worker_id] -= 1
            else:
                del lead[worker_id]
                if not lead:
                    del self._leading[hashes[0]]

    def on_finish(self, request: RouteRequest, worker_id: str) -> None:
        entry = self._requests.pop(request.request_id, None)
        if entry is not None:
            self._release(entry)

    def active_blocks(self, worker_id: str) -> int:
        """Unique KV blocks of the worker's active sequences, as this policy tracks them."""
        seqs = self._active.get(worker_id)
        return seqs.blocks if seqs is not None else 0
