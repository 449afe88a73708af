"""Prompt tokens and generated text for the mock engine.

Prompts are tokenized with the router's own tokenizer classes (``router.tokens.tokenize``), so a
router and a mock engine configured alike produce identical token ids: the fallback
(UTF-8 bytes as little-endian u32, one "token" per 4 bytes, chat rendered with
``FALLBACK_TEMPLATE``) or a Hugging Face ``tokenizer.json`` with its chat template.

Generated text is deterministic per prompt (seeded by its tokens), made of plain words,
and cut into one piece per output token so it can be streamed token by token.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping
from typing import Any

import xxhash
from tokenizers import Tokenizer as HFRustTokenizer

from router.tokens.tokenize import FallbackTokenizer, HFTokenizer, TokenIds, Tokenizer

_WORDS = (
    "the cache holds every block of the prompt so the next turn starts where this one "
    "stopped while other engines wait for their share of the queue and a router picks "
    "one worker by its estimated time to first token"
)


def token_list(tokens: TokenIds) -> list[int]:
    """Token ids as ints (the fallback returns packed little-endian u32 bytes)."""
    if not isinstance(tokens, bytes):
        return list(tokens)
    packed = array("I")
    packed.frombytes(tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


class MockText:
    """Tokenizes requests and makes each request's output text."""

    def __init__(self, tokenizer_path: str | None = None) -> None:
        self.tokenizer: Tokenizer = FallbackTokenizer()
        self._hf: HFRustTokenizer | None = None
        if tokenizer_path:
            hf = self.tokenizer = HFTokenizer(tokenizer_path)
            self._hf = HFRustTokenizer.from_file(hf.path)

    def chat(self, body: Mapping[str, Any]) -> list[int]:
        return token_list(self.tokenizer.chat(body)[0])

    def completion(self, prompt: Any) -> list[int]:
        return token_list(self.tokenizer.completion(prompt)[0])

    def decode(self, tokens: list[int]) -> str:
        """Text of token ids (``/detokenize``); the fallback's ids are 4 UTF-8 bytes each."""
        if self._hf is not None:
            return str(self._hf.decode(tokens, skip_special_tokens=False))
        packed = array("I", tokens)
        if sys.byteorder != "little":
            packed.byteswap()
        return packed.tobytes().rstrip(b"\0").decode("utf-8", "replace")

    def natural_length(self, prompt: list[int]) -> int:
        """How many tokens the "model" wants to say before its end of sequence: 8..64."""
        return 8 + self._seed(prompt) % 57

    def pieces(self, prompt: list[int], n: int) -> list[str]:
        """Exactly ``n`` text pieces, one per output token."""
        if n <= 0:
            return []
        seed = self._seed(prompt)
        vocab = _WORDS.split(" ")
        words: list[str] = []
        chars = 0
        i = 0
        # Either tokenizer gives at most one token per character of ASCII text.
        while chars < 4 * n + 8:
            word = vocab[(seed + i * 7919) % len(vocab)]
            words.append(word)
            chars += len(word) + 1
            i += 1
        text = " ".join(words)
        if self._hf is None:
            return [text[j : j + 4] for j in range(0, 4 * n, 4)]
        starts = [start for start, _ in self._hf.encode(text, add_special_tokens=False).offsets]
        if len(starts) < n:
            raise ValueError("tokenizer produced fewer tokens than characters")
        ends = [*starts[1:], len(text)]
        return [text[starts[j] : ends[j]] for j in range(n)]

    @staticmethod
    def _seed(prompt: list[int]) -> int:
        return xxhash.xxh3_64_intdigest(array("I", prompt).tobytes())
