"""Old path of ``index.gapfill`` (the gap-fill protocol), kept for code that imports it."""

from index.gapfill import GapFillMessage as ReplayMessage
from index.gapfill import GapFillRequest as ReplayRequest
from index.gapfill import Kind

__all__ = ["Kind", "ReplayMessage", "ReplayRequest"]
