"""A pool: workers that share a block size, and so one hasher, one index, one ingest.

Block hashes depend on the block size, so the index is per pool; a model is served by
exactly one pool (the config checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

from index.hashing import BlockHasher
from index.ingest import EventIngest
from index.prefix_index import PrefixIndex


@dataclass(slots=True)
class Pool:
    name: str
    block_size: int
    hasher: BlockHasher
    index: PrefixIndex
    ingest: EventIngest

    @classmethod
    def create(cls, name: str, block_size: int, max_blocks: int | None = None) -> Pool:
        hasher = BlockHasher(block_size)
        index = PrefixIndex(max_blocks=max_blocks)
        return cls(name, block_size, hasher, index, EventIngest(index, hasher))
