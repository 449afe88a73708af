"""Prefix index: tokenizer-side block hashes, the bigram-keyed index, KV-event ingest."""

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
from index.hashing import BlockHasher, extra_key_bytes, salt_extras
from index.ingest import EventIngest, IngestResult, SeqStatus, tier_of_medium
from index.prefix_index import TIERS, IndexStats, PrefixIndex, TierMatch

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
    "SeqStatus",
    "TierMatch",
    "decode",
    "decode_json",
    "encode",
    "encode_json",
    "extra_key_bytes",
    "salt_extras",
    "tier_of_medium",
]
