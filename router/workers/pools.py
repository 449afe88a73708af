"""A pool: workers that share a block size, and so one hasher, one index, one ingest.

Block hashes depend on the block size, so the index is per pool; a model is served by
exactly one pool (the config checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

from index.backend import NativePrefixIndex, make_ingest, use_native
from index.hashing import BlockHasher
from index.ingest import EventIngest
from index.prefix_index import PrefixIndex


@dataclass(slots=True)
class Pool:
    name: str
    block_size: int
    hasher: BlockHasher
    index: PrefixIndex | NativePrefixIndex
    ingest: EventIngest

    @classmethod
    def create(
        cls, name: str, block_size: int, max_blocks: int | None = None, *, keep_names: bool = True
    ) -> Pool:
        """``keep_names``: keep the bytes engines name blocks by (prefetch hints need them;
        ``EventIngest``)."""
        hasher = BlockHasher(block_size)
        # The native index when built (a fraction of the memory, events applied with the
        # GIL released). It holds at most 64 workers: a bigger pool needs
        # CACHE_ROUTER_INDEX=python (adding the 65th worker says so).
        index = (
            NativePrefixIndex(max_blocks=max_blocks)
            if use_native() and NativePrefixIndex is not None
            else PrefixIndex(max_blocks=max_blocks)
        )
        ingest = make_ingest(index, hasher, keep_names=keep_names)
        return cls(name, block_size, hasher, index, ingest)
