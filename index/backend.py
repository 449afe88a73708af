"""Which prefix index a pool gets: the native core when it is built, else the Python one;
and the event ingest that goes with an index (``make_ingest``).

``pip install -e .`` builds the native core (setup.py); a source checkout used without
building it (``python3 setup.py build_ext --inplace`` does it in place) still runs on
the Python index, which stays the reference the native one is tested against. Set
``CACHE_ROUTER_INDEX=python`` to force the Python index.
"""

from __future__ import annotations

import os

from index.hashing import BlockHasher
from index.ingest import EventIngest
from index.prefix_index import PrefixIndex

try:
    from index.native_index import NativePrefixIndex
    from index.native_ingest import NativeEventIngest
except ImportError:  # not built
    NativePrefixIndex = None  # type: ignore[assignment,misc]
    NativeEventIngest = None  # type: ignore[assignment,misc]

__all__ = ["IMPLEMENTATIONS", "NATIVE", "NativePrefixIndex", "make_ingest", "use_native"]

NATIVE: bool = NativePrefixIndex is not None
IMPLEMENTATIONS: tuple[type, ...] = (
    (PrefixIndex, NativePrefixIndex) if NativePrefixIndex is not None else (PrefixIndex,)
)


def use_native() -> bool:
    """Whether new pools get the native index."""
    return NATIVE and os.environ.get("CACHE_ROUTER_INDEX", "native") != "python"


def make_ingest(
    index: PrefixIndex | NativePrefixIndex,
    hasher: BlockHasher,
    *,
    max_seq_jump: int = 100_000,
    max_ranks: int = 64,
    max_worker_blocks: int | None = None,
    keep_names: bool = True,
) -> EventIngest:
    """The event ingest for ``index``: ``NativeEventIngest`` (the rules in the native core)
    on a ``NativePrefixIndex``, the reference ``EventIngest`` on a Python one. The bounds
    are ``EventIngest``'s."""
    bounds = {"max_seq_jump": max_seq_jump, "max_ranks": max_ranks}
    if NativeEventIngest is not None and isinstance(index, NativePrefixIndex):
        return NativeEventIngest(
            index, hasher, **bounds, max_worker_blocks=max_worker_blocks, keep_names=keep_names
        )
    return EventIngest(
        index, hasher, **bounds, max_worker_blocks=max_worker_blocks, keep_names=keep_names
    )
