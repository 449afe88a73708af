"""KV-cache groups of hybrid models: where a prefix hit is reusable by every group.

A hybrid model keeps one KV-cache group per kind of layer, each caching its own blocks
(vLLM's hybrid allocator, ``BlockStored.group_idx`` with ``kv_cache_spec_kind``; SGLang's
full / SWA / Mamba components). A hit at depth ``d`` (the first ``d`` blocks reused) needs
every group to reuse it, each by its own rule, as vLLM's
``SingleTypeKVCacheManager.find_longest_cache_hit`` applies them:

- full attention: every block before ``d`` is held (the leading run);
- sliding window of ``w`` tokens: the last ``ceil((w - 1) / B)`` blocks before ``d`` are
  held (a hit that shallow from the start needs all of its blocks), since attention at
  ``d`` looks back only that far;
- Mamba / linear attention: the state after block ``d - 1`` is held, which exists only
  where the engine saved it.

A group whose blocks are ``k`` times the router's reuses whole blocks only, so ``d`` is
a multiple of ``k``. The request's reusable depth is the largest ``d`` every group
accepts (vLLM's ``HybridKVCacheCoordinator`` iterates the groups to that fixed point).

``reusable_depth`` is the router's form: it probes a ``held(group, block)`` predicate at
most once per block and group. ``reference_depth`` is the plain definition the property
tests hold it against (and the mock engine's truth).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

from index.prefix_index import TierMatch

GroupKind = Literal["full", "sliding_window", "mamba"]
GROUP_KINDS: tuple[GroupKind, ...] = ("full", "sliding_window", "mamba")

# vLLM's KVCacheSpecKind values (``kv_cache_spec_kind`` on BlockStored) by rule
_KIND_OF_SPEC: dict[str, GroupKind] = {
    "full_attention": "full",
    "mla_attention": "full",
    "sink_full_attention": "full",
    "full": "full",
    "sliding_window": "sliding_window",
    "sliding_window_mla": "sliding_window",
    "swa": "sliding_window",
    "mamba": "mamba",
    "linear_attention": "mamba",
}


def group_kind(spec_kind: str | None) -> GroupKind | None:
    """The match rule for an engine's cache-spec kind (None: unknown, so unusable)."""
    return None if spec_kind is None else _KIND_OF_SPEC.get(spec_kind.lower())


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV-cache group as the router matches it."""

    kind: GroupKind
    window: int = 0  # sliding window in tokens (kind "sliding_window")
    ratio: int = 1  # the group's block size over the router's

    def window_blocks(self, block_size: int) -> int:
        """Router blocks a hit needs before it: vLLM's ``cdiv(sliding_window - 1, B)``."""
        return max(1, -(-(self.window - 1) // block_size))

    def valid(self, d: int, held: Callable[[int], bool], block_size: int) -> bool:
        """The plain rule: may this group reuse the first ``d`` blocks?"""
        if d % self.ratio:
            return False
        if d == 0:
            return True
        if self.kind == "full":
            return all(held(i) for i in range(d))
        if self.kind == "mamba":
            return held(d - 1)
        w = self.window_blocks(block_size)
        return all(held(i) for i in range(max(0, d - w), d))


def group_key(worker_id: str, group: int) -> str:
    """The index key of a worker's KV-cache group kept apart from its own key (every group
    but a full-attention group 0, see ``key_of``). ``:`` is in no worker id, so no worker
    is named like a group."""
    return f"{worker_id}:g{group}"


def key_of(worker_id: str, group: int, groups: Sequence[GroupSpec]) -> str:
    """Where group ``group`` of a worker is indexed: the worker's own key for a
    full-attention group 0, else its group key."""
    return worker_id if group == 0 and groups[0].kind == "full" else group_key(worker_id, group)


def clip_matches(
    matches: Mapping[str, TierMatch],
    hashes: Sequence[int],
    groups: Sequence[GroupSpec],
    holds: Callable[[str, int], bool],
    block_size: int,
) -> dict[str, TierMatch]:
    """Each worker's match cut to the depth every group can reuse (``reusable_depth``),
    probing the groups' index keys with ``holds(key, block hash)``.

    The tiers come from the first full-attention group's match (its leading run, which
    also bounds the search); a model with no full-attention group is matched from 0."""
    full = next((g for g, spec in enumerate(groups) if spec.kind == "full"), None)
    workers = {key.split(":g", 1)[0] if ":g" in key else key for key in matches}
    out: dict[str, TierMatch] = {}
    for worker in workers:
        m = matches.get(key_of(worker, full, groups)) if full is not None else None
        if full is not None and (m is None or m.total == 0):
            continue  # nothing to clip: no hit in the full-attention group
        keys = [key_of(worker, g, groups) for g in range(len(groups))]

        def held(g: int, i: int, keys: list[str] = keys) -> bool:
            return holds(keys[g], hashes[i])

        depth = reusable_depth(
            groups,
            held,
            len(hashes),
            block_size,
            leading={full: m.total} if m is not None and full is not None else None,
        )
        if m is None:
            m = TierMatch(depth, depth, depth, depth)  # no full group: held in GPU, say
        elif depth < m.total:
            m = TierMatch(min(m.gpu, depth), min(m.cpu, depth), min(m.disk, depth), depth)
        if depth:
            out[worker] = m
    return out


def parse_groups(text: str) -> list[GroupSpec]:
    """``"full,sliding_window:4096,mamba"``: the groups in ``group_idx`` order (the
    ``kv_groups`` setting, for engines whose events do not describe their groups)."""
    out: list[GroupSpec] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, _, arg = part.partition(":")
        kind = group_kind(name)
        if kind is None:
            raise ValueError(f"kv group {part!r}: kind must be one of {', '.join(GROUP_KINDS)}")
        window = 0
        if kind == "sliding_window":
            if not arg.isdigit() or not 1 <= int(arg) <= 1 << 24:
                raise ValueError(f"kv group {part!r}: sliding_window:TOKENS, 1 to 2^24 tokens")
            window = int(arg)
        elif arg:
            raise ValueError(f"kv group {part!r}: only sliding_window takes an argument")
        out.append(GroupSpec(kind, window))
    return out


def reference_depth(
    groups: Sequence[GroupSpec],
    held: Callable[[int, int], bool],
    cap: int,
    block_size: int,
) -> int:
    """The largest ``d <= cap`` every group may reuse, by trying each ``d`` from the top."""
    for d in range(cap, 0, -1):
        if all(g.valid(d, partial(held, gi), block_size) for gi, g in enumerate(groups)):
            return d
    return 0


def reusable_depth(
    groups: Sequence[GroupSpec],
    held: Callable[[int, int], bool],
    cap: int,
    block_size: int,
    *,
    leading: dict[int, int] | None = None,
) -> int:
    """``reference_depth``, probing each (group, block) at most once.

    ``leading`` gives full groups' leading runs already known (group 0's from the index
    match), which bound the search before any probe. Each group in turn lowers ``d`` to
    the largest depth it accepts; the descent stops where all agree, and never passes
    a depth all accept, since each step lands on the largest one its group accepts.
    """
    d = cap
    known = leading or {}
    for gi, g in enumerate(groups):
        if g.kind == "full" and gi in known:
            d = min(d, known[gi])
    if d <= 0:
        return 0
    flags: list[list[bool] | None] = [None] * len(groups)

    def marks(gi: int) -> list[bool]:
        got = flags[gi]
        if got is None:
            got = flags[gi] = [held(gi, i) for i in range(d)]
        return got

    while True:
        start = d
        for gi, g in enumerate(groups):
            d = _largest(g, gi, d, marks, block_size, known)
            if d == 0:
                return 0
        if d == start:
            return d


def _largest(
    g: GroupSpec,
    gi: int,
    d: int,
    marks: Callable[[int], list[bool]],
    block_size: int,
    known: dict[int, int],
) -> int:
    """The largest depth ``<= d`` group ``g`` accepts."""
    if g.kind == "full":
        if gi in known:
            run = known[gi]
        else:
            held = marks(gi)
            run = next((i for i in range(d) if not held[i]), d)
        d = min(d, run)
        return d - d % g.ratio
    held = marks(gi)
    if g.kind == "mamba":
        for e in range(d - d % g.ratio, 0, -g.ratio):
            if held[e - 1]:
                return e
        return 0
    w = g.window_blocks(block_size)
    # run[e]: held blocks in a row ending at block e - 1
    run = 0
    runs = [0] * (d + 1)
    for i in range(d):
        run = run + 1 if held[i] else 0
        runs[i + 1] = run
    for e in range(d - d % g.ratio, 0, -g.ratio):
        if runs[e] >= min(w, e):
            return e
    return 0
