"""The mock engine's non-generating endpoints, shaped like vLLM's.

``/v1/embeddings``, ``/v1/score`` (``text_1`` / ``text_2``), ``/v1/rerank`` (``query`` /
``documents``), ``/tokenize`` (a prompt or chat ``messages``) and ``/detokenize``. An
embedding is a deterministic unit vector seeded by the text's tokens, so identical
inputs embed identically and scores are cosine similarities; nothing is learnt.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import xxhash

from router.http.errors import ApiError
from sim.mock.text import MockText

DIM = 32


def _texts(value: Any, name: str) -> list[Any]:
    """A string, a list of strings, token ids, or lists of token ids -> one item each."""
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [value]
        if all(isinstance(v, str) for v in value) or all(
            isinstance(v, list) and all(isinstance(t, int) for t in v) for v in value
        ):
            return list(value)
    raise ApiError(400, f"{name} must be text, token ids or a non-empty list of them",
                   "invalid_value", name)  # fmt: skip


class Pooling:
    """Embeddings, scores and tokenization over the engine's tokenizer."""

    def __init__(self, text: MockText, model: str, max_model_len: int) -> None:
        self.text = text
        self.model = model
        self.max_model_len = max_model_len

    def _check_model(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "invalid_body")
        model = body.get("model")
        if model is not None and model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "model_not_found", "model")
        return body

    def _tokens(self, item: Any) -> list[int]:
        return list(item) if isinstance(item, list) else self.text.completion(item)

    def _embed(self, tokens: list[int]) -> list[float]:
        seed = xxhash.xxh3_64_intdigest(str(tokens).encode())
        raw = [((seed >> (i % 60)) ^ (seed * (i + 1))) % 1000 / 500.0 - 1.0 for i in range(DIM)]
        norm = math.sqrt(sum(x * x for x in raw)) or 1.0
        return [x / norm for x in raw]

    def _envelope(self, prefix: str) -> dict[str, Any]:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": self.model}  # fmt: skip

    def embeddings(self, body: Any) -> dict[str, Any]:
        body = self._check_model(body)
        items = [self._tokens(t) for t in _texts(body.get("input"), "input")]
        data = [
            {"index": i, "object": "embedding", "embedding": self._embed(tokens)}
            for i, tokens in enumerate(items)
        ]
        n = sum(len(t) for t in items)
        use = {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
               "prompt_tokens_details": None}  # fmt: skip
        return {**self._envelope("embd"), "data": data, "usage": use}

    def _similarity(self, a: list[int], b: list[int]) -> float:
        return sum(x * y for x, y in zip(self._embed(a), self._embed(b), strict=True))

    def score(self, body: Any) -> dict[str, Any]:
        body = self._check_model(body)
        left = [self._tokens(t) for t in _texts(body.get("text_1"), "text_1")]
        right = [self._tokens(t) for t in _texts(body.get("text_2"), "text_2")]
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise ApiError(400, "text_1 must be one item or as many as text_2", "invalid_value")
        data = [
            {"index": i, "object": "score", "score": self._similarity(a, b)}
            for i, (a, b) in enumerate(zip(left, right, strict=True))
        ]
        n = sum(len(a) + len(b) for a, b in zip(left, right, strict=True))
        return {**self._envelope("score"), "data": data,
                "usage": {"prompt_tokens": n, "total_tokens": n}}  # fmt: skip

    def rerank(self, body: Any) -> dict[str, Any]:
        body = self._check_model(body)
        (query,) = [self._tokens(t) for t in _texts(body.get("query"), "query")][:1]
        documents = body.get("documents")
        if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
            raise ApiError(400, "documents must be a list of strings", "invalid_value")
        top_n = body.get("top_n") or len(documents)
        scores = [self._similarity(query, self._tokens(d)) for d in documents]
        order = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)
        scored = [
            {"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]}
            for i in order
        ]
        n = len(query) + sum(len(self._tokens(d)) for d in documents)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.model,
                "usage": {"total_tokens": n}, "results": scored[:top_n]}  # fmt: skip

    def tokenize(self, body: Any) -> dict[str, Any]:
        body = self._check_model(body)
        if "messages" in body:
            tokens = self.text.chat(body)
        else:
            tokens = self._tokens(_texts(body.get("prompt"), "prompt")[0])
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens,
                "token_strs": None}  # fmt: skip

    def detokenize(self, body: Any) -> dict[str, Any]:
        body = self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in tokens
        ):
            raise ApiError(400, "tokens must be a list of token ids", "invalid_value", "tokens")
        return {"prompt": self.text.decode(tokens)}
