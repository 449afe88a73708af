"""KV-event codec: every wire variant seen in the wild, round trips, and bad input."""

from __future__ import annotations

import contextlib

import msgpack
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from index import codec
from index.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CodecError,
    EventBatch,
    decode,
    decode_json,
    encode,
    encode_json,
)

U64 = 2**64


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# -- fixtures shaped like each engine's msgspec structs (built by hand, not by our encoder)


def test_vllm_v09_two_element_batch_without_medium() -> None:
    payload = pack([1.5, [["BlockStored", [1, 2], None, list(range(32)), 16, None]]])
    batch = decode(payload)
    assert batch.dp_rank is None and batch.ts == 1.5
    (ev,) = batch.events
    assert ev == BlockStored([1, 2], None, list(range(32)), 16, None, None)


def test_vllm_array_events_with_medium_lora_name_and_dp_rank() -> None:
    h = 2**64 - 5  # vLLM's low 64 bits of sha256 are often above 2**63
    payload = pack(
        [
            1.0,
            [
                ["BlockStored", [h], 7, list(range(16)), 16, 3, "GPU", "sql-lora"],
                ["BlockRemoved", [h], "CPU"],
                ["AllBlocksCleared"],
            ],
            2,
        ]
    )
    batch = decode(payload)
    assert batch.dp_rank == 2
    stored, removed, cleared = batch.events
    assert stored.block_hashes == [h] and stored.parent_block_hash == 7
    assert stored.lora_id == 3 and stored.medium == "GPU" and stored.lora_name == "sql-lora"
    assert removed == BlockRemoved([h], "CPU")
    assert cleared == AllBlocksCleared()


def test_vllm_newest_map_events_with_extra_keys_and_unknown_fields() -> None:
    payload = pack(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\x01" * 32],
                    "parent_block_hash": None,
                    "token_ids": list(range(16)),
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [["salt"]],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                    "some_future_field": {"x": 1},
                },
                {"type": "BlockRemoved", "block_hashes": [5], "medium": None},
                {"type": "SomethingNew", "x": 1},
            ],
            0,
        ]
    )
    batch = decode(payload)
    stored, removed = batch.events
    assert stored.block_hashes == [b"\x01" * 32]  # opaque: kept as the bytes they are
    assert stored.extra_keys == [["salt"]] and stored.group_idx == 0
    assert removed.medium is None
    assert batch.errors == {"unknown_event": 1}


def test_sglang_map_events_signed_hashes_cache_salt_and_bigram_pairs() -> None:
    payload = pack(
        [
            2.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [-3],
                    "parent_block_hash": -9,
                    "token_ids": [[1, 2], [2, 3], [3, 4], [4, 5]],
                    "block_size": 4,
                    "lora_id": None,
                    "medium": "CPU_PINNED",
                    "cache_salt": "tenant",
                    "session_id": "s1",
                }
            ],
            None,  # attn_dp_rank is always written, nil when unset
        ]
    )
    (ev,) = decode(payload).events
    assert ev.block_hashes == [U64 - 3] and ev.parent_block_hash == U64 - 9
    assert ev.token_ids == [1, 2, 3, 4, 5]
    assert ev.cache_salt == "tenant" and ev.medium == "CPU_PINNED"


def test_map_batch_envelope() -> None:
    payload = pack({"ts": 3, "events": [["AllBlocksCleared"]], "attn_dp_rank": 1})
    batch = decode(payload)
    assert batch.dp_rank == 1 and batch.events == [AllBlocksCleared()]


# -- round trips -----------------------------------------------------------------

hashes = st.lists(st.integers(0, U64 - 1), min_size=1, max_size=4)
opt_str = st.none() | st.sampled_from(["GPU", "CPU", "DISK"])
stored = st.builds(
    lambda hs, parent, bs, lora, medium, name: BlockStored(
        hs, parent, list(range(len(hs) * bs)), bs, lora, medium, name
    ),
    hashes,
    st.none() | st.integers(0, U64 - 1),
    st.integers(1, 8),
    st.none() | st.integers(0, 5),
    opt_str,
    st.none() | st.text(max_size=5),
)
removed = st.builds(BlockRemoved, hashes, opt_str)
events = st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=6)
batches = st.builds(
    EventBatch, st.floats(0, 1e10, allow_nan=False), events, st.none() | st.integers(0, 7)
)


