"""Prefix index: tokenizer-side block hashes, the bigram-keyed index, KV-event ingest.

Plain synchronous code with no I/O; everything else imports it, it imports nothing of
the project.

    hashing        rolling block hashes of token ids (``BlockHasher``), extra keys
    prefix_index   the bigram-keyed index: which worker holds which block, per tier
    codec          vLLM / SGLang ``EventBatch`` msgpack (and JSON) encode/decode
    ingest         per-worker event ingest: engine hashes -> router hashes -> index, seq gaps
    wire           the NATS wire: subjects, ``Kv-*`` headers, stream defaults, schemas
    gapfill        the gap-fill protocol (``<prefix>.replay.<worker>``) router <-> agent
    reuse          online LRU stack distances of a block stream
    capacity       the capacity forecast built on them
"""

from index.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CodecError,
    DecodedBatch,
    EventBatch,
    decode,
    decode_json,
    encode,
    encode_json,
)
from index.hashing import BlockHasher, RouterHash, extra_key_bytes, salt_extras
from index.ingest import EventIngest, IngestResult, SeqStatus, tier_of_medium
from index.prefix_index import TIERS, IndexStats, PrefixIndex, Tier, TierMatch

__all__ = [
    "TIERS",
    "AllBlocksCleared",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "CodecError",
    "DecodedBatch",
    "EventBatch",
    "EventIngest",
    "IndexStats",
    "IngestResult",
    "PrefixIndex",
    "RouterHash",
    "SeqStatus",
    "Tier",
    "TierMatch",
    "decode",
    "decode_json",
    "encode",
    "encode_json",
    "extra_key_bytes",
    "salt_extras",
    "tier_of_medium",
]
