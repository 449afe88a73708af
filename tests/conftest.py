"""Shared fixtures: a real nats-server per test module (free port, JetStream on), engine
doubles behind a router (``make_stack``; the stacks themselves are in stack.py), and real
tokenizers with chat templates (``spm``, ``byte_bpe``, ``hf``: tokenizer_files.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import nats
import pytest
from stack import DoubleStack
from tokenizer_files import byte_bpe, hf, spm  # noqa: F401  (fixtures)

from sim.mock.natsd import EmbeddedNats


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


@pytest.fixture
async def make_stack() -> AsyncIterator[Callable[..., Awaitable[DoubleStack]]]:
    """``await make_stack(n, nats_url, engine_kw, **settings)``: a started ``DoubleStack``,
    stopped after the test."""
    stacks: list[DoubleStack] = []

    async def make(*args: Any, **kwargs: Any) -> DoubleStack:
        stack = await DoubleStack.start(*args, **kwargs)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        await stack.stop()


@pytest.fixture
async def closing() -> AsyncIterator[list[Any]]:
    """What a test appends is closed after it, last first: a picker (``stop``), an httpx
    client (``aclose``), anything else (``close``)."""
    held: list[Any] = []
    yield held
    for item in reversed(held):
        if hasattr(item, "stop"):
            await item.stop(0)
        elif hasattr(item, "aclose"):
            await item.aclose()
        else:
            await item.close()
