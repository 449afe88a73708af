"""Multimodal items' placeholder tokens, learnt from the engines' own KV events.

An engine replaces each media item of a prompt with a run of placeholder tokens (vLLM:
the model's image / audio pad token, as many as its processor makes of the item) and
names the item in the extra keys of every block the run touches, as ``(identifier,
item start - block start)``. A ``BlockStored`` whose blocks carry such a key shows the
run: it starts at that offset and is the pad token repeated. ``MediaRegistry`` keeps
identifier -> run, so a later request with the same item (same identifier) is hashed
through it (``router.media.expand``) instead of stopping there.
"""

from __future__ import annotations

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
        for b, keys in enumerate(extra_keys):
            if not isinstance(keys, list | tuple):
                continue
            for key in keys:
                if not (
                    isinstance(key, list | tuple)
                    and len(key) == 2
                    and isinstance(key[0], str)
                    and isinstance(key[1], int)
                    and not isinstance(key[1], bool)
                ):
                    continue
                ident, rel = key
                start = b * block_size + rel
                if ident in self._runs or not 0 <= start < n:
                    continue
                pad = token_ids[start]
                end = start
                while end < n and token_ids[end] == pad and end - start < MAX_RUN:
                    end += 1
                if end >= n:
                    continue  # its end is in a later event
                self._runs[ident] = (pad, end - start)
                learnt += 1
                while len(self._runs) > self.max_items:
                    self._runs.popitem(last=False)
        return learnt
