"""The gap-fill protocol between a router and a node agent (plain data, no I/O).

Its subject says ``replay`` and so do its counters (``replay_requests``...): contracts
older than the word's other uses. In the code "gap fill" is this, "trace replay" is
``sim.trace_replay`` (``cache-router replay``) and "engine replay" the engine's own ZMQ
replay socket that the agent reads (``agent.engine_zmq``).

A router that detects a gap asks ``<prefix>.replay.<worker_id>`` with a JSON request
``{"from_seq": N}``. The agent answers with a *stream* of msgpack messages to the
request's reply inbox, so no single NATS message grows past the payload limit:

- ``{"kind": "batch", "seq": S, "payload": <EventBatch bytes>}`` for each buffered
  batch from N on, in order; or, when N has left the agent's buffer,
- ``{"kind": "dump", "seq": S, "payload": <EventBatch bytes>}`` chunks that together
  re-create everything the engine holds as of seq S (BlockStored events, parents first),
- then exactly one ``{"kind": "end", "epoch": E, "last_seq": L, "dump": bool}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgpack
import orjson

Kind = Literal["batch", "dump", "end"]


@dataclass(slots=True, frozen=True)
class GapFillRequest:
    from_seq: int

    def encode(self) -> bytes:
        return orjson.dumps({"from_seq": self.from_seq})

    @classmethod
    def decode(cls, data: bytes) -> GapFillRequest:
        obj = orjson.loads(data)
        seq = obj.get("from_seq") if isinstance(obj, dict) else None
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ValueError("gap-fill request needs a non-negative int from_seq")
        return cls(seq)


@dataclass(slots=True, frozen=True)
class GapFillMessage:
    kind: Kind
    seq: int = -1
    payload: bytes = b""
    epoch: str | None = None
    dump: bool = False

    def encode(self) -> bytes:
        obj: dict[str, object]
        if self.kind == "end":
            obj = {"kind": "end", "epoch": self.epoch, "last_seq": self.seq, "dump": self.dump}
        else:
            obj = {"kind": self.kind, "seq": self.seq, "payload": self.payload}
        packed: bytes = msgpack.packb(obj, use_bin_type=True)
        return packed

    @classmethod
    def decode(cls, data: bytes) -> GapFillMessage:
        obj = msgpack.unpackb(data, raw=False)
        if not isinstance(obj, dict) or obj.get("kind") not in ("batch", "dump", "end"):
            raise ValueError("not a gap-fill message")
        if obj["kind"] == "end":
            epoch = obj.get("epoch")
            if epoch is not None and not isinstance(epoch, str):
                raise ValueError("a gap-fill end's epoch is a string")  # the ingest keys on it
            return cls(
                "end",
                int(obj.get("last_seq", -1)),
                epoch=epoch,
                dump=bool(obj.get("dump")),
            )
        return cls(obj["kind"], int(obj["seq"]), bytes(obj["payload"]))
