"""KV-cache group match rules (index/groups.py) against the plain definition."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.backend import IMPLEMENTATIONS, make_ingest
from index.groups import (
    GroupSpec,
    clip_matches,
    group_kind,
    parse_groups,
    reference_depth,
    reusable_depth,
)

BS = 4

specs = st.builds(
    GroupSpec,
    kind=st.sampled_from(["full", "sliding_window", "mamba"]),
    window=st.integers(1, 40),
    ratio=st.sampled_from([1, 1, 2, 3]),
)


@settings(max_examples=400, deadline=None)
@given(
    groups=st.lists(specs, min_size=1, max_size=4),
    n=st.integers(0, 30),
    data=st.data(),
)
def test_reusable_depth_is_the_reference(
    groups: list[GroupSpec], n: int, data: st.DataObject
) -> None:
    held_sets = [
        data.draw(st.sets(st.integers(0, max(0, n - 1)), max_size=n), label=f"held[{g}]")
        for g in range(len(groups))
    ]
    cap = data.draw(st.integers(0, n), label="cap")
    probes: list[tuple[int, int]] = []

    def held(g: int, i: int) -> bool:
        probes.append((g, i))
        return i in held_sets[g]

    want = reference_depth(groups, lambda g, i: i in held_sets[g], cap, BS)
    got = reusable_depth(groups, held, cap, BS)
    assert got == want
    assert len(probes) == len(set(probes))  # each (group, block) probed at most once
    # group 0's leading run handed in (as the index match gives it) changes nothing
    if groups[0].kind == "full":
        lead = next((i for i in range(n) if i not in held_sets[0]), n)
        assert reusable_depth(groups, held, cap, BS, leading={0: lead}) == want
    # and the answer obeys each rule
    for g, spec in enumerate(groups):
        assert spec.valid(got, lambda i, g=g: i in held_sets[g], BS)


def test_rules_by_hand() -> None:
    full, swa, mamba = GroupSpec("full"), GroupSpec("sliding_window", window=9), GroupSpec("mamba")
    assert swa.window_blocks(BS) == 2  # ceil((9 - 1) / 4): the blocks a hit looks back on
    everything = set(range(10))
    # the sliding-window group dropped blocks 0..5 (out of the window of a long prompt)
    tail = set(range(6, 10))

    def depth(*held: set[int], groups: list[GroupSpec], cap: int = 10) -> int:
        return reusable_depth(groups, lambda g, i: i in held[g], cap, BS)

    assert depth(everything, tail, groups=[full, swa]) == 10
    assert depth(everything, tail, groups=[full, swa], cap=7) == 0  # block 5 is gone: no hit at 7
    assert depth(everything, tail, groups=[full, swa], cap=8) == 8
    # Mamba state saved only after block 3 and block 7: a hit lands on those
    assert depth(everything, {3, 7}, groups=[full, mamba]) == 8
    assert depth(everything, {3, 7}, groups=[full, mamba], cap=6) == 4
    assert depth(set(range(5)), {3, 7}, groups=[full, mamba]) == 4  # full attention stops at 5
    # a coarse group (2 router blocks per block) reuses whole blocks only
    assert depth(everything, everything, groups=[full, GroupSpec("full", ratio=2)], cap=7) == 6


def test_parse_groups_and_kinds() -> None:
    assert parse_groups("full, sliding_window:4096,mamba") == [
        GroupSpec("full"),
        GroupSpec("sliding_window", 4096),
        GroupSpec("mamba"),
    ]
    assert parse_groups("") == []
    for bad in ("dense", "sliding_window", "sliding_window:0", "mamba:3", "full:x"):
        with pytest.raises(ValueError):
            parse_groups(bad)
    assert group_kind("full_attention") == "full"
    assert group_kind("sliding_window_mla") == "sliding_window"
    assert group_kind("mamba") == "mamba"
    assert group_kind("cross_attention") is None and group_kind(None) is None


# -- ingest: each group under its own index key ---------------------------------------

B = 4
SWA = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 5}


def _stored(hashes: list[int], parent: int | None, first: int, group: int, **kw: object):
    from index import BlockStored

    tokens = list(range(first * B, (first + len(hashes)) * B))
    return BlockStored(hashes, parent, tokens, B, medium="GPU", group_idx=group, **kw)


@pytest.mark.parametrize("Index", IMPLEMENTATIONS)
@pytest.mark.parametrize("as_map", [False, True])
def test_group_events_land_under_their_own_keys(Index, as_map: bool) -> None:
    from index import AllBlocksCleared, BlockHasher, BlockRemoved, EventBatch, encode

    hasher = BlockHasher(B)
    index = Index()
    ingest = make_ingest(index, hasher)
    full = {"kv_cache_spec_kind": "full_attention"}
    mamba = {"kv_cache_spec_kind": "mamba"}
    # the engine names blocks alike in every group (same block size): 101.. for blocks 0..
    batch0 = [
        _stored([101, 102, 103, 104], None, 0, 0, **full),
        _stored([101, 102, 103, 104], None, 0, 1, **SWA),
        _stored([104], 103, 3, 2, **mamba),  # a Mamba state after block 3 only
    ]
    result = ingest.apply("w", 0, encode(EventBatch(0.0, batch0, 0), events_as_map=as_map))
    assert result.applied == 3 and not result.errors
    router = hasher.hash_tokens(list(range(4 * B)))
    assert [index.holds("w", h) for h in router] == [True] * 4
    assert [index.holds("w:g1", h) for h in router] == [True] * 4
    assert [index.holds("w:g2", h) for h in router] == [False, False, False, True]
    assert ingest.group_specs() == [
        GroupSpec("full"),
        GroupSpec("sliding_window", 5),
        GroupSpec("mamba"),
    ]
    # the window group drops blocks 0-1 (engine hash 101 also names group 0's block 0,
    # which stays); then a chunk continues both groups, its parent known to group 0
    batch1 = [
        BlockRemoved([101, 102], medium="GPU", group_idx=1),
        _stored([105], 104, 4, 0, **full),
        _stored([105], 104, 4, 1, **SWA),
        _stored([105], 104, 4, 2, **mamba),
    ]
    result = ingest.apply("w", 1, encode(EventBatch(0.0, batch1, 0), events_as_map=as_map))
    assert result.applied == 4 and not result.errors, result
    router = hasher.hash_tokens(list(range(5 * B)))
    assert [index.holds("w", h) for h in router] == [True] * 5
    assert [index.holds("w:g1", h) for h in router] == [False, False, True, True, True]
    assert [index.holds("w:g2", h) for h in router] == [False, False, False, True, True]
    # a clear empties every group
    ingest.apply("w", 2, encode(EventBatch(0.0, [AllBlocksCleared()], 0), events_as_map=as_map))
    for key in ("w", "w:g1", "w:g2"):
        assert not any(index.holds(key, h) for h in router)
    ingest.remove_worker("w")
    assert not [k for k in index.workers if k.startswith("w")]


@pytest.mark.parametrize("Index", IMPLEMENTATIONS)
def test_groups_of_no_known_kind_are_still_dropped(Index) -> None:
    from index import BlockHasher, EventBatch, encode

    ingest = make_ingest(Index(), BlockHasher(B))
    events = [_stored([1], None, 0, 0), _stored([1], None, 0, 1)]  # no kinds named
    result = ingest.apply("w", 0, encode(EventBatch(0.0, events, 0)))
    assert result.applied == 1 and result.errors == {"other_kv_group": 1}
    assert ingest.group_specs() is None
    # declared groups (the kv_groups setting) give the same events their rule
    declared = make_ingest(Index(), BlockHasher(B))
    declared.declare_groups(parse_groups("full,sliding_window:5"))
    result = declared.apply("w", 0, encode(EventBatch(0.0, events, 0)))
    assert result.applied == 2 and not result.errors
    assert declared.group_specs() == [GroupSpec("full"), GroupSpec("sliding_window", 5)]


def _ingests() -> list[tuple[str, object]]:
    from index import EventIngest

    out: list[tuple[str, object]] = [
        (f"EventIngest/{i.__name__}", (EventIngest, i)) for i in IMPLEMENTATIONS
    ]
    try:
        from index.native_index import NativePrefixIndex
        from index.native_ingest import NativeEventIngest
    except ImportError:
        return out
    return [*out, ("NativeEventIngest", (NativeEventIngest, NativePrefixIndex))]


@pytest.mark.parametrize("kind", [k for k, _ in _ingests()])
def test_vllm_hybrid_llama_group0_sliding_window_sparse(kind: str) -> None:
    """What vLLM 0.32 sends for a 2-layer Llama with layer 0 sliding (window 64) and layer
    1 full, block 32, one 371-token prompt (/work/notes/vllm_facts.md): group 0 is the
    sliding-window group, and its store names only the last 2 of the 11 blocks its tokens
    cover. The router predicts the 352 tokens vLLM then reports cached."""
    from index import BlockHasher, EventBatch, encode
    from index.codec import BlockStored

    Ingest, Index = dict(_ingests())[kind]  # type: ignore[misc]
    bs = 32
    hasher, index = BlockHasher(bs), Index()
    ingest = Ingest(index, hasher)
    tokens = list(range(1, 372))
    full = [5000 + i for i in range(11)]
    swa = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 64}
    events = [
        BlockStored(full[9:], None, tokens[:352], bs, medium="GPU", extra_keys=[None, None],
                    group_idx=0, **swa),  # type: ignore[arg-type]
        BlockStored(full, None, tokens[:352], bs, medium="GPU", extra_keys=[None] * 11,
                    group_idx=1, kv_cache_spec_kind="full_attention"),
    ]  # fmt: skip
    for seq in range(2):  # the first natively parsed, then once the groups are known
        result = ingest.apply("w", seq, encode(EventBatch(0.0, events, 0), events_as_map=True))
        assert result.applied == 2 and not result.errors, result
    assert ingest.group_specs() == [GroupSpec("sliding_window", 64), GroupSpec("full")]
    hashes = hasher.hash_tokens(tokens)[: (371 - 1) // bs]
    assert [index.holds("w:g0", h) for h in hashes] == [False] * 9 + [True, True]
    assert all(index.holds("w:g1", h) for h in hashes)
    assert not any(index.holds("w", h) for h in hashes)  # the worker's own key stays empty
    matches = clip_matches(index.match_tiers(hashes), hashes, ingest.group_specs(), index.holds, bs)
    assert matches["w"].total * bs == 352
    # a prompt diverging in block 5: full attention reaches 5 blocks, the window group
    # holds neither block 3 nor 4, so no hit at all
    other = hasher.hash_tokens(tokens[:160] + [9] * 200)[:11]
    cut = clip_matches(index.match_tiers(other), other, ingest.group_specs(), index.holds, bs)
    assert "w" not in cut
