"""The engine's ZMQ wire as vLLM and SGLang define it (see /tmp/research/wire.md §2-3).

Live: a PUB socket sends ``[topic, seq (u64 big-endian), msgpack EventBatch]``.
Replay: a ROUTER socket takes ``[b"", start_seq (8 bytes BE)]`` from a DEALER and answers
one message per buffered batch from that seq, then an end marker with seq -1. Older
engines answer ``[b"", seq, payload]``, vLLM after PR #45177 ``[b"", topic, seq, payload]``;
both are accepted.
"""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def parse_live(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one live PUB message, or None if it is not one."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big"), frames[2]


def parse_replay(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replay reply; seq -1 is the end marker; None if malformed."""
    body = frames[1:] if frames and frames[0] == b"" else frames
    if len(body) == 3:  # the topic frame added by vLLM PR #45177
        body = body[1:]
    if len(body) != 2 or len(body[0]) != 8:
        return None
    return int.from_bytes(body[0], "big", signed=True), body[1]


async def fetch_replay(
    ctx: zmq.asyncio.Context, endpoint: str, from_seq: int, *, idle_timeout: float = 1.0
) -> tuple[list[tuple[int, bytes]], bool]:
    """Every batch the engine still buffers from ``from_seq`` on, in seq order, and
    whether the end marker came.

    Stops at the end marker, or after ``idle_timeout`` seconds without a message (engine
    down, or no replay socket there): what arrived until then is returned.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out: list[tuple[int, bytes]] = []
    complete = False
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", from_seq.to_bytes(8, "big")])
        while True:
            if not await sock.poll(int(idle_timeout * 1000)):
                log.warning("replay from %s timed out after %d batches", endpoint, len(out))
                break
            parsed = parse_replay(await sock.recv_multipart())
            if parsed is None:
                log.warning("malformed replay reply from %s", endpoint)
                continue
            seq, payload = parsed
            if seq < 0:
                complete = True
                break
            out.append((seq, payload))
    finally:
        sock.close()
    out.sort(key=lambda item: item[0])
    return out, complete
