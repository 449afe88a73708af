"""The KV-cache groups past the first of a hybrid model, for the engine cache model.

``PrefixCache`` is group 0, full attention. A hybrid engine also keeps, per extra group,
the blocks that group still caches, each group with its own page budget and LRU, and
reports them as vLLM does (``BlockStored`` / ``BlockRemoved`` with ``group_idx``,
``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``):

- a sliding-window group caches every block it computes, and loses the oldest first
  (its pages turn over faster than full attention's: a long prompt's early blocks are
  gone while its prefix is still in the full-attention group);
- a Mamba group saves its state only where a computed chunk ends (vLLM's "align" mode:
  block-aligned chunk ends), so a hit can land only there.

A request's hit is the deepest prefix every group reuses, by ``index.groups``' plain
rules (``reference_depth``): this is the engine's truth the router must not promise past.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from index.codec import BlockRemoved, BlockStored, Event
from index.groups import GroupSpec, reference_depth

GPU = "GPU"
# the kind names vLLM's events carry (``KVCacheSpecKind``)
SPEC_KIND = {"full": "full_attention", "sliding_window": "sliding_window", "mamba": "mamba"}


class ExtraGroups:
    """Groups 1.. of a hybrid engine: what each holds, and the events it emits."""

    def __init__(self, groups: Sequence[GroupSpec], block_size: int, capacity: int) -> None:
        if not groups or capacity <= 0:
            raise ValueError("extra groups need at least one group and a positive capacity")
        if any(g.ratio != 1 for g in groups):
            raise ValueError("the mock's groups share the engine's block size")
        self.specs = [GroupSpec("full"), *groups]
        self.block_size = block_size
        self.capacity = capacity
        self._held: list[OrderedDict[int, None]] = [OrderedDict() for _ in groups]

    def held(self, group: int) -> set[int]:
        return set(self._held[group - 1])

    def depth(self, hashes: Sequence[int], run: int) -> int:
        """The deepest hit ``<= run`` (group 0's leading run) every group reuses."""
        if run <= 0:
            return 0
        held = self._held

        def holds(g: int, i: int) -> bool:
            return i < run if g == 0 else hashes[i] in held[g - 1]

        return reference_depth(self.specs, holds, run, self.block_size)

    def touch(self, hashes: Sequence[int], depth: int) -> None:
        """A hit at ``depth`` used these groups' blocks: they are the newest now."""
        for gi, spec in enumerate(self.specs[1:]):
            lru = self._held[gi]
            if spec.kind == "mamba":
                used = hashes[depth - 1 : depth] if depth else []
            else:
                used = hashes[max(0, depth - spec.window_blocks(self.block_size)) : depth]
            for h in used:
                if h in lru:
                    lru.move_to_end(h)

    def commit(
        self, hashes: Sequence[int], tokens: Sequence[int], start: int, upto: int
    ) -> list[Event]:
        """Blocks ``start..upto`` computed (one scheduled chunk): what each group caches."""
        events: list[Event] = []
        bs = self.block_size
        for gi, spec in enumerate(self.specs[1:]):
            lru = self._held[gi]
            first = upto - 1 if spec.kind == "mamba" else start
            new = [i for i in range(first, upto) if hashes[i] not in lru]
            for i in range(first, upto):
                lru.pop(hashes[i], None)
                lru[hashes[i]] = None
            for run in _runs(new):
                events.append(
                    BlockStored(
                        block_hashes=[hashes[i] for i in run],
                        parent_block_hash=hashes[run[0] - 1] if run[0] else None,
                        token_ids=[int(t) for t in tokens[run[0] * bs : (run[-1] + 1) * bs]],
                        block_size=bs,
                        medium=GPU,
                        group_idx=gi + 1,
                        kv_cache_spec_kind=SPEC_KIND[spec.kind],
                        kv_cache_spec_sliding_window=spec.window or None,
                    )
                )
            gone: list[int | bytes] = []
            while len(lru) > self.capacity:
                gone.append(lru.popitem(last=False)[0])
            if gone:
                events.append(BlockRemoved(block_hashes=gone, medium=GPU, group_idx=gi + 1))
        return events

    def clear(self) -> None:
        for lru in self._held:
            lru.clear()


def _runs(indices: list[int]) -> list[list[int]]:
    """Consecutive runs of ``indices`` (sorted): one event each, chained to its parent."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
