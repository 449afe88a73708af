"""Multimodal items' placeholder tokens, learnt from the engines' own KV events.

An engine replaces each media item of a prompt with a run of placeholder tokens (vLLM:
the model's image / audio pad token, as many as its processor makes of the item) and
names the item in the extra keys of every block the run touches, as ``(identifier,
item start - block start)``. A ``BlockStored`` whose blocks carry such a key shows the
run: it starts at that offset and is the pad token repeated. ``MediaRegistry`` keeps
identifier -> run, so a later request with the same item (same identifier) is hashed
through it (``router.tokens.media.expand``) instead of stopping there.

The router hashes per router block, keying each with the items it overlaps, offsets
from that block's start (vLLM's ``get_request_block_hasher`` does the same per hash
block); but a ``BlockStored`` whose block is k > 1 router blocks (an engine block size
k times the router's, or vLLM's coarser KV group) carries the keys ``cache_full_blocks``
computes per *event* block, offsets from the event block's start. ``router_block_keys``
renumbers them per router block as the request side (``router.tokens.media.block_keys``) keys
them, an item ending where its placeholder run ends (the run ``MediaRegistry`` learns),
so both sides key the same item alike.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

MAX_ITEMS = 65_536  # identifiers remembered per pool (LRU): bounds memory on any traffic
MAX_RUN = 1 << 16  # placeholder tokens one item may have (far past any real encoder)


class MediaRegistry:
    """identifier -> the item's placeholder tokens (pad token, count)."""

    def __init__(self, max_items: int = MAX_ITEMS) -> None:
        self.max_items = max_items
        self._runs: OrderedDict[str, tuple[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._runs)

    def placeholder(self, identifier: str) -> list[int] | None:
        """The item's placeholder tokens (None: never seen whole in an event)."""
        run = self._runs.get(identifier)
        if run is None:
            return None
        self._runs.move_to_end(identifier)
        return [run[0]] * run[1]

    def learn(self, token_ids: Sequence[int], block_size: int, extra_keys: Sequence[Any]) -> int:
        """Runs of the items this event's blocks name and show whole; how many were new.

        A run that reaches the event's last token may go on in the next event: it is
        learnt from an event that shows its end."""
        learnt = 0
        n = len(token_ids)
        starts = item_starts(extra_keys, block_size)
        for b, keys in enumerate(extra_keys):
            for ident, rel in media_keys(keys):
                start = b * block_size + rel
                if ident in self._runs or not 0 <= start < n:
                    continue
                end = run_end(token_ids, start, starts, min(n, start + MAX_RUN))
                if end >= n:
                    continue  # its end is in a later event
                self._runs[ident] = (token_ids[start], end - start)
                learnt += 1
                while len(self._runs) > self.max_items:
                    self._runs.popitem(last=False)
        return learnt


def media_keys(keys: object) -> list[tuple[str, int]]:
    """The multimodal keys ``(identifier, offset)`` among one block's extra keys."""
    if not isinstance(keys, list | tuple):
        return []
    return [(key[0], key[1]) for key in keys if _is_media(key)]


def _is_media(key: object) -> bool:
    return (
        isinstance(key, list | tuple)
        and len(key) == 2
        and isinstance(key[0], str)
        and isinstance(key[1], int)
        and not isinstance(key[1], bool)
    )


def item_starts(extra_keys: Sequence[Any], block_size: int) -> list[int]:
    """Where the items an event's blocks name start (token index in the event), sorted."""
    return sorted(
        {b * block_size + rel for b, keys in enumerate(extra_keys) for _, rel in media_keys(keys)}
    )


def run_end(token_ids: Sequence[int], first: int, starts: Sequence[int], limit: int) -> int:
    """Where the placeholder run through ``first`` (a token of it) ends: the token at
    ``first`` repeated, up to the next item's start (two items back to back may share a
    pad token) and ``limit`` at most."""
    following = bisect_right(starts, first)
    if following < len(starts):
        limit = min(limit, starts[following])
    pad = token_ids[first]
    end = first
    while end < limit and token_ids[end] == pad:
        end += 1
    return end


def router_block_keys(
    extra_keys: Sequence[Any], token_ids: Sequence[int], block_size: int, k: int
) -> list[list[Any] | None]:
    """An event's extra keys, given per event block of ``k`` router blocks, renumbered per
    router block of ``block_size`` tokens: each item in the router blocks its run
    overlaps, ``(identifier, item start - router block start)``; the other keys (a cache
    salt, prompt-embeds digests) in the event block's first router block."""
    if block_size <= 0 or k <= 0:
        raise ValueError(f"block_size and k must be positive, got {block_size}, {k}")
    span = block_size * k
    starts = item_starts(extra_keys, span)
    out: list[list[Any] | None] = []
    for i, keys in enumerate(extra_keys):
        base = i * span
        shown = min(len(token_ids), base + span)
        blocks: list[list[Any]] = [[] for _ in range(k)]
        others = []
        for key in keys if isinstance(keys, list | tuple) else ():
            first = max(base, base + key[1]) if _is_media(key) else shown
            if first >= shown:  # not an item's, or one this block does not show
                others.append(key)
                continue
            end = run_end(token_ids, first, starts, shown)
            for j in range((first - base) // block_size, (end - 1 - base) // block_size + 1):
                blocks[j].append((key[0], key[1] - j * block_size))
        blocks[0] += others
        out += [b or None for b in blocks]
    return out
