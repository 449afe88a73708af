"""Old name of part of ``stack.py`` (the test stacks), for branches that import it."""

from stack import BS, MODEL, SYSTEM, MockStack, Replica, index_blocks, matches, prompt, send

__all__ = ["BS", "MODEL", "SYSTEM", "MockStack", "Replica", "index_blocks", "matches",
           "prompt", "send"]  # fmt: skip