@given(batches, st.booleans(), st.booleans())
def test_msgpack_round_trip_every_layout(batch: EventBatch, ev_map: bool, b_map: bool) -> None:
    out = decode(encode(batch, events_as_map=ev_map, batch_as_map=b_map))
    assert (out.ts, out.events, out.dp_rank) == (batch.ts, batch.events, batch.dp_rank)
    assert not out.errors


@given(batches)
def test_json_round_trip(batch: EventBatch) -> None:
    out = decode_json(encode_json(batch))
    assert (out.events, out.dp_rank) == (batch.events, batch.dp_rank)


@given(batches)
def test_signed_hashes_decode_to_the_same_unsigned_values(batch: EventBatch) -> None:
    def signed(h: int) -> int:
        return h - U64 if h >= 2**63 else h

    obj = codec.batch_to_obj(batch)
    for ev in obj[1]:
        if ev[0] in ("BlockStored", "BlockRemoved"):
            ev[1] = [signed(h) for h in ev[1]]
    assert decode(pack(obj)).events == batch.events


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", b"garbage!", pack(42), pack({"ts": 1}), pack([1.0, 5]), pack(["x", []])],
)
def test_unreadable_envelope_raises_codec_error(payload: bytes) -> None:
    with pytest.raises(CodecError):
        decode(payload)


def test_truncated_batch_raises_codec_error() -> None:
    payload = encode(EventBatch(1.0, [BlockRemoved([1, 2, 3])], 0))
    with pytest.raises(CodecError):
        decode(payload[:-2])


def test_bad_events_are_counted_and_skipped_not_fatal() -> None:
    good = ["BlockRemoved", [1], "GPU"]
    payload = pack(
        [
            1.0,
            [
                ["BlockStored", "notalist", None, [1], 1],
                ["BlockStored", [1], None, [1], 0],  # block_size 0
                ["BlockRemoved", [True]],
                [7, 8],
                "string",
                good,
            ],
            0,
        ]
    )
    batch = decode(payload)
    assert batch.events == [BlockRemoved([1], "GPU")]
    assert batch.errors == {"bad_event": 5}


@given(st.binary(max_size=64))
def test_random_bytes_never_raise_anything_but_codec_error(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        decode(data)


def test_json_rejects_non_json() -> None:
    with pytest.raises(CodecError):
        decode_json(b"{nope")
    assert orjson.loads(encode_json(EventBatch(1.0, [], 0)))["events"] == []


# -- bytes hashes (vLLM's default sha256) -----------------------------------------

sha = st.binary(min_size=32, max_size=32) | st.binary(min_size=1, max_size=8)


@given(st.lists(sha, min_size=1, max_size=4), st.none() | sha, st.booleans())
def test_bytes_hashes_stay_the_same_bytes_through_every_encoding(
    hs: list[bytes], parent: bytes | None, ev_map: bool
) -> None:
    """Lossless: leading zero bytes too; msgpack and JSON give back what came in."""
    batch = EventBatch(
        1.0,
        [BlockStored(hs, parent, list(range(4 * len(hs))), 4), BlockRemoved(hs[:1], "GPU")],
    )
    for out in (decode(encode(batch, events_as_map=ev_map)), decode_json(encode_json(batch))):
        assert out.events == batch.events
        assert all(isinstance(h, bytes) for e in out.events for h in e.block_hashes)


def test_norm_hash_forms() -> None:
    zeros = b"\x00" * 31 + b"\x07"
    assert codec.norm_hash(zeros) == zeros and codec.norm_hash(bytearray(zeros)) == zeros
    assert codec.norm_hash(-1) == U64 - 1 and codec.norm_hash(5) == 5
    assert codec.hash_from_json(codec.hash_to_json(zeros)) == zeros
    assert codec.hash_to_json(7) == 7 and codec.hash_from_json("ff") == b"\xff"
    for bad in (True, 1.5, U64, -(2**63) - 1, None):
        with pytest.raises((TypeError, ValueError)):
            codec.norm_hash(bad)
    with pytest.raises(ValueError):
        codec.hash_from_json("not hex")
