"""Tokenizer-side rolling block hashes.

Each full block of ``block_size`` tokens gets one 64-bit key that chains its parent:
``h[i] = xxh3_64(tokens[i*B:(i+1)*B] as little-endian u32, seed=h[i-1])``. Using the
parent hash as the xxh3 seed folds the bigram (parent hash, block tokens) into one
integer, so the whole radix tree flattens into a single hash map and block ``i`` can
be probed without walking blocks ``0..i-1``.

A LoRA adapter changes every block, so it enters the root seed. Per-block extra keys
(a cache salt on block 0, multimodal content hashes) enter the block they belong to,
in the same form vLLM reports them in ``BlockStored.extra_keys``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import TypeAlias

import msgpack
import xxhash

_xxh3 = xxhash.xxh3_64_intdigest
_LITTLE = sys.byteorder == "little"

TokenIds: TypeAlias = "Sequence[int] | array[int] | bytes | memoryview"


def token_bytes(token_ids: TokenIds) -> bytes | memoryview:
    """Little-endian u32 bytes of ``token_ids`` (zero-copy when already packed)."""
    if isinstance(token_ids, bytes | memoryview):
        return token_ids
    if (
        isinstance(token_ids, array)
        and token_ids.typecode in ("I", "L")
        and token_ids.itemsize == 4
    ):
        packed = token_ids
    else:
        packed = array("I", token_ids)
    if not _LITTLE:
        packed = array("I", packed)
        packed.byteswap()
    return memoryview(packed).cast("B")


class BlockHasher:
    """Computes the router's rolling block hashes for one pool.

    ``bigram=True`` is for EAGLE-style engines that cache token bigrams: each block
    is hashed over ``block_size + 1`` tokens (its own plus the next block's first),
    with stride ``block_size``.
    """

    __slots__ = ("_step", "bigram", "block_size", "seed")

    def __init__(self, block_size: int, seed: int = 0, *, bigram: bool = False) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.seed = seed & 0xFFFF_FFFF_FFFF_FFFF
        self.bigram = bigram
        self._step = block_size * 4

    def root(self, lora_name: str | None = None) -> int:
        """The chain's starting value: the seed, mixed with the LoRA adapter if any."""
        if not lora_name:
            return self.seed
        return _xxh3(lora_name.encode(), self.seed)

    def num_blocks(self, num_tokens: int) -> int:
        """How many full blocks ``num_tokens`` tokens make (what gets hashed)."""
        if self.bigram:
            return max(0, (num_tokens - 1) // self.block_size)
        return num_tokens // self.block_size

    def hash_tokens(
        self,
        token_ids: TokenIds,
        *,
        parent: int | None = None,
        lora_name: str | None = None,
        block_extras: Mapping[int, bytes] | None = None,
    ) -> list[int]:
        """Rolling hashes of every full block of ``token_ids``.

        ``parent`` continues an existing chain (the hash of the block before
        ``token_ids[0]``); otherwise the chain starts at ``root(lora_name)``.
        ``block_extras`` maps a block index to bytes mixed into that block only (see
        ``extra_key_bytes``).
        """
        buf = token_bytes(token_ids)
        step = self._step
        n = self.num_blocks(len(buf) // 4)
        window = step + 4 if self.bigram else step
        h = self.root(lora_name) if parent is None else parent
        out: list[int] = []
        append = out.append
        if not block_extras:
            for start in range(0, n * step, step):
                h = _xxh3(buf[start : start + window], h)
                append(h)
            return out
        for i in range(n):
            start = i * step
            extra = block_extras.get(i)
            chunk = buf[start : start + window]
            h = _xxh3(bytes(chunk) + extra if extra else chunk, h)
            append(h)
        return out


def extra_key_bytes(keys: Sequence[object]) -> bytes:
    """Canonical bytes of one block's extra keys (cache salt, multimodal hashes).

    Both sides use this: the request side for what it knows of a request, the event
    side for ``BlockStored.extra_keys[i]``, so equal keys give equal block hashes.
    """
    packed: bytes = msgpack.packb(list(keys), default=str, use_bin_type=True)
    return packed


def salt_extras(cache_salt: str | None) -> dict[int, bytes] | None:
    """Block extras for a request's ``cache_salt``: like vLLM, it touches block 0 only."""
    return {0: extra_key_bytes((cache_salt,))} if cache_salt else None
