"""The engine's paged prefix cache: what a vLLM-like engine holds, and the KV events it emits.

Shared by the trace-replay simulator and the mock engine, so both behave the same.

- GPU (L1) tier: ``gpu_blocks`` pages of ``block_size`` tokens. Running requests pin
  (reference) the blocks they use; only unreferenced cached blocks can be evicted, in
  LRU order. A request's uncached pages are private until ``commit`` makes them cached.
- Host (L2) tier, optional: ``host_blocks`` pages with their own LRU. A block evicted from
  GPU is demoted there, unless its parent is cached nowhere (it could never be hit). A
  host hit is copied back to GPU on ``allocate``; ``prefetch`` lands blocks there (or in
  GPU when there is no host tier).
- Block hashes are the engine's own chain (keyed blake2b over the parent hash and the
  block's u32 token bytes), like vLLM's sha256 chain: opaque to the router, which rehashes
  ``token_ids`` from the events. Engines built with the same ``seed`` agree on hashes, so a
  target engine can pull blocks named by a source engine's hashes.
- Events follow vLLM: ``BlockStored`` when blocks become cached (medium "GPU" or "CPU"),
  ``BlockRemoved`` when they leave a tier, ``AllBlocksCleared`` on ``clear``.

Plain synchronous code: no clock, no I/O; callers own time and transport.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

from index.codec import AllBlocksCleared, BlockRemoved, BlockStored, Event
from index.groups import GroupSpec
from index.hashing import TokenIds, token_bytes
from sim.hybrid import ExtraGroups

GPU = "GPU"
CPU = "CPU"


def engine_block_hashes(
    token_ids: TokenIds,
    block_size: int,
    seed: int = 0,
    parent: int | None = None,
    keys: Mapping[int, list[Any]] | None = None,
) -> list[int]:
    """The engine-side hash of every full block of ``token_ids``, chained from ``parent``;
    ``keys``: per block, extra keys mixed in (multimodal items, as vLLM does)."""
    key = (seed & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little")
    data = bytes(token_bytes(token_ids))
    step = block_size * 4
    prev = (parent or 0).to_bytes(8, "little")
    out: list[int] = []
    for i, start in enumerate(range(0, (len(data) // step) * step, step)):
        extra = repr(keys[i]).encode() if keys and i in keys else b""
        prev = blake2b(prev + data[start : start + step] + extra, digest_size=8, key=key).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


def lora_root(lora: str | None) -> int | None:
    """Where an adapter's chain starts: its blocks never share a hash with the base model's
    (vLLM puts the adapter in every block's extra keys)."""
    if not lora:
        return None
    return int.from_bytes(blake2b(b"lora\0" + lora.encode(), digest_size=8).digest(), "little")


def _as_list(tokens: Sequence[int]) -> list[int]:
    """Event payloads need plain ints; ``array('I')`` converts fastest with ``tolist``."""
    return tokens.tolist() if isinstance(tokens, array) else list(tokens)


@dataclass(frozen=True, slots=True)
class Allocation:
    """What ``allocate`` found and reserved for one request."""

    gpu_hit_blocks: int  # prompt-prefix blocks found in GPU memory
    host_hit_blocks: int  # prompt-prefix blocks copied back from host memory
    new_blocks: int  # pages reserved for the rest of the prompt and ``reserve_tokens``


# (hash, parent, tokens, adapter, multimodal keys) of a block an operation stored
_Record = tuple[int, int | None, Sequence[int], str | None, list[Any] | None]


def _extra_keys(per_block: list[list[Any] | None]) -> list[Any] | None:
    """An event's ``extra_keys``: one entry per block, or none at all without any."""
    return per_block if any(per_block) else None


class _Block:
    """One cached page. ``tokens`` is kept only with a host tier (demotion re-emits them)."""

    __slots__ = ("keys", "lora", "parent", "ref", "tokens")

    def __init__(
        self,
        parent: int | None,
        tokens: Sequence[int] | None,
        lora: str | None = None,
        keys: list[Any] | None = None,
    ) -> None:
        self.parent = parent
        self.tokens = tokens
        self.lora = lora  # the adapter the block was computed with (its events name it)
        self.keys = keys  # its multimodal extra keys, as its events carry them
        self.ref = 0


class _Request:
    __slots__ = ("committed", "hashes", "keys", "lora", "pinned", "private", "tokens")

    def __init__(
        self,
        hashes: list[int],
        tokens: Sequence[int],
        lora: str | None,
        keys: Mapping[int, list[Any]] | None,
    ) -> None:
        self.hashes = hashes
        self.tokens = tokens
        self.lora = lora
        self.keys = keys or {}
        self.pinned: list[int] = []  # cached blocks this request references, in order
        self.committed = 0  # leading prompt blocks that are cached (hit or computed)
        self.private = 0  # pages owned by the request alone (uncached or partial)


class CacheFullError(RuntimeError):
    """The request can never fit: it needs more pages than the GPU has."""


class PrefixCache:
    """A paged prefix cache with LRU eviction of unreferenced blocks and KV events."""

    def __init__(
        self,
        block_size: int,
        gpu_blocks: int,
        host_blocks: int = 0,
        seed: int = 0,
        *,
        groups: Sequence[GroupSpec] = (),
        group_blocks: int = 0,
    ) -> None:
        """``groups``: a hybrid model's KV-cache groups after the first (full attention,
        this cache), each holding up to ``group_blocks`` blocks (``sim.hybrid``)."""
        if block_size <= 0 or gpu_blocks <= 0 or host_blocks < 0:
            raise ValueError("block_size and gpu_blocks must be positive, host_blocks >= 0")
        self.extra = ExtraGroups(groups, block_size, group_blocks or gpu_blocks) if groups else None
        # a hybrid engine names each group's kind on its stores, group 0's too (vLLM)
        self._group0: dict[str, Any] = (
            {"group_idx": 0, "kv_cache_spec_kind": "full_attention"} if groups else {}
        )
        self.block_size = block_size
        self.gpu_blocks = gpu_blocks
        self.host_blocks = host_blocks
        self.seed = seed
        self._gpu: dict[int, _Block] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced GPU blocks
        self._host: OrderedDict[int, _Block] = OrderedDict()
        self._private = 0
        self._requests: dict[str, _Request] = {}
        self._events: list[Event] = []
        # Changes of the operation under way, turned into few events by ``_flush``.
        # (hash, parent, tokens, adapter) per stored block
        self._stored: dict[str, list[_Record]] = {CPU: [], GPU: []}
        self._removed: dict[str, list[int]] = {CPU: [], GPU: []}

    # -- read-only ---------------------------------------------------------------
    def hash_blocks(
        self,
        token_ids: Sequence[int],
        lora: str | None = None,
        keys: Mapping[int, list[Any]] | None = None,
    ) -> list[int]:
        return engine_block_hashes(token_ids, self.block_size, self.seed, lora_root(lora), keys)

    @property
    def gpu_used(self) -> int:
        """GPU pages holding anything (cached, pinned or private)."""
        return len(self._gpu) + self._private

    @property
    def host_used(self) -> int:
        return len(self._host)

    @property
    def usage(self) -> float:
        """Like vLLM's ``kv_cache_usage``: evictable cached pages count as free."""
        return (self.gpu_used - len(self._lru)) / self.gpu_blocks

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def gpu_hashes(self) -> set[int]:
        return set(self._gpu)

    def host_hashes(self) -> set[int]:
        return set(self._host)

    def lookup(self, hashes: Sequence[int]) -> tuple[int, int]:
        """(leading blocks in GPU, further leading blocks reachable through host memory)."""
        gpu, host = self._gpu, self._host
        n = len(hashes)
        i = 0
        while i < n and hashes[i] in gpu:
            i += 1
        j = i
        while j < n and (hashes[j] in host or hashes[j] in gpu):
            j += 1
        return i, j - i

    # -- requests ----------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        block_hashes: Sequence[int] | None = None,
        reserve_tokens: int = 0,
        lora: str | None = None,
        keys: Mapping[int, list[Any]] | None = None,
    ) -> Allocation | None:
        """Pin the prompt's cached prefix and reserve pages for the rest.

        Host hits are copied back to GPU. At least the last prompt token is always
        recomputed (as in vLLM), so a hit never covers the whole prompt. Returns None,
        changing nothing, when the pages cannot be freed now; raises ``CacheFullError``
        when the request could never fit.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds pages")
        bs = self.block_size
        n_tokens = len(token_ids)
        total = self.blocks_needed(n_tokens + reserve_tokens)
        if total > self.gpu_blocks:
            raise CacheFullError(f"request needs {total} pages, the GPU has {self.gpu_blocks}")
        if block_hashes is not None:
            hashes = list(block_hashes)
        else:
            hashes = self.hash_blocks(token_ids, lora, keys)
        cap = min(len(hashes), max(0, (n_tokens - 1) // bs))
        gpu, lru, host = self._gpu, self._lru, self._host
        lead = 0
        while lead < cap and hashes[lead] in gpu:
            lead += 1
        run = lead
        in_gpu_evictable = sum(1 for h in hashes[:lead] if h in lru)
        in_gpu = lead
        while run < cap:
            h = hashes[run]
            if h in gpu:
                in_gpu += 1
                in_gpu_evictable += h in lru
            elif h not in host:
                break
            run += 1
        if self.extra is not None:
            # a hybrid model reuses only as deep as every KV-cache group can
            depth = self.extra.depth(hashes, run)
            if depth < run:
                run, lead = depth, min(lead, depth)
                in_gpu = sum(1 for h in hashes[:run] if h in gpu)
                in_gpu_evictable = sum(1 for h in hashes[:run] if h in lru)
        need = total - in_gpu
        free = self.gpu_blocks - self.gpu_used
        if need > free + len(lru) - in_gpu_evictable:
            return None
        if self.extra is not None:
            self.extra.touch(hashes, run)
        req = _Request(hashes, token_ids, lora, keys)
        # Snapshot host hits first: demotions below may push them out of host memory.
        from_host = [(i, host[hashes[i]]) for i in range(lead, run) if hashes[i] not in gpu]
        for h in hashes[:run]:
            block = gpu.get(h)
            if block is not None:
                self._pin(h, block)
        self._evict_gpu(need - free)
        self._load(req, from_host)
        self._flush()
        req.pinned.extend(hashes[:run])
        req.committed = run
        req.private = total - run
        self._private += req.private
        self._requests[request_id] = req
        return Allocation(run - len(from_host), len(from_host), req.private)

    def commit(self, request_id: str, num_computed_tokens: int) -> int:
        """Cache the prompt's full blocks up to ``num_computed_tokens``; new blocks cached.

        Called as the engine schedules prefill chunks (vLLM caches a block once the
        step that computes it is scheduled).
        """
        req = self._requests[request_id]
        upto = min(len(req.hashes), num_computed_tokens // self.block_size)
        if upto <= req.committed:
            return 0
        gpu, hashes = self._gpu, req.hashes
        tokens = req.tokens if self.host_blocks else None
        bs = self.block_size
        stored: list[int | bytes] = []
        first = start = req.committed
        parent = hashes[start - 1] if start else None
        for i in range(start, upto):
            h = hashes[i]
            block = gpu.get(h)
            if block is None:
                block = gpu[h] = _Block(
                    parent,
                    None if tokens is None else tokens[i * bs : (i + 1) * bs],
                    req.lora,
                    req.keys.get(i),
                )
                block.ref = 1
                if not stored:
                    first = i
                stored.append(h)
            else:
                # Someone cached the same block meanwhile: share it, free our page.
                self._flush_stored(req, first, stored)
                stored = []
                self._pin(h, block)
            parent = h
        self._flush_stored(req, first, stored)
        if self.extra is not None:
            self._events.extend(self.extra.commit(hashes, req.tokens, start, upto))
        req.pinned.extend(hashes[start:upto])
        new = upto - start
        req.private -= new
        self._private -= new
        req.committed = upto
        return new

    def release(self, request_id: str) -> None:
        """The request finished: unpin its blocks (tail first, so tails evict first)."""
        req = self._requests.pop(request_id)
        gpu, lru = self._gpu, self._lru
        for h in reversed(req.pinned):
            block = gpu[h]
            block.ref -= 1
            if block.ref == 0:
                lru[h] = None
        self._private -= req.private

    # -- transfers ----------------------------------------------------------------
    def prefetch(
        self,
        token_ids: Sequence[int],
        *,
        block_hashes: Sequence[int] | None = None,
        max_blocks: int | None = None,
    ) -> int:
        """Place the leading blocks of ``token_ids`` in host memory (GPU without a host tier).

        Models the end of a transfer from another engine or the shared pool. Blocks
        already here are skipped; returns how many were placed.
        """
        hashes = list(block_hashes) if block_hashes is not None else self.hash_blocks(token_ids)
        n = min(len(hashes), len(token_ids) // self.block_size)
        if max_blocks is not None:
            n = min(n, max_blocks)
        place = self._place_host if self.host_blocks else self._place_gpu
        placed = 0
        bs = self.block_size
        for i in range(n):
            h = hashes[i]
            if h in self._gpu or h in self._host:
                continue
            if not place(h, hashes[i - 1] if i else None, token_ids[i * bs : (i + 1) * bs]):
                break
            placed += 1
        self._flush()
        return placed

    def clear(self) -> None:
        """Drop every cached block (engine reset); only when no request holds pages."""
        if self._requests:
            raise RuntimeError("cannot clear the cache while requests hold pages")
        self._gpu.clear()
        self._lru.clear()
        self._host.clear()
        if self.extra is not None:
            self.extra.clear()
        self._events.append(AllBlocksCleared())

    def drain_events(self) -> list[Event]:
        """Events since the last call, in order (one engine step's batch)."""
        events, self._events = self._events, []
        return events

    # -- internals ------------------------------------------------------------------
    def _pin(self, h: int, block: _Block) -> None:
        if block.ref == 0:
            self._lru.pop(h, None)
        block.ref += 1

    def _flush_stored(self, req: _Request, first: int, stored: list[int | bytes]) -> None:
        if not stored:
            return
        bs = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=stored,
                parent_block_hash=req.hashes[first - 1] if first else None,
                token_ids=_as_list(req.tokens[first * bs : (first + len(stored)) * bs]),
                block_size=bs,
                medium=GPU,
                lora_name=req.lora,
                extra_keys=_extra_keys(
                    [req.keys.get(i) for i in range(first, first + len(stored))]
                ),
                **self._group0,
            )
        )

    def _evict_gpu(self, count: int) -> None:
        """Evict ``count`` unreferenced GPU blocks, oldest first (demoting them to host)."""
        gpu, lru, host = self._gpu, self._lru, self._host
        removed = self._removed[GPU]
        for _ in range(count):
            h, _none = lru.popitem(last=False)
            block = gpu.pop(h)
            parent = block.parent
            # An orphan (parent cached nowhere) can never be part of a prefix hit.
            if (
                self.host_blocks
                and h not in host
                and (parent is None or parent in gpu or parent in host)
            ):
                self._place_host(h, parent, block.tokens, block.lora, block.keys)
            removed.append(h)

    def _place_host(
        self,
        h: int,
        parent: int | None,
        tokens: Sequence[int] | None,
        lora: str | None = None,
        keys: list[Any] | None = None,
    ) -> bool:
        """Put a block in host memory, evicting the oldest host block when full."""
        host = self._host
        if parent is not None and parent in host:
            host.move_to_end(parent)  # keep the chain whole: evict someone else
        if len(host) >= self.host_blocks:
            old, _block = host.popitem(last=False)
            self._removed[CPU].append(old)
        host[h] = _Block(parent, tokens, lora, keys)
        self._stored[CPU].append((h, parent, tokens or (), lora, keys))
        return True

    def _place_gpu(self, h: int, parent: int | None, tokens: Sequence[int]) -> bool:
        """Put an unreferenced block in GPU memory; False when only its parent could go."""
        lru = self._lru
        if parent is not None and parent in lru:
            lru.move_to_end(parent)
        if self.gpu_used >= self.gpu_blocks:
            if not lru or next(iter(lru)) == parent:
                return False
            self._evict_gpu(1)
        self._gpu[h] = _Block(parent, None)
        lru[h] = None
        self._stored[GPU].append((h, parent, tokens, None, None))
        return True

    def _load(self, req: _Request, from_host: list[tuple[int, _Block]]) -> None:
        """Copy host blocks back to GPU, pinned."""
        gpu, host, hashes, bs = self._gpu, self._host, req.hashes, self.block_size
        stored = self._stored[GPU]
        for i, src in from_host:
            h = hashes[i]
            block = gpu[h] = _Block(src.parent, src.tokens, src.lora, src.keys)
            block.ref = 1
            if h in host:
                host.move_to_end(h)
            stored.append((h, src.parent, req.tokens[i * bs : (i + 1) * bs], src.lora, src.keys))

    def _flush(self) -> None:
        """Events for one operation's changes: stores as chains, then removals.

        Stores go first, parents before children, so every stored block chains to one
        the consumer knows; removals follow, minus blocks present again at the end.
        The consumer ends in the same state as after block-by-block events, with a
        handful of events instead of one per block.
        """
        for medium in (CPU, GPU):
            records = self._stored[medium]
            if records:
                self._events.extend(self._chains(records, medium))
                records.clear()
        for medium, tier in ((CPU, self._host), (GPU, self._gpu)):
            removed = self._removed[medium]
            if removed:
                gone: list[int | bytes] = [h for h in dict.fromkeys(removed) if h not in tier]
                if gone:
                    self._events.append(BlockRemoved(block_hashes=gone, medium=medium))
                removed.clear()

    def _chains(self, records: list[_Record], medium: str) -> list[BlockStored]:
        """Stored blocks as chain events (one per run of parent -> child), parents first."""
        by_hash = {r[0]: r for r in records}
        children: dict[int | None, list[int]] = {}
        for h, parent, *_rest in by_hash.values():
            children.setdefault(parent, []).append(h)
        todo = [r[0] for r in by_hash.values() if r[1] not in by_hash]
        events: list[BlockStored] = []
        while todo:
            h = todo.pop()
            parent = by_hash[h][1]
            run: list[int] = []
            tokens: list[int] = []
            while True:
                run.append(h)
                tokens += _as_list(by_hash[h][2])
                kids = children.get(h)
                if not kids:
                    break
                h, *others = kids
                todo.extend(others)
            events.append(
                BlockStored(
                    block_hashes=[*run],
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=self.block_size,
                    medium=medium,
                    lora_name=by_hash[run[0]][3],
                    extra_keys=_extra_keys([by_hash[h][4] for h in run]),
                    **self._group0,
                )
            )
        return events
