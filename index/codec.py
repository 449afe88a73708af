"""KV-cache event codec: vLLM / SGLang msgpack ``EventBatch`` and a JSON form.

Every encoding seen in the wild decodes to the same plain dataclasses:

- batch: positional ``[ts, events, dp_rank]`` or a map (``ts``, ``events``,
  ``data_parallel_rank`` / ``dp_rank`` / ``attn_dp_rank``);
- event: tagged array ``["BlockStored", ...]`` (vLLM <= 0.23, SGLang) or a map with
  ``"type"`` (vLLM after PR #42892);
- hash: unsigned or signed 64-bit int, or bytes (vLLM's default: a 32-byte sha256).

Engine hashes are opaque names, kept lossless end to end (``EngineHash``): an int as
an unsigned 64-bit int, bytes as the same bytes. Every path that carries them (events,
the agent's mirror and dumps, replays, prefetch hints) uses that one form; JSON, which
has no bytes, spells them as hex strings (``hash_to_json``).

Unknown fields are ignored and missing optional ones are ``None``. A bad event is
dropped and counted in ``DecodedBatch.errors``; only an unreadable envelope raises.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import orjson

MASK64 = (1 << 64) - 1

EngineHash = int | bytes


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None  # the group's kind (vLLM: "full_attention", ...)
    kv_cache_spec_sliding_window: int | None = None  # its window in tokens
    cache_salt: str | None = None  # SGLang sends it as a field; vLLM inside extra_keys


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[Event]
    dp_rank: int | None = None


@dataclass(slots=True)
class DecodedBatch:
    """A batch as decoded: its events, plus what had to be skipped and why."""

    ts: float
    events: list[Event]
    dp_rank: int | None = None
    errors: Counter[str] = field(default_factory=Counter)


class CodecError(ValueError):
    """The payload is not an EventBatch at all (the whole batch is unusable)."""


# Positional field order after the tag (array-encoded events), oldest fields first.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_DP_KEYS = ("data_parallel_rank", "dp_rank", "attn_dp_rank")


def norm_hash(value: Any) -> EngineHash:
    """An engine block hash in its one lossless form: a signed 64-bit int as the
    unsigned int with the same bits, bytes as bytes (never an int: a 32-byte sha256 is
    no msgpack int, and leading zero bytes would be lost)."""
    if isinstance(value, bool):
        raise TypeError("bool is not a block hash")
    if isinstance(value, int):
        if not -(1 << 63) <= value <= MASK64:
            raise ValueError("an int block hash must fit in 64 bits")
        return value & MASK64
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"block hash of type {type(value).__name__}")


def hash_to_json(h: EngineHash) -> int | str:
    """An engine hash as JSON can carry it: ints as ints, bytes as a hex string."""
    return h.hex() if isinstance(h, bytes) else h


def hash_from_json(value: Any) -> EngineHash:
    """The inverse of ``hash_to_json``; TypeError/ValueError for anything else."""
    if isinstance(value, str):
        return bytes.fromhex(value)
    return norm_hash(value)


def _opt_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"expected int or nil, got {type(value).__name__}")


def _opt_str(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode()
    raise TypeError(f"expected str or nil, got {type(value).__name__}")


HashOf = Callable[[Any], EngineHash]


def _hashes(value: Any, hash_of: HashOf) -> list[EngineHash]:
    if not isinstance(value, list | tuple):
        raise TypeError("block_hashes is not a list")
    return [hash_of(v) for v in value]


def _split(raw: Any) -> tuple[str, list[Any] | dict[str, Any]]:
    """(tag, body) of one event: body is the positional fields or the map."""
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str | bytes):
        tag: Any = raw[0]
        body: list[Any] | dict[str, Any] = list(raw[1:])
    elif isinstance(raw, dict):
        tag, body = raw.get("type"), raw
    else:
        raise TypeError("event is neither a tagged array nor a map")
    if isinstance(tag, bytes):
        tag = tag.decode()
    if not isinstance(tag, str):
        raise TypeError("event has no type tag")
    return tag, body


def _named(body: list[Any] | dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return body if isinstance(body, dict) else dict(zip(names, body, strict=False))


_U32 = 1 << 32


def _token_ids(value: Any) -> list[int]:
    """Token ids, each an int in [0, 2**32) as the router hashes them (u32s) and the
    native decoder reads them (a bool, a negative or a wider int is a bad event there,
    and here: before session 16 ``True`` was taken as 1 and a negative id raised from the
    hasher, out of the ingest). SGLang's EAGLE mode sends ``[t, t+1]`` pairs, flattened
    here to the ``n + 1`` tokens the bigram windows cover."""
    if not isinstance(value, list | tuple):
        raise TypeError("token_ids is not a list")
    if value and isinstance(value[0], list | tuple):
        if any(not isinstance(p, list | tuple) or len(p) != 2 for p in value):
            raise TypeError("bigram token_ids must be pairs")
        ids = [p[0] for p in value] + [value[-1][1]]
    else:
        ids = list(value)
    for t in ids:
        if type(t) is not int or not 0 <= t < _U32:
            raise TypeError("a token id is not an int in [0, 2**32)")
    return ids


def _medium(f: dict[str, Any]) -> str | None:
    """The event's tier; vLLM 0.33's ``locality: "REMOTE"`` (a block in a store other
    nodes reach, e.g. an offloading connector's) is the ``REMOTE`` medium, whatever
    device it names, so stores, removals and dumps all keep it in the shared tier."""
    locality = _opt_str(f.get("locality"))
    if locality is not None and locality.upper() == "REMOTE":
        return "REMOTE"
    return _opt_str(f.get("medium"))


def decode_event(raw: Any, hash_of: HashOf = norm_hash) -> Event | None:
    """One event, or None for a kind this codec does not know (future events).

    ``hash_of`` reads one hash: ``norm_hash`` for msgpack, ``hash_from_json`` for JSON.
    """
    tag, body = _split(raw)
    if tag == "BlockStored":
        f = _named(body, _STORED_FIELDS)
        medium = _medium(f)
        parent = f.get("parent_block_hash")
        block_size = f.get("block_size")
        if type(block_size) is not int or block_size <= 0:  # a bool is no size
            raise TypeError("block_size is not a positive int")
        extra = f.get("extra_keys")
        return BlockStored(
            block_hashes=_hashes(f.get("block_hashes"), hash_of),
            parent_block_hash=None if parent is None else hash_of(parent),
            token_ids=_token_ids(f.get("token_ids")),
            block_size=block_size,
            lora_id=_opt_int(f.get("lora_id")),
            medium=medium,
            lora_name=_opt_str(f.get("lora_name")),
            extra_keys=list(extra) if isinstance(extra, list | tuple) else None,
            group_idx=_opt_int(f.get("group_idx")),
            kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind")),
            kv_cache_spec_sliding_window=_opt_int(f.get("kv_cache_spec_sliding_window")),
            cache_salt=_opt_str(f.get("cache_salt")) if isinstance(body, dict) else None,
        )
    if tag == "BlockRemoved":
        f = _named(body, _REMOVED_FIELDS)
        return BlockRemoved(
            block_hashes=_hashes(f.get("block_hashes"), hash_of),
            medium=_medium(f),
            group_idx=_opt_int(f.get("group_idx")),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _envelope(obj: Any) -> tuple[float, Any, int | None]:
    if isinstance(obj, list | tuple) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        dp = obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict) and "events" in obj:
        ts, events = obj.get("ts", 0.0), obj["events"]
        dp = next((obj[k] for k in _DP_KEYS if obj.get(k) is not None), None)
    else:
        raise CodecError("not an EventBatch")
    if not isinstance(events, list | tuple):
        raise CodecError("EventBatch.events is not a list")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise CodecError("EventBatch.ts is not a number")
    if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool)):
        raise CodecError("EventBatch dp rank is not an int")
    return float(ts), events, dp


def decode_obj(obj: Any, hash_of: HashOf = norm_hash) -> DecodedBatch:
    """Decode an already-unpacked batch (msgpack or, with ``hash_from_json``, JSON)."""
    ts, raw_events, dp = _envelope(obj)
    batch = DecodedBatch(ts=ts, events=[], dp_rank=dp)
    for raw in raw_events:
        try:
            event = decode_event(raw, hash_of)
        except (TypeError, ValueError, UnicodeDecodeError):
            batch.errors["bad_event"] += 1
            continue
        if event is None:
            batch.errors["unknown_event"] += 1
        else:
            batch.events.append(event)
    return batch


def decode(payload: bytes) -> DecodedBatch:
    """Decode one msgpack EventBatch as vLLM or SGLang publish it."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CodecError(f"not msgpack: {exc}") from exc
    return decode_obj(obj)


def decode_json(payload: bytes | str) -> DecodedBatch:
    """Decode the JSON form (same shape as the map encoding)."""
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise CodecError(f"not JSON: {exc}") from exc
    return decode_obj(obj, hash_from_json)


# -- encoding (mock engine, agent dumps, tests) -----------------------------------


def _event_fields(event: Event) -> tuple[str, tuple[str, ...]]:
    if isinstance(event, BlockStored):
        return "BlockStored", _STORED_FIELDS
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", _REMOVED_FIELDS
    return "AllBlocksCleared", ()


def event_to_obj(event: Event, *, as_map: bool) -> Any:
    """The wire object of one event: a tagged array, or a map with ``type``.

    Like msgspec's ``omit_defaults``, trailing ``None`` fields are left off arrays
    and ``None`` fields past the required ones are left out of maps.
    """
    tag, names = _event_fields(event)
    values = [getattr(event, n) for n in names]
    required = 7 if tag == "BlockStored" else 2 if tag == "BlockRemoved" else 0
    if as_map:
        obj: dict[str, Any] = {"type": tag}
        for i, (name, value) in enumerate(zip(names, values, strict=True)):
            if i < required or value is not None:
                obj[name] = value
        if isinstance(event, BlockStored) and event.cache_salt is not None:
            obj["cache_salt"] = event.cache_salt
        return obj
    while len(values) > required and values[-1] is None:
        values.pop()
    return [tag, *values]


def batch_to_obj(
    batch: EventBatch, *, events_as_map: bool = False, batch_as_map: bool = False
) -> Any:
    events = [event_to_obj(e, as_map=events_as_map) for e in batch.events]
    if batch_as_map:
        return {"ts": batch.ts, "events": events, "data_parallel_rank": batch.dp_rank}
    return [batch.ts, events, batch.dp_rank]


def encode(batch: EventBatch, *, events_as_map: bool = False, batch_as_map: bool = False) -> bytes:
    """msgpack bytes of ``batch``; the defaults give vLLM's (<= 0.23) and SGLang's layout."""
    packed: bytes = msgpack.packb(
        batch_to_obj(batch, events_as_map=events_as_map, batch_as_map=batch_as_map),
        use_bin_type=True,
    )
    return packed


def encode_json(batch: EventBatch) -> bytes:
    """The JSON form, for humans and tests (bytes hashes as hex, see ``hash_to_json``)."""
    return orjson.dumps(
        batch_to_obj(batch, events_as_map=True, batch_as_map=True), default=_json_default
    )


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return hash_to_json(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
