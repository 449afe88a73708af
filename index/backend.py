"""Which prefix index a pool gets: the native core when it is built, else the Python one.

``pip install -e .`` builds the native core (setup.py); a source checkout used without
building it (``python3 setup.py build_ext --inplace`` does it in place) still runs on
the Python index, which stays the reference the native one is tested against. Set
``CACHE_ROUTER_INDEX=python`` to force the Python index.
"""

from __future__ import annotations

import os

from index.prefix_index import PrefixIndex

try:
    from index.native_index import NativePrefixIndex
except ImportError:  # not built
    NativePrefixIndex = None  # type: ignore[assignment,misc]

__all__ = ["IMPLEMENTATIONS", "NATIVE", "NativePrefixIndex", "use_native"]

NATIVE: bool = NativePrefixIndex is not None
IMPLEMENTATIONS: tuple[type, ...] = (
    (PrefixIndex, NativePrefixIndex) if NativePrefixIndex is not None else (PrefixIndex,)
)


def use_native() -> bool:
    """Whether new pools get the native index."""
    return NATIVE and os.environ.get("CACHE_ROUTER_INDEX", "native") != "python"
