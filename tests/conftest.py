"""Shared fixtures: a real nats-server per test module, on a free port, JetStream on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import nats
import pytest

from router.natsd import EmbeddedNats


@pytest.fixture(scope="module")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    """The server's url, with no JetStream stream left by an earlier test: routers read
    the event stream from its start, so one test's events would reach the next's index."""
    asyncio.run(_delete_streams(nats_server.url))
    return nats_server.url


async def _delete_streams(url: str) -> None:
    nc = await nats.connect(url)
    try:
        jsm = nc.jsm()
        for info in await jsm.streams_info():
            await jsm.delete_stream(info.config.name)
    finally:
        await nc.close()
