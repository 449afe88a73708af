"""Old name of part of ``stack.py`` (the test stacks), for branches that import it."""

from stack import ENGINE_SEED, EngineDouble, Served, until

__all__ = ["ENGINE_SEED", "EngineDouble", "Served", "until"]
