"""A mirror of what the engine's KV cache holds, rebuilt from its own events.

The agent answers a router whose requested seq has left the ring buffer with a *dump*:
``BlockStored`` events that re-create every block the engine holds, parents before
children, so the router can rehash token ids down each chain. Blocks are keyed by
(engine hash, medium, kv group): one hash can sit in the GPU and the host tier at once,
and a ``BlockRemoved`` names the tier it leaves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from index.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    EngineHash,
    Event,
    EventBatch,
    encode,
)

Key = tuple[EngineHash, str | None, int | None]  # (engine hash, medium, group_idx)


@dataclass(slots=True)
class _Block:
    parent: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: Any
    cache_salt: str | None  # SGLang's salt, on a chain's first block only


class EngineMirror:
    """Engine hash -> the ``BlockStored`` data of every block the engine holds."""

    def __init__(self) -> None:
        self._blocks: dict[Key, _Block] = {}
        self._tiers: set[tuple[str | None, int | None]] = set()  # (medium, group) seen

    def __len__(self) -> int:
        return len(self._blocks)

    def holds(self, engine_hash: EngineHash, medium: str | None = None) -> bool:
        return any(k[0] == engine_hash and k[1] == medium for k in self._blocks)

    def hashes(self, medium: str | None = None) -> set[EngineHash]:
        """Engine hashes held in ``medium`` (as the events named it)."""
        return {k[0] for k in self._blocks if k[1] == medium}

    def tokens_of(self, hashes: list[EngineHash]) -> list[int]:
        """Token ids of the leading ``hashes`` held in any tier (a peer's prefetch asks)."""
        out: list[int] = []
        for h in hashes:
            block = next(
                (b for m, g in self._tiers if (b := self._blocks.get((h, m, g))) is not None),
                None,
            )
            if block is None:
                break
            out.extend(block.token_ids)
        return out

    def clear(self) -> None:
        self._blocks.clear()

    def apply(self, batch: DecodedBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self._blocks.clear()
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._blocks.pop((h, event.medium, event.group_idx), None)
            else:
                self._store(event)

    def _store(self, event: BlockStored) -> None:
        size = event.block_size
        parent = event.parent_block_hash
        extras = event.extra_keys or []
        self._tiers.add((event.medium, event.group_idx))
        for i, h in enumerate(event.block_hashes):
            self._blocks[(h, event.medium, event.group_idx)] = _Block(
                parent=parent,
                token_ids=list(event.token_ids[i * size : (i + 1) * size]),
                block_size=size,
                lora_id=event.lora_id,
                lora_name=event.lora_name,
                extra_keys=extras[i] if i < len(extras) else None,
                cache_salt=event.cache_salt if i == 0 and parent is None else None,
            )
            parent = h

    def _ordered(self) -> list[Key]:
        """Keys of every block whose whole parent chain is held, parents first.

        A block whose parent the engine evicted first is left out with its descendants:
        nobody can rehash it without its ancestors' tokens, and a prefix match cannot
        reach it anyway.
        """
        children: dict[EngineHash, list[Key]] = {}
        roots: list[Key] = []
        for key, block in self._blocks.items():
            if block.parent is None:
                roots.append(key)
            else:
                children.setdefault(block.parent, []).append(key)
        out: list[Key] = []
        expanded: set[EngineHash] = set()
        stack = list(reversed(roots))
        while stack:
            key = stack.pop()
            out.append(key)
            if key[0] not in expanded:  # the same hash in another tier shares children
                expanded.add(key[0])
                stack.extend(reversed(children.get(key[0], [])))
        return out

    def dump(
        self, *, dp_rank: int | None = None, max_tokens: int = 16384, ts: float | None = None
    ) -> list[bytes]:
        """msgpack ``EventBatch`` chunks re-creating the cache, each about ``max_tokens``.

        A run of blocks that continue each other in one tier becomes one multi-block
        ``BlockStored``, as the engine itself reports a prompt's new blocks. Events are
        map-encoded: only that form carries every field (SGLang's ``cache_salt``).
        """
        ts = time.time() if ts is None else ts
        chunks: list[bytes] = []
        events: list[Event] = []  # stores only; EventBatch takes any event
        tokens = 0
        last: BlockStored | None = None
        for key in self._ordered():
            b = self._blocks[key]
            if (
                last is not None
                and b.parent == last.block_hashes[-1]
                and (key[1], key[2], b.block_size, b.lora_id, b.lora_name)
                == (last.medium, last.group_idx, last.block_size, last.lora_id, last.lora_name)
                and b.cache_salt is None
            ):
                last.block_hashes.append(key[0])
                last.token_ids.extend(b.token_ids)
                if last.extra_keys is not None or b.extra_keys is not None:
                    if last.extra_keys is None:
                        last.extra_keys = [None] * (len(last.block_hashes) - 1)
                    last.extra_keys.append(b.extra_keys)
            else:
                last = BlockStored(
                    block_hashes=[key[0]],
                    parent_block_hash=b.parent,
                    token_ids=list(b.token_ids),
                    block_size=b.block_size,
                    lora_id=b.lora_id,
                    medium=key[1],
                    lora_name=b.lora_name,
                    extra_keys=None if b.extra_keys is None else [b.extra_keys],
                    group_idx=key[2],
                    cache_salt=b.cache_salt,
                )
                events.append(last)
            tokens += len(b.token_ids)
            if tokens >= max_tokens:
                chunks.append(encode(EventBatch(ts, events, dp_rank), events_as_map=True))
                events, tokens, last = [], 0, None
        if events:
            chunks.append(encode(EventBatch(ts, events, dp_rank), events_as_map=True))
        return chunks
