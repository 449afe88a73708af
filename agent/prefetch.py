"""Hands prefetch hints from NATS to the engine without blocking the NATS reader.

Hints queue up (bounded) and one task POSTs them to the mock engine's ``/prefetch`` or a
real engine's hook, with the blocks' ``token_ids`` added when the source's agent can
name them (an engine can only materialise blocks whose tokens it knows). A hint that is
malformed, finds the queue full or cannot be delivered is counted and logged, never
dropped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

import httpx
import orjson

from index.codec import hash_from_json
from router.observe.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
bad_input = RateLimitedLog(log)  # hints come from NATS: one line per 10 s, with a count

# Fills in a hint's ``token_ids`` (the blocks' tokens) when it can; see agent.node.
Resolver = Callable[[dict[str, object]], Awaitable[bool]]


def check_hint(data: bytes) -> dict[str, object]:
    """The hint as a JSON object; ValueError when it is not a usable prefetch hint."""
    try:
        hint = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"prefetch hint is not JSON: {exc}") from exc
    if not isinstance(hint, dict):
        raise ValueError("prefetch hint is not a JSON object")
    hashes = hint.get("block_hashes")
    if not isinstance(hashes, list):
        raise ValueError("prefetch hint needs block_hashes: a list of ints or hex strings")
    try:
        for h in hashes:
            hash_from_json(h)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"prefetch hint needs block_hashes: a list of ints or hex strings ({exc})"
        ) from exc
    return hint


class PrefetchForwarder:
    def __init__(
        self,
        url: str | None,
        *,
        resolve: Resolver | None = None,
        queue_size: int = 1024,
        timeout: float = 5.0,
    ) -> None:
        self.url = url
        self.resolve = resolve
        self.timeout = timeout
        self.counters: Counter[str] = Counter()
        self._queue: asyncio.Queue[dict[str, object]] = asyncio.Queue(queue_size)
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        if self.url is not None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
            self._task = asyncio.create_task(self._run(), name="prefetch-forwarder")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            await self._client.aclose()
        pending = self._queue.qsize()
        if pending:
            self.counters["undelivered"] += pending
            log.warning("%d prefetch hints undelivered at shutdown", pending)

    def submit(self, data: bytes) -> None:
        """Queue one hint as it came off NATS."""
        self.counters["received"] += 1
        try:
            hint = check_hint(data)
        except ValueError as exc:
            self.counters["malformed"] += 1
            bad_input.warning("dropping prefetch hint: %s", exc)
            return
        if self.url is None:
            self.counters["undelivered"] += 1
            bad_input.warning(
                "no engine prefetch endpoint configured: hint %s dropped", hint.get("request_id")
            )
            return
        try:
            self._queue.put_nowait(hint)
        except asyncio.QueueFull:
            self.counters["undelivered"] += 1
            bad_input.warning("prefetch queue full: hint %s dropped", hint.get("request_id"))

    async def _run(self) -> None:
        assert self._client is not None and self.url is not None
        while True:
            hint = await self._queue.get()
            if "token_ids" not in hint and self.resolve is not None:
                try:
                    resolved = await self.resolve(hint)
                except Exception as exc:  # a peer that is down or answers garbage
                    resolved = False
                    bad_input.warning(
                        "prefetch hint %s: tokens not resolved: %s", hint.get("request_id"), exc
                    )
                self.counters["resolved" if resolved else "unresolved"] += 1
            try:
                resp = await self._client.post(self.url, json=hint)
                ok = resp.status_code < 300
                reason = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                ok, reason = False, f"{type(exc).__name__}: {exc}"
            if ok:
                self.counters["delivered"] += 1
            else:
                self.counters["undelivered"] += 1
                bad_input.warning(
                    "prefetch hint %s not delivered: %s", hint.get("request_id"), reason
                )
