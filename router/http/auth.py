"""Bearer tokens: the one check behind API keys (``/v1/*``), ``/admin/*`` and ``/metrics``."""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence


def bearer_ok(headers: Iterable[tuple[bytes, bytes]], tokens: Sequence[bytes]) -> bool:
    """Whether the request's (first) ``Authorization`` header is ``Bearer <one of tokens>``.

    Reads the raw ASGI header pairs, so a token is compared as the bytes that were sent.
    Every token is compared, each in constant time: no early exit to time.
    """
    for key, value in headers:
        if key == b"authorization":
            scheme, _, given = value.partition(b" ")
            if scheme.lower() != b"bearer":
                return False
            given = given.strip()
            found = False
            for token in tokens:
                found |= hmac.compare_digest(given, token)
            return found
    return False
