"""Repeated bad input is logged once per interval with a count, never a line per message."""

from __future__ import annotations

import logging
import time

import pytest

from agent.prefetch import PrefetchForwarder
from router.observe.ratelog import RateLimitedLog, RateLimitFilter


def test_a_flood_of_the_same_line_is_one_line_and_then_a_count(caplog) -> None:
    logger = logging.getLogger("test.ratelog")
    limited = RateLimitedLog(logger, interval=0.2)
    with caplog.at_level(logging.WARNING, logger="test.ratelog"):
        for i in range(5000):
            limited.warning("bad message %d", i)
        limited.warning("another kind of line")
        time.sleep(0.25)
        limited.warning("bad message %d", 5000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "bad message 0",
        "another kind of line",
        "bad message 5000 (4999 more like it suppressed)",
    ]


def test_the_filter_limits_a_library_logger(caplog) -> None:
    logger = logging.getLogger("test.ratelog.lib")
    flt = RateLimitFilter(interval=60)
    logger.addFilter(flt)
    try:
        with caplog.at_level(logging.INFO, logger="test.ratelog.lib"):
            for _ in range(1000):
                logger.warning("Invalid HTTP request received.")
                logger.info("info lines pass")
    finally:
        logger.removeFilter(flt)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert sum(r.getMessage() == "info lines pass" for r in caplog.records) == 1000


@pytest.mark.parametrize("payload", [b"not json", b"[1]", b'{"block_hashes": ["x"]}'])
def test_the_agent_logs_bad_prefetch_hints_once(caplog, payload: bytes) -> None:
    """20,000 bad hints made 20,000 agent log lines."""
    forwarder = PrefetchForwarder("http://127.0.0.1:9/prefetch")
    with caplog.at_level(logging.WARNING, logger="agent.prefetch"):
        for _ in range(20_000):
            forwarder.submit(payload)
    assert forwarder.counters["malformed"] == 20_000
    assert len(caplog.records) <= 1  # one per 10 s (none if an earlier case just logged)
