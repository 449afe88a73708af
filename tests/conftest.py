"""Shared fixtures: a real nats-server per test module, on a free port, JetStream on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from router.natsd import EmbeddedNats


@pytest.fixture(scope="module")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url
