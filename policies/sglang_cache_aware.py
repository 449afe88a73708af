"""A faithful re-implementation of SGLang router's ``cache_aware`` policy (CLI defaults).

SGLang's router never sees the engines' KV events. It keeps its own approximate radix
tree of the *text it routed*, one tenant per worker, and decides per request:

1. imbalanced = ``max_load - min_load > balance_abs_threshold`` and
   ``max_load > min_load * balance_rel_threshold`` (load = the router's in-flight
   request count, over all workers, healthy or not). If so: the healthy worker with the
   least load (first one on a tie, as in SGLang), and the request is still inserted.
2. otherwise the longest prefix match in the tree: if ``matched / length >
   cache_threshold`` (strictly) the worker that owns the deepest matched node,
   else the tenant holding the fewest entries (the emptiest cache); insert the request
   for the chosen worker. A tenant that is no longer a worker is dropped and the first
   healthy worker gets the request, as in SGLang.

Mapping to this router: the tree's "characters" are the request's block hashes. Block
hashes chain their parent, so a flat map ``hash -> {tenant: last access}`` *is* the
radix tree (a path is the run of present hashes from block 0), the match length is
``matched_blocks * block_size`` tokens out of ``num_tokens``, and ``max_tree_size``
counts blocks per tenant (SGLang's 2**26 characters ~ 2**24 tokens ~ 2**20 blocks of 16).
Per-tenant LRU eviction is leaf-first, as SGLang's, because a parent is always touched
after its children; it runs inline when a tenant outgrows its bound by 10 % instead of
on a 60-second timer. Where SGLang's choice is arbitrary (DashMap iteration order) this picks
the most recently used owner of the deepest node and breaks size ties at random.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence

from .base import Decision, Policy, RouteRequest, WorkerView
from .selection import healthy


class _Tree:
    """One model's approximate tree: per block hash, its tenants and their last access.

    Each touched block gets a fresh tick, parents after children, so "oldest tick first"
    is SGLang's leaf-first LRU without keeping a per-tenant list in order on every insert.
    """

    __slots__ = ("counts", "nodes", "tick")

    def __init__(self) -> None:
        self.nodes: dict[int, dict[str, int]] = {}  # block hash -> {tenant: last access}
        self.counts: dict[str, int] = {}  # tenant -> blocks it holds in the tree
        self.tick = 0

    def add_tenant(self, tenant: str) -> None:
        if tenant not in self.counts:
            self.counts[tenant] = 0

    def remove_tenant(self, tenant: str) -> None:
        self.counts.pop(tenant, None)
        nodes = self.nodes
        for h in [h for h, owners in nodes.items() if tenant in owners]:
            owners = nodes[h]
            del owners[tenant]
            if not owners:
                del nodes[h]

    def touch(self, hashes: Sequence[int], tenant: str) -> None:
        """Insert ``hashes`` for ``tenant`` or refresh them (children first)."""
        tick = self.tick
        nodes = self.nodes
        added = 0
        for h in reversed(hashes):
            tick += 1
            owners = nodes.get(h)
            if owners is None:
                nodes[h] = {tenant: tick}
                added += 1
            else:
                if tenant not in owners:
                    added += 1
                owners[tenant] = tick
        self.tick = tick
        self.counts[tenant] = self.counts.get(tenant, 0) + added

    def refresh(self, hashes: Sequence[int], tenant: str) -> None:
        """Mark a matched path as just used by ``tenant`` (SGLang's prefix_match does)."""
        tick = self.tick
        nodes = self.nodes
        for h in reversed(hashes):
            owners = nodes.get(h)
            if owners is not None and tenant in owners:
                tick += 1
                owners[tenant] = tick
        self.tick = tick

    def evict(self, max_size: int) -> None:
        """Drop every oversized tenant's least recently used blocks down to ``max_size``.

        One sweep serves all tenants, as SGLang's periodic eviction does: they grow at
        similar rates, so this runs about once per ``max_size / 10`` inserts in total.
        """
        over = {t: n - max_size for t, n in self.counts.items() if n > max_size}
        if not over:
            return
        held: dict[str, list[tuple[int, int]]] = {t: [] for t in over}
        nodes = self.nodes
        for h, owners in nodes.items():
            for t, tick in owners.items():
                if t in held:
                    held[t].append((tick, h))
        for tenant, excess in over.items():
            for _, h in heapq.nsmallest(excess, held[tenant]):
                owners = nodes[h]
                del owners[tenant]
                if not owners:
                    del nodes[h]
            self.counts[tenant] -= excess

    def prefix_match(self, hashes: Sequence[int]) -> tuple[int, str | None]:
        """Matched leading blocks and the most recent owner of the deepest one."""
        nodes = self.nodes
        depth = 0
        owners: dict[str, int] | None = None
        for h in hashes:
            found = nodes.get(h)
            if not found:
                break
            owners = found
            depth += 1
        if owners is None:
            return 0, None
        return depth, max(owners, key=owners.__getitem__)

    def smallest_tenant(self, rng: random.Random) -> str | None:
        counts = self.counts
        if not counts:
            return None
        lo = min(counts.values())
        ties = [t for t, n in counts.items() if n == lo]
        return ties[0] if len(ties) == 1 else ties[rng.randrange(len(ties))]


class SGLangCacheAware(Policy):
    """SGLang's cache_aware rule over an approximate, routing-fed tree (see module doc)."""

    name = "sglang_cache_aware"

    def __init__(
        self,
        rng: random.Random | None = None,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 2**20,
    ) -> None:
        super().__init__(rng)
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(
                f"sglang_cache_aware: cache_threshold must be in [0, 1], got {cache_threshold}"
            )
        if balance_abs_threshold < 0 or balance_rel_threshold < 0:
            raise ValueError("sglang_cache_aware: balance thresholds must be >= 0")
        if max_tree_size < 1:
            raise ValueError(f"sglang_cache_aware: max_tree_size must be >= 1, got {max_tree_size}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self._trees: dict[str, _Tree] = {}

    def _tree(self, model: str, workers: Sequence[WorkerView]) -> _Tree:
        tree = self._trees.get(model)
        if tree is None:
            tree = self._trees[model] = _Tree()
        counts = tree.counts
        for w in workers:
            if w.worker_id not in counts:
                tree.add_tenant(w.worker_id)
        return tree

    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        cands = healthy(workers)
        tree = self._tree(request.model, workers)
        hashes = request.block_hashes
        loads = [w.inflight_requests for w in workers]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            pick = min(cands, key=lambda w: w.inflight_requests)  # first minimum, as SGLang
            self._insert(tree, hashes, pick.worker_id)
            return Decision(pick.worker_id, scores=self._scores(tree, workers), reason="imbalanced")

        depth, owner = tree.prefix_match(hashes)
        chosen: str | None
        rate = depth * request.block_size / request.num_tokens if request.num_tokens > 0 else 0.0
        if owner is not None and rate > self.cache_threshold:
            chosen, reason = owner, f"cache hit {rate:.2f}"
        else:
            if owner is not None:
                tree.refresh(hashes[:depth], owner)
            chosen, reason = tree.smallest_tenant(self.rng), f"cache miss {rate:.2f}"
        view = next((w for w in workers if w.worker_id == chosen), None)
        if view is not None and view.healthy:
            self._insert(tree, hashes, view.worker_id)
            return Decision(view.worker_id, scores=self._scores(tree, workers), reason=reason)
        if view is None and chosen is not None:
            tree.remove_tenant(chosen)
        return Decision(cands[0].worker_id, reason=f"{reason}; {chosen} unavailable: first healthy")

    def _insert(self, tree: _Tree, hashes: Sequence[int], tenant: str) -> None:
        tree.touch(hashes, tenant)
        # SGLang trims every 60 s and lets trees overshoot meanwhile; trimming on a 10 %
        # overshoot keeps that shape and costs one sweep per max_tree_size / 10 inserts
        if tree.counts[tenant] > self.max_tree_size + self.max_tree_size // 10:
            tree.evict(self.max_tree_size)

    @staticmethod
    def _scores(tree: _Tree, workers: Sequence[WorkerView]) -> dict[str, dict[str, float]]:
        counts = tree.counts
        return {
            w.worker_id: {"load": w.inflight_requests, "tree_blocks": counts[w.worker_id]}
            for w in workers
        }
