"""Log lines for repeated bad input, at most one per interval per kind of line.

A hostile or broken peer can send thousands of bad messages a second (20,000 bad
prefetch hints made 20,000 agent log lines); the first one is worth a line, the rest
a count: each line says how many like it were suppressed since the last one.
"""

from __future__ import annotations

import logging
import time
from typing import Any


class _Window:
    """Per key (a format string: a bounded set), when it last passed and what it cost."""

    __slots__ = ("_last", "_suppressed", "interval")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def admit(self, key: str) -> int | None:
        """None to drop this line; else how many like it were dropped before it."""
        now = time.monotonic()
        if now - self._last.get(key, -self.interval) < self.interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._suppressed.pop(key, 0)


class RateLimitedLog:
    """``warning`` at most once per ``interval`` seconds for each format string."""

    __slots__ = ("_window", "logger")

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self.logger = logger
        self._window = _Window(interval)

    def warning(self, msg: str, *args: Any) -> None:
        self.log(logging.WARNING, msg, *args)

    def log(self, level: int, msg: str, *args: Any) -> None:
        if not self.logger.isEnabledFor(level):
            return
        skipped = self._window.admit(msg)
        if skipped:
            self.logger.log(level, msg + " (%d more like it suppressed)", *args, skipped)
        elif skipped is not None:
            self.logger.log(level, msg, *args)


class RateLimitFilter(logging.Filter):
    """The same limit for a library's logger (uvicorn's "Invalid HTTP request received."
    is one warning per bad request a client cares to send)."""

    def __init__(self, interval: float = 10.0) -> None:
        super().__init__()
        self._window = _Window(interval)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        skipped = self._window.admit(str(record.msg))
        if skipped:
            record.msg = f"{record.msg} ({skipped} more like it suppressed)"
        return skipped is not None
