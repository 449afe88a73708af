"""KV-event publishing exactly as vLLM's ``ZmqEventPublisher`` (wire.md §2), or SGLang's.

- PUB socket: one multipart message per batch, ``[topic, seq (u64 BE), msgpack batch]``,
  seq counting from 0 for each publisher (each engine process).
- ROUTER replay socket: keeps the last ``buffer_steps`` batches; a request
  ``[identity, b"", start_seq (8 bytes BE)]`` is answered with ``[identity, b"", seq,
  payload]`` for each buffered batch from ``start_seq`` on, then ``[identity, b"",
  -1 (8 bytes, signed), b""]``. Other requests are logged and ignored, as vLLM does.

Unlike vLLM, which binds only endpoints with ``*`` and connects otherwise, the mock
always binds: it is the stable end (agents connect to it).

Encodings: vLLM <= 0.23 (tagged-array events, the default), vLLM after PR #42892
(``events_as_map``: map events with ``"type"``), the same with vLLM's default sha256
block hashes (32 bytes each, ``vllm-sha256``), or SGLang's (map events without the
vLLM-only fields, ``medium`` left out when unset, host tier named ``CPU_PINNED`` and
block hashes as signed 64-bit ints).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import deque
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio

from index.codec import EngineHash, Event, EventBatch, batch_to_obj, encode

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
Encoding = Literal["vllm", "vllm-map", "vllm-sha256", "sglang"]

_SGLANG_DROP = ("lora_name", "extra_keys", "group_idx")
_SGLANG_MEDIUM = {"CPU": "CPU_PINNED"}


def _signed64(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def _sglang_event(obj: dict[str, Any]) -> dict[str, Any]:
    for key in _SGLANG_DROP:
        obj.pop(key, None)
    if obj.get("medium") is None:
        obj.pop("medium", None)
    else:
        obj["medium"] = _SGLANG_MEDIUM.get(obj["medium"], obj["medium"])
    if "block_hashes" in obj:
        obj["block_hashes"] = [_signed64(h) for h in obj["block_hashes"]]
    if obj.get("parent_block_hash") is not None:
        obj["parent_block_hash"] = _signed64(obj["parent_block_hash"])
    return obj


def wire_hash(h: int, encoding: Encoding) -> EngineHash:
    """The engine's block hash ``h`` as ``encoding`` puts it on the wire (normalized)."""
    if encoding == "vllm-sha256":
        return hashlib.sha256(h.to_bytes(8, "big")).digest()
    return h


def _sha256_event(obj: dict[str, Any]) -> dict[str, Any]:
    if "block_hashes" in obj:
        obj["block_hashes"] = [wire_hash(h, "vllm-sha256") for h in obj["block_hashes"]]
    if obj.get("parent_block_hash") is not None:
        obj["parent_block_hash"] = wire_hash(obj["parent_block_hash"], "vllm-sha256")
    return obj


def encode_batch(batch: EventBatch, encoding: Encoding) -> bytes:
    """The msgpack payload of one batch in the chosen engine's layout."""
    if encoding == "vllm":
        return encode(batch)
    if encoding == "vllm-map":
        return encode(batch, events_as_map=True)
    if encoding == "vllm-sha256":
        obj = batch_to_obj(batch, events_as_map=True)
        obj[1] = [_sha256_event(e) for e in obj[1]]
        return bytes(msgpack.packb(obj, use_bin_type=True))
    obj = batch_to_obj(batch, events_as_map=True)
    obj[1] = [_sglang_event(e) for e in obj[1]]
    return bytes(msgpack.packb(obj, use_bin_type=True))


class KvEventPublisher:
    """Publishes event batches and serves replays; ``start`` binds, ``close`` unbinds."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        encoding: Encoding = "vllm",
        dp_rank: int = 0,
    ) -> None:
        self.topic = topic.encode()
        self.encoding = encoding
        self.dp_rank = dp_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = None
        self._router: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._router is not None:
            self._task = asyncio.create_task(self._serve_replay(), name="kv-replay")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._ctx.destroy(linger=0)

    def publish(self, events: list[Event], ts: float | None = None) -> int:
        """Send one batch; returns its seq. PUB never blocks: past the HWM it drops."""
        batch = EventBatch(time.time() if ts is None else ts, events, self.dp_rank)
        payload = encode_batch(batch, self.encoding)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        return seq

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("invalid replay request: %d frames", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self._router.send_multipart(
                        [client, b"", seq.to_bytes(8, "big"), payload]
                    )
            await self._router.send_multipart([client, b"", END_SEQ, b""])
