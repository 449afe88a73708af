"""Rolling block hashes: chaining, block boundaries, extra keys, bigram mode."""

from __future__ import annotations

from array import array

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from index import BlockHasher, extra_key_bytes, salt_extras

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=200)


def reference(token_ids: list[int], block_size: int, seed: int = 0) -> list[int]:
    """The definition from DESIGN.md, written the slow, obvious way."""
    out, h = [], seed
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        h = xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in block), h)
        out.append(h)
    return out


@given(tokens, st.integers(1, 17), st.integers(0, 2**64 - 1))
def test_matches_the_definition(token_ids: list[int], block_size: int, seed: int) -> None:
    assert BlockHasher(block_size, seed).hash_tokens(token_ids) == reference(
        token_ids, block_size, seed
    )


@given(tokens, st.integers(1, 9))
def test_input_forms_agree(token_ids: list[int], block_size: int) -> None:
    hasher = BlockHasher(block_size)
    packed = array("I", token_ids)
    assert hasher.hash_tokens(token_ids) == hasher.hash_tokens(packed)
    assert hasher.hash_tokens(token_ids) == hasher.hash_tokens(packed.tobytes())


@given(tokens, tokens, st.integers(1, 9))
def test_prefix_property_and_continuation(a: list[int], b: list[int], block_size: int) -> None:
    hasher = BlockHasher(block_size)
    whole = hasher.hash_tokens(a + b)
    head = hasher.hash_tokens(a)
    assert whole[: len(head)] == head
    cut = len(a) - len(a) % block_size
    tail = hasher.hash_tokens((a + b)[cut:], parent=head[-1] if head else None)
    assert head + tail == whole


def test_partial_block_is_not_hashed() -> None:
    hasher = BlockHasher(4)
    assert len(hasher.hash_tokens(range(11))) == 2
    assert hasher.hash_tokens(range(3)) == []


def test_block_depends_on_parent_not_only_tokens() -> None:
    hasher = BlockHasher(2)
    a = hasher.hash_tokens([1, 2, 5, 6])
    b = hasher.hash_tokens([3, 4, 5, 6])
    assert a[1] != b[1]  # same block tokens, different parents


def test_seed_and_lora_partition_the_cache() -> None:
    t = list(range(8))
    assert BlockHasher(4, seed=1).hash_tokens(t) != BlockHasher(4, seed=2).hash_tokens(t)
    h = BlockHasher(4)
    assert h.hash_tokens(t, lora_name="sql") != h.hash_tokens(t)
    assert h.hash_tokens(t, lora_name="sql") == h.hash_tokens(t, lora_name="sql")


def test_block_extras_touch_only_their_block_and_what_follows() -> None:
    h = BlockHasher(4)
    t = list(range(12))
    plain = h.hash_tokens(t)
    salted = h.hash_tokens(t, block_extras={1: extra_key_bytes(("img", 3))})
    assert salted[0] == plain[0]
    assert salted[1] != plain[1] and salted[2] != plain[2]
    s = h.hash_tokens(t, block_extras=salt_extras("tenant-a"))
    assert s[0] != plain[0]
    assert salt_extras(None) is None


def test_bigram_mode_windows() -> None:
    h = BlockHasher(4, bigram=True)
    t = list(range(13))
    out = h.hash_tokens(t)
    assert len(out) == 3  # windows [0:5], [4:9], [8:13]
    first = xxhash.xxh3_64_intdigest(array("I", t[0:5]).tobytes(), 0)
    assert out[0] == first
    assert h.hash_tokens(t[:12]) == out[:2]  # the third window needs token 12


def test_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError):
        BlockHasher(0)
