"""Multimodal chat prompts: which items the router can identify, and how far it may hash.

An engine expands each image / audio / video item of a chat into a run of placeholder
tokens and mixes the item's identifier into every block the run touches: vLLM's extra
key ``(identifier, item start - block start)`` (``_gen_mm_extra_hash_keys``), the
identifier being the part's ``uuid`` when the client gives one (vLLM's
``multi_modal_uuids``), else the engine's own content hash. The router can key a
block past an item only when it knows both:

- the identifier: the part's ``uuid``, else ``media_identifier``'s digest of the item's
  bytes (its data URI, or its URL), which is the engine's identifier only for engines
  that hash items the same way (Dynamo-style ``mm_hash`` frontends, the mock engine); a
  vLLM engine hashing decoded pixels names the item otherwise, so the router never
  learns that digest and stops there;
- the item's placeholder tokens, learnt from the engine's own KV events
  (``index.media.MediaRegistry``: a block carrying ``(identifier, offset)`` shows the
  tokens of the run).

``expand`` builds the engine-side token sequence up to the first item it cannot key;
the blocks past it are never matched (``hashable``).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from index.hashing import TokenIds
from router.tokens.tokenize import MEDIA_MARK, Tokenizer

# the content part types that carry one media item, and where the payload sits
_PAYLOAD = {
    "image_url": ("image_url", "url"),
    "video_url": ("video_url", "url"),
    "audio_url": ("audio_url", "url"),
    "input_audio": ("input_audio", "data"),
    "image": ("image", None),
}


def as_ints(tokens: TokenIds) -> list[int]:
    """Token ids as ints (the fallback tokenizer gives packed little-endian u32 bytes)."""
    if isinstance(tokens, list):
        return tokens
    if isinstance(tokens, bytes | memoryview):
        packed = array("I")
        packed.frombytes(bytes(tokens))
        if sys.byteorder != "little":
            packed.byteswap()
        return packed.tolist()
    return list(tokens)


def media_identifier(part: Mapping[str, Any]) -> str:
    """The item's identifier: the client's ``uuid``, else a digest of its payload."""
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        return uuid
    kind = str(part.get("type"))
    key, inner = _PAYLOAD.get(kind, (kind, None))
    payload = part.get(key)
    if inner is not None and isinstance(payload, Mapping):
        payload = payload.get(inner)
    data = payload if isinstance(payload, str) else repr(payload)
    return "mm-" + xxhash.xxh3_128_hexdigest(data.encode("utf-8", "surrogatepass"))


def media_parts(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The chat's non-text content parts, in prompt order."""
    out = []
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list):
            out += [p for p in content if isinstance(p, Mapping) and p.get("type") != "text"]
    return out


def _marked(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body with every non-text part replaced by ``MEDIA_MARK`` text."""
    messages = []
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list):
            content = [
                p
                if isinstance(p, Mapping) and p.get("type") == "text"
                else {"type": "text", "text": MEDIA_MARK}
                for p in content
            ]
            m = {**m, "content": content}
        messages.append(m)
    return {**body, "messages": messages}


def segments(tok: Tokenizer, body: Mapping[str, Any]) -> list[TokenIds]:
    """The chat's text tokens between its media items (one more than there are items):
    the template rendered with a mark for each item, each piece tokenized alone, as an
    engine tokenizes around the placeholders it then expands."""
    text = tok.chat_template.render(_marked(body))
    special = bool(body.get("add_special_tokens", False))
    pieces = text.split(MEDIA_MARK)
    return [tok.encode(piece, special if i == 0 else False) for i, piece in enumerate(pieces)]


@dataclass(slots=True)
class Expanded:
    """A multimodal chat as the engine's tokens, as far as the router can know them."""

    tokens: list[int]
    items: list[tuple[str, int, int]] = field(default_factory=list)  # (id, start, length)
    hashable: int | None = None  # tokens the router may key (None: all of them)


def expand(
    tok: Tokenizer,
    body: Mapping[str, Any],
    placeholder: Callable[[str], list[int] | None],
    as_ints: Callable[[TokenIds], list[int]],
) -> Expanded:
    """The engine-side tokens of a chat with media: text pieces and each item's
    placeholder run (``placeholder(identifier)``; None: unknown, so hashing stops at the
    item, less one token since a token may merge across the cut)."""
    pieces = segments(tok, body)
    parts = media_parts(body)
    out = Expanded(as_ints(pieces[0]))
    for part, piece in zip(parts, pieces[1:], strict=False):
        ident = media_identifier(part)
        run = placeholder(ident)
        if run is None:
            out.hashable = max(len(out.tokens) - 1, 0)
            return out
        out.items.append((ident, len(out.tokens), len(run)))
        out.tokens += run
        out.tokens += as_ints(piece)
    return out


def block_keys(items: list[tuple[str, int, int]], block_size: int) -> dict[int, list[Any]]:
    """Per block, vLLM's multimodal extra keys: ``(identifier, item start - block start)``
    for each item the block overlaps."""
    keys: dict[int, list[Any]] = {}
    for ident, start, length in items:
        if length <= 0:
            continue
        for b in range(start // block_size, (start + length - 1) // block_size + 1):
            keys.setdefault(b, []).append((ident, start - b * block_size))
    return keys
