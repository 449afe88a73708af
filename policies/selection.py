"""Small helpers every policy shares: the healthy candidates and a fair minimum.

Ties are broken uniformly at random, never by list order: the router's worker list has
a stable order, and "first minimum wins" would quietly load worker 0 with every tie.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from .base import NoWorkerError, WorkerView


def healthy(workers: Sequence[WorkerView]) -> list[WorkerView]:
    """The healthy workers; ``NoWorkerError`` when there is none."""
    out = [w for w in workers if w.healthy]
    if not out:
        raise NoWorkerError(f"no healthy worker among {len(workers)} candidate(s)")
    return out


def argmin_random(values: Sequence[Any], rng: random.Random, tol: float = 0.0) -> int:
    """Index of a minimum of ``values``; all within ``tol`` of it are equally likely.

    ``tol`` applies to numbers only; other comparable keys (tuples) tie on equality.
    """
    lo = min(values)
    if tol:
        lo = lo + tol
        ties = [i for i, v in enumerate(values) if v <= lo]
    else:
        ties = [i for i, v in enumerate(values) if v == lo]
    return ties[0] if len(ties) == 1 else ties[rng.randrange(len(ties))]


def load_key(view: WorkerView) -> tuple[int, int]:
    """Least-load order: in-flight requests first, then their pending prefill tokens."""
    return (view.inflight_requests, view.inflight_prefill_tokens)
