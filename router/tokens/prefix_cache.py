"""The conversation prefix cache: turn N of a chat tokenizes and hashes only what turn
N-1 did not.

A multi-turn or agent client sends the whole conversation every turn. Rendering it is
cheap (jinja, ~0.25 ms for a 32K-token ChatML chat); encoding it and hashing its blocks
are not. Even with every segment found in ``SegmentCache`` a 32K-token turn cost
~1.5 ms of lookups and list building plus 0.3 ms of block hashing, and the tokenizer
alone takes ~35 ms for the whole text. So each chat request leaves behind the token ids
and block hashes of its rendered text up to its last cut point, and the next request
whose rendered text starts with those exact bytes takes them and encodes and hashes
only the rest.

Exact by construction, never by guess:

- the key is the 128-bit XXH3 and length of the *rendered* text's prefix, so a template
  that renders earlier messages differently on a later turn (a date, reasoning stripped
  from old assistant turns) simply misses and an earlier cut point is tried;
- prefixes end only before a special token of the tokenizer's ``cuts``
  (``router.tokens.tokenize``), where ``encode(a + t + b) == encode(a) + encode(t + b)`` holds
  for HF tokenizers (added tokens are split out before normalizing), proven per token
  at load; the hypothesis tests in tests/test_prefix_cache.py hold every turn against
  full encoding on the real SentencePiece model;
- the cached hashes are a chain's first blocks, so the rest continues from the last of
  them; the scope key carries everything else that enters a chain (block size, seed,
  bigram windows, LoRA root, cache salt); a request with media items is never cached.

Bounded in bytes (``prefix_cache_mb``), least recently used dropped first. An entry that
a longer one extends is moved to the eviction end: a conversation keeps one entry for
its newest turn while room is short, and forks from an older turn still find theirs
while it is not.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, islice

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from xxhash import xxh3_128_intdigest

from index.hashing import BlockHasher, RouterHash, request_block_hashes
from router.tokens.tokenize import HFTokenizer

# Cut points tried from the end of a text. A ChatML turn adds three (assistant reply,
# user message, generation prompt), an agent turn with tool calls a few more; each try
# is one XXH3 over the prefix (~10 us per 128 KB) and one dict probe.
MAX_PROBES = 64
# Shorter chat texts skip the cache: looking up and keeping a prefix costs ~40 us, a
# quarter of a 100-token chat's whole encoding (0.21 vs 0.17 ms), and saves less.
MIN_CHARS = 2048
_ENTRY_OVERHEAD = 200  # bytes of a ``Prefix`` and its key beyond its ids and hashes
# A hash is kept as a list item and its int object (8 + 36 bytes) rather than packed in
# an ``array('Q')`` (8): packing and unpacking 2K hashes cost ~0.15 ms a 33K-token turn,
# and the ids (4 bytes a token, 16 tokens a block) are most of an entry either way.
_HASH_BYTES = 44

Scope = tuple[object, ...]
Key = tuple[Scope, int, int]  # scope, prefix length in bytes, its XXH3-128


@dataclass(frozen=True, slots=True)
class Prefix:
    """The token ids of a rendered text prefix and the router's hashes of its full blocks."""

    ids: array[int]  # 'I'
    hashes: list[RouterHash]  # never changed: a request extends a copy

    @property
    def nbytes(self) -> int:
        return len(self.ids) * 4 + len(self.hashes) * _HASH_BYTES + _ENTRY_OVERHEAD


@dataclass(slots=True)
class Lookup:
    """What ``PrefixCache.lookup`` found for one chat text; ``PrefixCache.finish`` takes it."""

    tok: HFTokenizer
    text: str
    hasher: BlockHasher
    lora_name: str | None
    cache_salt: str | None
    scope: Scope
    data: bytes | None = None  # the text as UTF-8; None: too short for the cache
    last: int | None = None  # the text's last cut point: where its own prefix will end
    start: int = 0  # bytes of ``data`` the cached prefix covers
    prefix: Prefix | None = None
    key: Key | None = None  # ``prefix``'s

    @property
    def pending(self) -> int:
        """Bytes of the text still to encode."""
        return len(self.text) if self.data is None else len(self.data) - self.start


def cuts_from_end(data: bytes, cuts: list[bytes]) -> Iterator[int]:
    """The byte offsets > 0 where a cut token starts in ``data``, last first, each once.

    Found lazily: a turn's lookup usually stops at its third or fourth cut point, so
    searching only that far back costs a few KB of ``rfind`` instead of the whole text
    (all 64 cut points of a 65 KB conversation: 0.14 ms a turn). Searching UTF-8 bytes
    for a UTF-8 token only matches at character boundaries (no lead byte equals a
    continuation byte), so these are the text's own cut points.
    """
    at = [data.rfind(t, 1) for t in cuts]
    while at:
        i = max(at)
        if i <= 0:
            return
        yield i
        for k, t in enumerate(cuts):
            if at[k] == i:  # the next match of this token starts before ``i``
                at[k] = data.rfind(t, 1, i + len(t) - 1)


