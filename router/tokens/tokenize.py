"""The tokenizer stage: a request body -> the token ids the engine will see.

Cache-aware routing needs the router's block hashes to equal the ones it recomputes
from the engine's ``BlockStored.token_ids``, so the prompt must become exactly the
engine's tokens:

- completions: ``prompt`` text is encoded with special tokens (vLLM's default for
  ``/v1/completions``); a prompt given as token ids is used as is;
- chat: ``messages`` are rendered with the model's chat template from
  ``tokenizer_config.json`` (or ``chat_template.jinja``) in a sandboxed jinja2
  environment set up like transformers' ``apply_chat_template`` (trim_blocks,
  lstrip_blocks, loopcontrols, ``tojson``, ``raise_exception``, ``strftime_now``), then
  encoded without special tokens (vLLM's chat default; the template adds them).

Fallback without a tokenizer (``FallbackTokenizer``): the prompt's UTF-8 bytes, zero
padded to a multiple of 4, read as little-endian u32 token ids, i.e. one "token" per
4 bytes (close to real token counts). Identical text prefixes give identical token
prefixes, so routing by prefix still works for anything that tokenizes the same way
(the mock engine imports this class); against a real engine hashes will not match
its events, which is why the router warns at start-up. Chat messages are rendered
first by ``FallbackChat``: ``<|role|>\ncontent\n`` per message, then
``<|assistant|>\n`` when a generation prompt is wanted (also used for a HF tokenizer
that has no chat template).

Chat text is encoded by segments (``SegmentCache``): the rendered text is cut before
each special token the template writes (``<|im_start|>``, ``<s>``, ``[INST]``...), each
segment encoded once and kept (LRU, bounded in tokens), so a multi-turn or agent
request encodes only what its previous turns did not, and the segments it does encode
go to ``encode_batch_fast`` together, which releases the GIL (``encode`` holds it: 362 ms
for 174K tokens during which no request moved) and computes no offsets (40 % less CPU
than ``encode_batch``: 34 vs 57-64 ms at 32K tokens).

A segment longer than ``WORD_CHUNK`` characters is cut again before a space, at most
one cut per ``WORD_CHUNK`` (``_word_pieces``), where the tokenizer's family is proven to
split cleanly there (``_word_cut_mode``): a prompt that shares a long text with an
earlier one, with no special token inside it (an agent's history sent as one user
message, as aiperf's trace replays do; a long system prompt in a new conversation),
takes all but its last piece of that text from the cache. ``bench/hotpath.py
--shared-prefix-only`` (``shared_prefix_tokenize_alone``: 4 agents' 32 turns, one user
message each, ~5.6K tokens on average, Llama's SentencePiece model, under the lock):
0.87 ms of CPU a turn to tokenize and hash against 3.42 ms with segments cut only at
special tokens; through the router over HTTP 1.84 against 3.30 ms a turn.

Encoding by segments is exact because HF tokenizers split added tokens out before
normalizing and pre-tokenizing: ``encode(a + t + b) == encode(a) + encode(t + b)``
for a special token ``t`` (not normalized, not stripping left). Each tokenizer's
candidate tokens are checked on sample text at load; the hypothesis tests in
tests/test_tokenize_segments.py hold it against full encoding on real templates and
Llama's SentencePiece model.

One request's segments are encoded on one core: ``TOKENIZERS_PARALLELISM`` defaults to
false in a process that loads a tokenizer here, and in the encode processes it starts
(a value the user set is kept). The library's rayon workers spin after each call, and a
router spreads its requests over cores already (the tokenize threads, the encode
processes): ~1K tokens cost 0.94 ms of CPU serially against 1.34 ms with the workers,
whose spinning also ran beside the event loop. A cold 8K-token chat alone on an idle
machine waits longer (6.7 ms against 4.7) for 26 % less CPU. BENCHMARKS.md session 15
has the router's numbers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeAlias

import orjson
from jinja2 import Template, TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFRustTokenizer
from xxhash import xxh3_128_intdigest

from router.http.errors import ApiError
from router.tokens.pool import EncodeProcesses

log = logging.getLogger(__name__)

# bytes: packed little-endian u32 (the fallback's form); array('I'): a cached chat's
TokenIds: TypeAlias = "list[int] | bytes | array[int]"


def num_tokens(tokens: TokenIds) -> int:
    return len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)


def text_of_content(content: Any) -> str:
    """A message's content as text: strings as is, parts joined (non-text parts as JSON)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                out.append(str(part.get("text", "")))
            else:
                out.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
        return "".join(out)
    return "" if content is None else str(content)


