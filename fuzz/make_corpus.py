"""Seed corpora for the fuzz targets (fuzz/run.sh), generated, never committed.

``events``: KV-event batches in the shapes engines publish, made with the project's own
encoder (index/codec.py, which the mock engines publish with): vLLM <= 0.23's tagged
arrays, vLLM's map events (PR #42892) with its default 32-byte sha256 hashes, vLLM 0.33's
fields (``locality``, KV-cache groups, a coarser group's block size), SGLang's map events
(signed 64-bit hashes, ``CPU_PINNED``, a dp rank, EAGLE token pairs), LoRA and extra keys,
removals and clears. Each file's first byte is the target's knob (events.cpp: slot, block
size 2, bigram off).

``nats``: what a nats-server sends the native reader: INFO, PING, +OK, MSG and HMSG with
the Kv-Seq / Kv-Dp-Rank / Kv-Epoch headers around those batches, a MSG line near the
4,096-byte control-line limit, an oversized message, -ERR.

    python3 fuzz/make_corpus.py OUT_DIR   # writes OUT_DIR/events/* and OUT_DIR/nats/*
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from index.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    batch_to_obj,
    encode,
)

B = 2  # the router block size the target is told (knob byte below)
KNOB = bytes([(B - 1) << 2])


def sha(h: int) -> bytes:
    return hashlib.sha256(h.to_bytes(8, "big")).digest()


def signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def chain(n: int, start: int = 1) -> tuple[list[int], list[int]]:
    hashes = [(start + i) * 0x9E3779B97F4A7C15 % (1 << 64) for i in range(n)]
    tokens = [(start * 7 + i) % 50_000 for i in range(n * B)]
    return hashes, tokens


def plain_events(medium: str | None = "GPU") -> list[Event]:
    hs, toks = chain(4)
    more, more_toks = chain(2, 9)
    return [
        BlockStored(hs, None, toks, B, medium=medium),
        BlockStored(more, hs[-1], more_toks, B, medium=medium),
        BlockRemoved([more[-1]], medium),
        BlockStored(hs[:2], None, toks[: 2 * B], B, medium="CPU"),
        AllBlocksCleared(),
        BlockStored(hs[:1], None, toks[:B], B, medium=medium),
    ]


def map_obj(events: list[Event], hash_of: Any = None, dp: int | None = None) -> Any:
    obj = batch_to_obj(EventBatch(1.5, events, dp), events_as_map=True)
    if hash_of is not None:
        for e in obj[1]:
            if "block_hashes" in e:
                e["block_hashes"] = [hash_of(h) for h in e["block_hashes"]]
            if e.get("parent_block_hash") is not None:
                e["parent_block_hash"] = hash_of(e["parent_block_hash"])
    return obj


def sglang(events: list[Event], dp: int) -> Any:
    obj = map_obj(events, signed, dp)
    for e in obj[1]:
        for k in ("lora_name", "extra_keys", "group_idx"):
            e.pop(k, None)
        if e.get("medium") == "CPU":
            e["medium"] = "CPU_PINNED"
    return {"ts": 2.0, "events": obj[1], "attn_dp_rank": dp}


def vllm_033() -> Any:
    hs, toks = chain(2)
    coarse = BlockStored(
        hs, None, chain(4)[1], 2 * B, medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention"
    )
    obj = map_obj([coarse, BlockRemoved(hs[1:], "GPU", 0)], sha)
    obj[1][0]["locality"] = "LOCAL"
    sw = BlockStored(
        hs[:1],
        None,
        toks[:B],
        B,
        medium="CPU",
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
    )
    remote = map_obj([sw], sha)[1][0]
    remote["locality"] = "REMOTE"
    obj[1].append(remote)
    return obj


def extras() -> list[Event]:
    hs, toks = chain(2, 3)
    return [
        BlockStored(hs, None, toks, B, lora_id=7, medium="GPU"),
        BlockStored(
            hs, None, toks, B, lora_name="adapter", medium="GPU", extra_keys=[["img", 0], None]
        ),
        BlockStored(hs, None, [[t, t + 1] for t in toks], B),  # EAGLE pairs
    ]


def payloads() -> dict[str, bytes]:
    pack = lambda obj: bytes(msgpack.packb(obj, use_bin_type=True))  # noqa: E731
    return {
        "vllm_array": encode(EventBatch(1.0, plain_events(), None)),
        "vllm_array_dp": encode(EventBatch(1.0, plain_events(None), 1)),
        "vllm_map": encode(EventBatch(1.0, plain_events(), None), events_as_map=True),
        "vllm_map_batch": encode(
            EventBatch(1.0, plain_events(), 0), events_as_map=True, batch_as_map=True
        ),
        "vllm_sha256": pack(map_obj(plain_events(), sha)),
        "vllm_033": pack(vllm_033()),
        "sglang": pack(sglang(plain_events(), 1)),
        "sglang_array": pack(map_obj(plain_events(), signed, 0)),
        "extras": encode(EventBatch(1.0, extras(), None), events_as_map=True),
        "cleared": encode(EventBatch(1.0, [AllBlocksCleared()] * 8, None)),
        "bad_events": pack(
            [
                1.0,
                [
                    None,
                    1,
                    "x",
                    ["BlockStored"],
                    {"type": 3},
                    ["BlockRemoved", [True]],
                    ["Future", 1],
                ],
                None,
            ]
        ),
    }


def nats_streams(batches: dict[str, bytes]) -> dict[str, bytes]:
    info = b'INFO {"server_id":"x","version":"2.10.0","headers":true,"max_payload":1048576}\r\n'
    out = {}
    for seq, (name, payload) in enumerate(batches.items()):
        hdr = (
            f"NATS/1.0\r\nKv-Seq: {seq}\r\nKv-Dp-Rank: {seq % 2}\r\nKv-Epoch: e{seq // 4}\r\n\r\n"
        ).encode()
        subject = f"kv.events.w{seq}".encode()
        hmsg = b"HMSG %s 1 %d %d\r\n%s%s\r\n" % (
            subject,
            len(hdr),
            len(hdr) + len(payload),
            hdr,
            payload,
        )
        out[f"hmsg_{name}"] = b"\x00\x07" + info + b"+OK\r\nPONG\r\n" + hmsg + b"PING\r\n"
    long_subject = b"kv.events." + b"w" * 4070
    out["long_line"] = (
        b"\x3f\xff"
        + info
        + b"MSG %s 1 2\r\nhi\r\n" % long_subject
        + b"MSG kv.events.ok 1 reply.to 0\r\n\r\n"
    )
    out["oversized"] = b"\x10\x20" + info + b"MSG kv.events.big 1 4000\r\n" + b"x" * 4000 + b"\r\n"
    out["err"] = b"\x00\x40PING\r\n-ERR 'Authorization Violation'\r\n"
    out["seq_edges"] = b"\x00\xff" + b"".join(
        b"HMSG kv.events.w 1 %d %d\r\n%s%s\r\n" % (len(h), len(h) + n, h, b"x" * n)
        for n, h in [
            (0, b"NATS/1.0\r\nKv-Seq: 9223372036854775807\r\n\r\n"),
            (1, b"NATS/1.0\r\nKv-Seq: 9223372036854775807\r\n\r\n"),
            (0, b"NATS/1.0\r\nKv-Seq: 9999999999999999999\r\nKv-Dp-Rank: 65535\r\n\r\n"),
            (2, b"NATS/1.0 503\r\nKv-Seq: -1\r\nKv-Epoch:\r\n\r\n"),
        ]
    )
    return out


def main() -> None:
    root = Path(sys.argv[1])
    batches = payloads()
    for sub, items in (
        ("events", {k: KNOB + v for k, v in batches.items()}),
        ("nats", nats_streams(batches)),
    ):
        (root / sub).mkdir(parents=True, exist_ok=True)
        for name, data in items.items():
            (root / sub / name).write_bytes(data)
    print(f"{len(batches)} batches, {len(items)} NATS streams -> {root}")


if __name__ == "__main__":
    main()