class PrefixCache(Collector):
    """Rendered chat prefixes -> ``Prefix``, bounded by ``max_bytes``; thread-safe (the
    tokenize pool's threads use it), and the collector of its ``cache_router_prefix_*``
    metrics."""

    def __init__(self, max_bytes: int, min_chars: int = MIN_CHARS) -> None:
        self.max_bytes = max_bytes
        self.min_chars = min_chars
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0  # tokens taken from the cache instead of the tokenizer
        self.tokens_encoded = 0  # tokens of cacheable requests the tokenizer encoded
        self.evictions = 0
        self._lru: OrderedDict[Key, Prefix] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    # -- the LRU -----------------------------------------------------------------
    def _get(self, key: Key) -> Prefix | None:
        with self._lock:
            found = self._lru.get(key)
            if found is not None:
                self._lru.move_to_end(key)
            return found

    def _put(self, key: Key, prefix: Prefix, extends: Key | None) -> None:
        size = prefix.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if extends is not None and extends in self._lru:
                self._lru.move_to_end(extends, last=False)  # evicted first: see the docstring
            old = self._lru.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._lru[key] = prefix
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, gone = self._lru.popitem(last=False)
                self.bytes -= gone.nbytes
                self.evictions += 1

    # -- a chat's tokens and hashes: lookup on the loop, finish where it is cheapest ----
    def lookup(
        self,
        tok: HFTokenizer,
        text: str,
        hasher: BlockHasher,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> Lookup:
        """The longest cached prefix of ``text`` (XXH3 probes, no encoding): what is
        left to encode (``Lookup.pending``) tells whether ``finish`` is worth a thread."""
        scope: Scope = (
            tok.path, hasher.block_size, hasher.seed, hasher.bigram, lora_name, cache_salt
        )  # fmt: skip
        found = Lookup(tok, text, hasher, lora_name, cache_salt, scope)
        if len(text) < self.min_chars:
            return found  # short: the cache is skipped (``data`` None)
        data = found.data = text.encode("utf-8", "surrogatepass")
        view = memoryview(data)
        cuts = cuts_from_end(data, tok.cut_bytes)
        last = found.last = next(cuts, None)  # where this request's own prefix will end
        for b in islice(chain(() if last is None else (last,), cuts), MAX_PROBES):
            key = (scope, b, xxh3_128_intdigest(view[:b]))
            prefix = self._get(key)
            if prefix is not None:
                found.start, found.prefix, found.key = b, prefix, key
                break
        return found

    def finish(
        self, found: Lookup, marks: list[int] | None = None
    ) -> tuple[array[int], list[RouterHash]]:
        """``encode(text, add_special_tokens=False)`` and its block hashes (as
        ``request_block_hashes`` gives them) from a ``lookup``: encode and hash the rest,
        and keep this text's own prefix. ``marks`` gets the time the tokens were ready."""
        tok, hasher, scope = found.tok, found.hasher, found.scope
        lora_name, cache_salt = found.lora_name, found.cache_salt
        data = found.data
        if data is None:
            (ids,) = tok.segment_ids([found.text])
            if marks is not None:
                marks.append(time.time_ns())
            return ids, request_block_hashes(
                hasher, ids, lora_name=lora_name, cache_salt=cache_salt
            )
        start, prefix, last = found.start, found.prefix, found.last
        # the rest, cut at the last cut point so that point's prefix can be kept
        if last is not None and last <= start:
            last = None
        pieces = [data[start:last], data[last:]] if last is not None else [data[start:]]
        encoded = tok.segment_ids([p.decode("utf-8", "surrogatepass") for p in pieces])
        ids = array("I", prefix.ids) if prefix is not None else array("I")
        for part in encoded:
            ids.extend(part)
        reused = len(prefix.ids) if prefix is not None else 0
        with self._lock:
            self.hits += prefix is not None
            self.misses += prefix is None
            self.tokens_reused += reused
            self.tokens_encoded += len(ids) - reused
        if marks is not None:
            marks.append(time.time_ns())
        hashes = self._hashes(hasher, ids, prefix, lora_name, cache_salt)
        if last is not None:
            kept = len(ids) - len(encoded[-1])
            own = Prefix(ids[:kept], hashes[: hasher.num_blocks(kept)])
            view = memoryview(data)
            self._put((scope, last, xxh3_128_intdigest(view[:last])), own, found.key)
        return ids, hashes

    @staticmethod
    def _hashes(
        hasher: BlockHasher,
        ids: array[int],
        found: Prefix | None,
        lora_name: str | None,
        cache_salt: str | None,
    ) -> list[RouterHash]:
        done = len(found.hashes) if found is not None else 0
        if not done:  # block 0 is new: the salt and root enter here, as they always do
            return request_block_hashes(hasher, ids, lora_name=lora_name, cache_salt=cache_salt)
        assert found is not None
        out = list(found.hashes)
        # the chain's next blocks start at token done * B (bigram windows too)
        out.extend(hasher.hash_tokens(ids[done * hasher.block_size :], parent=out[-1]))
        return out

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "cache_router_prefix_cache_hits",
            "Chat requests whose tokens and hashes began with a cached conversation prefix",
            value=self.hits,
        )
        yield CounterMetricFamily(
            "cache_router_prefix_cache_misses",
            "Chat requests the conversation prefix cache could serve but had no prefix for",
            value=self.misses,
        )
        yield CounterMetricFamily(
            "cache_router_prefix_cache_tokens_reused",
            "Prompt tokens taken from the conversation prefix cache instead of the tokenizer",
            value=self.tokens_reused,
        )
        yield CounterMetricFamily(
            "cache_router_prefix_cache_tokens_encoded",
            "Prompt tokens of cacheable chat requests that the tokenizer encoded",
            value=self.tokens_encoded,
        )
        yield CounterMetricFamily(
            "cache_router_prefix_cache_evictions",
            "Conversation prefixes dropped to stay within prefix_cache_mb",
            value=self.evictions,
        )
        yield GaugeMetricFamily(
            "cache_router_prefix_cache_bytes",
            "Bytes the conversation prefix cache holds (token ids, hashes, overhead)",
            value=self.bytes,
        )
        yield GaugeMetricFamily(
            "cache_router_prefix_cache_entries",
            "Conversation prefixes the cache holds",
            value=len(self._lru),
        )
