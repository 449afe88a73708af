"""A session key for clients that name none: the conversation's opening, hashed.

``cache_aware`` counts a session's request in flight as holding its prefix on its
worker, ``session_affinity`` and the A/B arms stick per session: all need a key. Clients
that send neither ``x-session-id`` nor ``user`` still send their whole history every
turn (the OpenAI and Anthropic APIs are stateless), so every turn of one chat starts
with the same messages: the system (or developer) messages and the first user message.
Their hash, with the model, is the key (``derive_session_key``, on by default).

Two conversations that open alike (one system prompt, the same first question) share a
key. That is harmless for ``cache_aware``: it credits only the blocks both prompts
share; ``session_affinity`` keeps them on one worker within its load bound.
No key is derived for ``/v1/completions`` (a prompt has no turns) nor for a Responses
request that continues ``previous_response_id`` (its input is the new turn alone; the
router pins it to the worker holding that response instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import xxhash

PREFIX = "conv-"  # derived keys are told apart from the clients' own in logs and traces


def opening(messages: Sequence[Any]) -> list[Any] | None:
    """The messages up to and including the first user message (None: there is none)."""
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            return list(messages[: i + 1])
    return None


def derive(model: str, messages: Sequence[Any]) -> str | None:
    """``PREFIX`` + a 64-bit hash of the model and the conversation's opening."""
    head = opening(messages)
    if head is None:
        return None
    try:
        raw = orjson.dumps([model, head], option=orjson.OPT_SORT_KEYS)
    except TypeError:  # orjson.JSONEncodeError: a value it parsed but cannot write back
        return None
    return PREFIX + xxhash.xxh3_64_hexdigest(raw)
