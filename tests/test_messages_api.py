"""Anthropic's Messages API (``/v1/messages``) through the router: routed cache-aware on
``system`` + ``messages`` rendered like chat, streamed or not, the engine's events and
usage passed through. The engines are mock vLLMs behind agents on a real nats-server."""

from __future__ import annotations

import httpx
import orjson
import pytest
from stack import MODEL, MockStack, Replica, until

SYSTEM = [{"type": "text", "text": "You answer as the router's test assistant, briefly. " * 6}]


@pytest.fixture
async def stack(nats_url):
    s = await MockStack(nats_url).start(3)
    try:
        yield s
    finally:
        await s.stop()


def events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], orjson.loads(lines["data"])))
    return out


async def test_messages_streamed_or_not_and_routed_on_their_prefix(stack):
    replica = await Replica(stack.router_config("r0")).start()
    try:
        async with httpx.AsyncClient(base_url=replica.url, timeout=10) as http:
            turn = [{"role": "user", "content": [{"type": "text", "text": "shared start " * 25}]}]
            body = {"model": MODEL, "system": SYSTEM, "messages": turn, "max_tokens": 6}
            r = await http.post("/v1/messages", json=body)
            assert r.status_code == 200, r.text
            msg = r.json()
            assert msg["type"] == "message" and msg["content"][0]["type"] == "text"
            assert msg["usage"]["input_tokens"] > 0
            home = r.headers["x-cache-router-worker"]
            await until(lambda: stack.synced(replica), what="the router applied the events")
            for _ in range(3):
                r = await http.post("/v1/messages", json={**body, "stream": True})
                assert r.status_code == 200 and r.headers["x-cache-router-worker"] == home
                kinds = events(r.text)
                names = [k for k, _ in kinds]
                assert names[0] == "message_start" and names[-1] == "message_stop"
                assert "content_block_delta" in names
                delta = next(d for k, d in kinds if k == "message_delta")
                assert delta["usage"]["cache_read_input_tokens"] > 0  # the prefix was there
            r = await http.post("/v1/messages", json={"model": MODEL, "messages": [],
                                                      "max_tokens": 1})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    finally:
        await replica.stop()