# Stands in for a chat's first non-text part when ``hashable_tokens`` finds its position.
MEDIA_MARK = "\ue000cache-router-media\ue000"


def _media_cut(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The body with its first non-text content part replaced by ``MEDIA_MARK`` and
    everything after it dropped; None when all content is text."""
    messages = body.get("messages") or []
    for i, m in enumerate(messages):
        # a JSON body's messages are dicts: ``Mapping``'s isinstance runs ABC code (a
        # 7-message chat: 2.4 us a call against 0.9, twice a request, ~1 % of py-spy's
        # samples of bench/proxy.py's short chats)
        content = m.get("content") if type(m) is dict or isinstance(m, Mapping) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "text":
                continue
            head = [*content[:j], {"type": "text", "text": MEDIA_MARK}]
            return {**body, "messages": [*messages[:i], {**m, "content": head}]}
    return None


def has_media(body: Mapping[str, Any]) -> bool:
    """Whether a chat body has a non-text content part (see ``hashable_tokens``)."""
    return _media_cut(body) is not None


class _GenerationTag(Extension):
    """transformers' ``{% generation %}`` block: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    # transformers' filter is json.dumps: orjson spaces differently, changing tokens
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_ENV = _environment()


def _generation_prompt(body: Mapping[str, Any], kwargs: Mapping[str, Any]) -> bool:
    if body.get("continue_final_message"):
        return False
    return bool(kwargs.get("add_generation_prompt", body.get("add_generation_prompt", True)))


def _continued(rendered: str, body: Mapping[str, Any]) -> str:
    """``rendered`` cut right after the final message's text when the request continues
    it (``continue_final_message``), as vLLM and SGLang render it (transformers'
    ``apply_chat_template``): a template closes every message with its end-of-turn
    marker, which must not follow the text the model goes on writing (the router's
    migration sends a broken stream's text so far this way, router.forward.migrate)."""
    messages = body.get("messages") or []
    if not body.get("continue_final_message") or not messages:
        return rendered
    final = text_of_content(messages[-1].get("content")) if isinstance(messages[-1], dict) else ""
    stripped = final.strip()
    at = rendered.rfind(stripped) if stripped else -1
    if at < 0:
        raise ApiError(
            400, "continue_final_message: the final message is not in the rendered chat",
            "chat_template_error",
        )  # fmt: skip
    kept = final.lstrip()
    # the template kept the text as it came (trailing spaces too), or trimmed it
    end = at + len(kept) if rendered[at : at + len(kept)] == kept else at + len(stripped)
    return rendered[:end]


class ChatTemplate:
    """A compiled chat template plus the special tokens it may reference."""

    def __init__(self, source: str, special: Mapping[str, str] | None = None) -> None:
        self.template: Template = _ENV.from_string(source)
        self.special = dict(special or {})
        # ``Template.render`` copies the template's globals, a ChainMap over the
        # environment's, into each render's context, twice: a short chat's render took
        # 7.9-8.7 us with it, 3.0 without. Flattened once here (``_ENV``'s globals never
        # change after set-up).
        self.globals = dict(self.template.globals)

    def render(self, body: Mapping[str, Any]) -> str:
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs["add_generation_prompt"] = _generation_prompt(body, kwargs)
        for key in ("tools", "documents"):
            if body.get(key) is not None:
                kwargs.setdefault(key, body[key])
        template = self.template
        env = template.environment
        try:
            # what ``template.render(messages=..., **special, **kwargs)`` does (a key
            # given twice is still a TypeError), with the globals merged from a dict
            given = dict(messages=body["messages"], **self.special, **kwargs)
            ctx = env.context_class(
                env, {**self.globals, **given}, template.name, template.blocks,
                globals=self.globals,
            )  # fmt: skip
            rendered = env.concat(template.root_render_func(ctx))
        except Exception as exc:  # a template may raise anything on odd input
            raise ApiError(400, f"chat template failed: {exc}", "chat_template_error") from exc
        return _continued(rendered, body)


class FallbackChat:
    """The fallback rendering (see the module docstring), in plain Python: it runs per
    request on the hot path, where a jinja2 render would cost more than all routing."""

    def render(self, body: Mapping[str, Any]) -> str:
        parts = [
            f"<|{m.get('role')}|>\n{text_of_content(m.get('content'))}\n" for m in body["messages"]
        ]
        if _generation_prompt(body, body.get("chat_template_kwargs") or {}):
            parts.append("<|assistant|>\n")
        return _continued("".join(parts), body)


class Tokenizer:
    """Turns request bodies into token ids; subclasses say how text becomes ids."""

    name = "tokenizer"
    chat_template: ChatTemplate | FallbackChat

    def encode(self, text: str, add_special_tokens: bool) -> TokenIds:
        raise NotImplementedError

    def chat(self, body: Mapping[str, Any]) -> tuple[TokenIds, str]:
        """Token ids and rendered text of a chat body (``messages`` already validated)."""
        text = self.chat_template.render(body)
        return self.encode(text, bool(body.get("add_special_tokens", False))), text

    def hashable_tokens(self, body: Mapping[str, Any]) -> int | None:
        """How many leading tokens of a chat body the router can key as the engine does.

        None when every content part is text. Otherwise the engine mixes the first
        image/audio/video item's content hash (which only it can compute) into every
        block from the item's placeholder on: the tokens rendered before that item, less
        one (a token may merge across the cut), are all the router may hash.
        """
        cut = _media_cut(body)
        if cut is None:
            return None
        text = self.chat_template.render(cut)
        end = text.find(MEDIA_MARK)
        if end < 0:  # the template dropped the item: nothing after it is certain either
            end = len(text)
        prefix = self.encode(text[:end], bool(body.get("add_special_tokens", False)))
        return max(num_tokens(prefix) - 1, 0)

    def completion(
        self, prompt: Any, add_special_tokens: bool = True
    ) -> tuple[TokenIds, str | None]:
        """Token ids of a completions ``prompt`` (text, ids, or a batch: its first item)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens), prompt
        return list(prompt), None


class FallbackTokenizer(Tokenizer):
    """Stable pseudo-tokens from UTF-8 bytes; see the module docstring."""

    name = "fallback"

    def __init__(self) -> None:
        self.chat_template = FallbackChat()

    def encode(self, text: str, add_special_tokens: bool) -> bytes:
        data = text.encode("utf-8", "surrogatepass")
        pad = -len(data) % 4
        return data + b"\0" * pad if pad else data


class SegmentCache:
    """Token ids of chat text segments by content, least recently used dropped first.

    Bounded in tokens (``max_tokens``, 4 bytes each as ``array('I')``) and thread-safe:
    the router encodes on its thread pool. Keys are the 128-bit XXH3 of the segment.
    """

    def __init__(self, max_tokens: int = 1 << 22) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._lru: OrderedDict[int, array[int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: int) -> array[int] | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[int]) -> list[array[int] | None]:
        """Each key's ids (None: not cached), under one lock: a short chat has ~15
        segments, and a lock and a call per segment were a third of its lookup."""
        out: list[array[int] | None] = []
        lru = self._lru
        with self._lock:
            for key in keys:
                ids = lru.get(key)
                if ids is not None:
                    lru.move_to_end(key)
                out.append(ids)
            missed = out.count(None)
            self.misses += missed
            self.hits += len(keys) - missed
        return out

    def put(self, key: int, ids: array[int]) -> None:
        if len(ids) > self.max_tokens:
            return
        with self._lock:
            old = self._lru.pop(key, None)
            if old is not None:
                self.tokens -= len(old)
            self._lru[key] = ids
            self.tokens += len(ids)
            while self.tokens > self.max_tokens:
                _, gone = self._lru.popitem(last=False)
                self.tokens -= len(gone)


# Text around each candidate token when checking that it splits the encoding cleanly.
_PROBES = ("Hello world", " leading space", "\ntwo\nlines ", "数字 🙂", "", " ", "a")


def _cut_tokens(tok: HFRustTokenizer, template: str, special: Mapping[str, str]) -> list[str]:
    """The special tokens the chat text may be cut before: written by the template,
    matched as is (not normalized, no left strip), and proven on ``_PROBES``."""
    out = []
    added_tokens = list(tok.get_added_tokens_decoder().values())
    for added in added_tokens:
        t = added.content
        if not t or not added.special or added.normalized or added.lstrip or added.single_word:
            continue
        if t not in template and t not in special.values():
            continue
        # an added token with t's first character past its own first could match across
        # the cut (leftmost-longest), taking t's place in the full text: no probe finds it
        if any(t[0] in other.content[1:] for other in added_tokens):
            log.info("tokenizer: an added token could overlap %r; chats are not cut there", t)
            continue
        ok = all(
            tok.encode(a + t + b, add_special_tokens=False).ids
            == tok.encode(a, add_special_tokens=False).ids
            + tok.encode(t + b, add_special_tokens=False).ids
            for a in _PROBES
            for b in _PROBES
        )
        if ok:
            out.append(t)
        else:
            log.info(
                "tokenizer: %r does not split the encoding cleanly; chats are not cut there", t
            )
    return out


# A segment longer than this many characters is also cut at word boundaries
# (``_word_pieces``): ~250 tokens of English text a piece, so a request that shares a
# long prefix with an earlier one (an agent's conversation sent as one message, a long
# system prompt under a new question) encodes about one piece of the shared text again.
# Each piece costs ~2 us of hashing and lookup: 36 pieces for a 9K-token message.
WORD_CHUNK = 1024
_SPM_NORMALIZER = [
    {"type": "Prepend", "prepend": "\u2581"},
    {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
]
# A sentence long enough to have cuts of every kind, encoded whole and in pieces at load.
_WORD_PROBE = (
    "Hello world, the quick brown fox jumps over the lazy dog; a cache aware router "
    "routes  two spaces\tand tabs\nnew lines 数字 123 and emoji 🙂 ünïcödé café end"
)


@dataclass(frozen=True, slots=True)
class WordCuts:
    """Where a tokenizer's text may be cut at words (``_word_cut_mode``): ``mode``, and
    the first and last characters of its added tokens. An added token is split out of
    the text before anything else, so a cut's space must have ordinary text on both
    sides (``"x <|im_end|>"`` normalizes its space with the ``x``; cut there, it would
    not): the character left of it is no added token's last, the one right of it no
    added token's first, and no added token holds a space (checked at load)."""

    mode: str  # "drop" or "keep"
    firsts: frozenset[str]
    lasts: frozenset[str]


def _word_cut_mode(tok: HFRustTokenizer) -> WordCuts | None:
    """How a text may be cut before a space and each piece encoded alone, or None.

    - ``"drop"``: SentencePiece-style BPE (Llama-2, Mistral: no pre-tokenizer, the
      normalizer prepends ``▁`` and turns spaces into ``▁``). The whole text is one BPE
      word, so a cut is safe only where no merge can join its two sides: before a space
      whose left neighbour is not a space (normalized: ``x▁``, x not ``▁``) when no
      piece of the vocabulary holds ``x▁`` (a merge's result is always a piece: the BPE
      model refuses to load otherwise). The piece after the cut is encoded without
      its space: the normalizer prepends the very ``▁`` the space became.
    - ``"keep"``: byte-level BPE (GPT-2, Llama-3, Qwen) whose pre-tokenizer splits words
      by one regex and BPE never crosses a word: cut before a space between two ASCII
      letters, which those regexes always split at (``\\p{L}+`` stops at the space, the
      next word takes it as its prefix); the piece keeps its space.

    Anything else (Metaspace, several splits, a normalizer beyond NFC) is not cut by
    words. Either mode is also checked on ``_WORD_PROBE`` at every cut. Read from the
    tokenizer's parts, not its whole JSON (serializing and parsing 59K merges took
    ~0.1 s of a first request).
    """
    model = tok.model
    if type(model).__name__ != "BPE" or model.dropout:
        return None
    if model.continuing_subword_prefix or model.end_of_word_suffix:
        return None
    norm = None if tok.normalizer is None else orjson.loads(tok.normalizer.__getstate__())
    pre = None if tok.pre_tokenizer is None else orjson.loads(tok.pre_tokenizer.__getstate__())
    mode: str | None = None
    if pre is None and norm is not None and norm.get("normalizers") == _SPM_NORMALIZER:
        # ``ignore_merges`` takes a piece found whole in the vocabulary as one token,
        # which the whole text (not in it) would have merged its own way
        vocab = "\n".join(tok.get_vocab(with_added_tokens=False))
        joins = re.search("[^\u2581\n]\u2581", vocab) is not None
        mode = None if joins or getattr(model, "ignore_merges", False) else "drop"
    elif norm is None or norm.get("type") == "NFC":
        if pre is not None and pre.get("type") == "Sequence":
            parts = pre.get("pretokenizers") or []
            split_ok = (
                len(parts) == 2
                and parts[0].get("type") == "Split"
                and parts[0].get("behavior") == "Isolated"
                and not parts[0].get("invert")
                and "(?<" not in str((parts[0].get("pattern") or {}).get("Regex", "(?<"))
            )
            pre = parts[1] if split_ok else None
        elif pre is not None and not pre.get("use_regex", True):
            pre = None  # ByteLevel alone without its regex: the text is one word
        if (
            pre is not None
            and pre.get("type") == "ByteLevel"
            and not pre.get("add_prefix_space")
        ):  # fmt: skip
            mode = "keep"
    added_tokens = [a for a in tok.get_added_tokens_decoder().values() if a.content]
    for added in added_tokens:
        t = added.content
        if " " in t or "\u2581" in t or added.lstrip or added.rstrip or added.single_word:
            mode = None  # it could match across a cut, or take the space a cut leaves
    if mode is None:
        return None
    cuts = WordCuts(
        mode,
        frozenset(a.content[0] for a in added_tokens),
        frozenset(a.content[-1] for a in added_tokens),
    )
    probe = _WORD_PROBE + "".join(f" {a.content} x {a.content}" for a in added_tokens[:8])
    want = tok.encode(probe, add_special_tokens=False).ids
    pieces = _word_pieces(probe, cuts, 1)  # every cut the rule allows
    got = [i for e in tok.encode_batch_fast(pieces, add_special_tokens=False) for i in e.ids]
    if len(pieces) < 10 or got != want:
        log.info("tokenizer: word cuts (%s) do not split the encoding cleanly; not used", mode)
        return None
    return cuts


def _word_cut(s: str, c: int, cuts: WordCuts) -> bool:
    """Whether ``s`` (a space at ``c``) may be cut before ``c`` (see ``_word_cut_mode``)."""
    if c + 1 >= len(s):
        return False
    left, right = s[c - 1], s[c + 1]
    if left in cuts.lasts or right in cuts.firsts:
        return False
    if cuts.mode == "drop":
        return left != " " and left != "\u2581"
    return left.isascii() and left.isalpha() and right.isascii() and right.isalpha()


def _word_pieces(s: str, cuts: WordCuts, chunk: int = WORD_CHUNK) -> list[str]:
    """``s`` cut at the last allowed space before every ``chunk`` characters, each
    piece as it is encoded (``"drop"``: without its leading space).

    A cut depends only on the text before it (the window up to the next multiple of
    ``chunk`` and the cut before), so two texts that share a prefix share its pieces,
    and the segment cache finds them by content."""
    out: list[str] = []
    start = 0
    end = chunk
    n = len(s)
    while end < n:
        c = s.rfind(" ", start + 1, end - 1)  # the space and its right neighbour < end
        while c > start and not _word_cut(s, c, cuts):
            c = s.rfind(" ", start + 1, c)
        if c > start:
            out.append(s[start:c])
            start = c
        end += chunk
    out.append(s[start:])
    if cuts.mode == "drop":
        return [out[0], *(p[1:] for p in out[1:])]
    return out


def _segments(text: str, cuts: list[str]) -> list[str]:
    """``text`` cut before every occurrence of a token in ``cuts``."""
    starts = set()
    for t in cuts:
        i = text.find(t, 1)
        while i > 0:
            starts.add(i)
            i = text.find(t, i + 1)
    if not starts:
        return [text]
    bounds = [0, *sorted(starts), len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` with its ``tokenizer_config.json`` chat template."""

    name = "hf"

    def __init__(self, path: str | Path, processes: EncodeProcesses | None = None) -> None:
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        self.path = str(file)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # see the module docstring
        self._tok = HFRustTokenizer.from_file(str(file))
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").exists():
            config = orjson.loads((folder / "tokenizer_config.json").read_bytes())
        special = {
            key: _token_text(config.get(key))
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if config.get(key) is not None
        }
        source = _template_source(config.get("chat_template"))
        if source is None and (folder / "chat_template.jinja").exists():
            source = (folder / "chat_template.jinja").read_text()
        self.has_template = source is not None
        self.chat_template = ChatTemplate(source, special) if source else FallbackChat()
        self.cuts = _cut_tokens(self._tok, source or "", special)
        self.cut_bytes = [t.encode() for t in self.cuts]
        # long segments are cut at words too (``_word_pieces``); None: this tokenizer's
        # encoding is not proven to split at a space
        self.word_cuts = _word_cut_mode(self._tok)
        self.segments = SegmentCache()
        self.processes = processes  # where long texts are encoded (None: here)

    def encode(self, text: str, add_special_tokens: bool) -> list[int] | array[int]:
        procs = self.processes
        if procs is not None and len(text) >= procs.min_chars:
            # long: in an encode process, as chat segments are (``_encode_texts``); a
            # completion's ids list built here would hold the GIL (~5 ms at 128K tokens)
            return self._encode_texts([text], add_special_tokens)[0]
        # encode_batch_fast releases the GIL (encode does not), so other requests keep
        # moving, and skips the offsets no one reads: 34 ms instead of 57 for 32K tokens
        return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def chat(self, body: Mapping[str, Any]) -> tuple[TokenIds, str]:
        text = self.chat_template.render(body)
        if body.get("add_special_tokens") or not (self.cuts or self.word_cuts):
            # a post-processor's tokens (BOS, EOS) belong to the whole text, not a segment
            return self.encode(text, bool(body.get("add_special_tokens", False))), text
        return self.encode_segments(text), text

    def encode_segments(self, text: str) -> list[int]:
        """``encode(text, False)`` by segments, each encoded once (see the module
        docstring); the ones not cached go to one ``encode_batch_fast`` call."""
        return self.segment_ids([text])[0].tolist()

    def segment_ids(self, texts: Sequence[str]) -> list[array[int]]:
        """``encode_segments`` of each text as an ``array('I')`` (a 32K-item list costs
        ~1 ms to build, more than the rest of a cached chat's tokenizing). The segments
        of all texts not cached go to one ``encode_batch_fast`` call: each call costs
        ~25 us of set-up, a fifth of a short chat's encoding."""
        parts: list[str] = []
        owner: list[int] = []
        words = self.word_cuts
        for n, text in enumerate(texts):
            for segment in _segments(text, self.cuts):
                if words is None or len(segment) <= WORD_CHUNK:
                    parts.append(segment)
                    owner.append(n)
                    continue
                for part in _word_pieces(segment, words):
                    parts.append(part)
                    owner.append(n)
        keys = [xxh3_128_intdigest(p.encode("utf-8", "surrogatepass")) for p in parts]
        found = self.segments.get_many(keys)
        missing = [i for i, ids in enumerate(found) if ids is None]
        if missing:
            encoded = self._encode_texts([parts[i] for i in missing])
            for i, fresh in zip(missing, encoded, strict=True):
                found[i] = fresh
                self.segments.put(keys[i], fresh)
        out = [array("I") for _ in texts]
        for n, ids in zip(owner, found, strict=True):
            assert ids is not None  # every missing segment was encoded just above
            out[n].extend(ids)
        return out

    def _encode_texts(self, texts: list[str], add_special_tokens: bool = False) -> list[array[int]]:
        """``encode_batch_fast(texts)`` as arrays; long ones in an encode process when
        there is one (``router.tokens.pool.EncodeProcesses``)."""
        procs = self.processes
        if procs is not None and sum(map(len, texts)) >= procs.min_chars:
            ids = procs.encode(self.path, texts, add_special_tokens)
            if ids is not None:
                return ids
        encoded = self._tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [array("I", e.ids) for e in encoded]


def _token_text(value: Any) -> str:
    """tokenizer_config special tokens are strings or AddedToken dicts."""
    return value.get("content", "") if isinstance(value, Mapping) else str(value)


def _template_source(value: Any) -> str | None:
    """``chat_template`` is a string or a list of named templates ("default" wins)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default") or next(iter(named.values()), None)
    return None


class TokenizerSet:
    """One tokenizer per model, loaded once; the fallback where none is configured."""

    def __init__(
        self, path_for: Callable[[str], str | None], processes: EncodeProcesses | None = None
    ) -> None:
        self._path_for = path_for
        self.processes = processes  # given to each HF tokenizer
        self._by_path: dict[str, Tokenizer] = {}
        self._by_model: dict[str, Tokenizer] = {}
        self.fallback = FallbackTokenizer()

    def get(self, model: str) -> Tokenizer:
        tok = self._by_model.get(model)
        if tok is not None:
            return tok
        path = self._path_for(model)
        tok = self.fallback if path is None else self.load(path)
        self._by_model[model] = tok
        return tok

    def load(self, path: str) -> Tokenizer:
        """The tokenizer at ``path``, loaded once. The router loads its default one at
        start (``RouterState.warn_fallbacks``): the models its engines serve are learnt
        later, and the first request of a model nobody named used to pay the load,
        ~130 ms of CPU for Llama's 32K-piece ``tokenizer.json`` (and the wait), inside
        bench/e2e.py's per-request CPU: a fresh router per run of ~100 requests."""
        tok = self._by_path.get(path)
        if tok is None:
            tok = self._by_path[path] = HFTokenizer(path, self.processes)
            if not tok.has_template:
                log.warning("tokenizer %s has no chat template; using the fallback one", path)
        return tok
