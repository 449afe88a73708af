"""The one interface every routing policy implements, and the plain data it sees.

A policy is synchronous, deterministic given its ``random.Random`` and does no I/O: the
router and the simulator build ``WorkerView``s from the index and their load trackers,
call ``select`` and act on the ``Decision``.

The interface, for a policy of one's own (docs/policies.md; an installed package makes it
available by name through the ``cache_router.policies`` entry points, ``policies.registry``):

- ``name``: the class attribute ``--policy`` / ``policy = ...`` / an arm's ``policy`` takes.
- ``__init__(self, rng=None, *, param=default, ...)``: its tunable parameters, keyword-only
  with defaults; ``policy_params`` (and an arm's ``params``) set them by name, and an
  unknown one is refused at start. Call ``super().__init__(rng)``; draw randomness only
  from ``self.rng``, so a seeded run (the simulator's) is repeatable.
- ``select(request, workers) -> Decision``: one call per request on the event loop, so it
  must be quick (``cache_aware``'s is ~1.3-1.5 us a candidate, BENCHMARKS.md) and must
  not block. ``workers`` are the candidates serving the request's model; skip unhealthy ones,
  raise ``NoWorkerError`` when none is left (the client gets a 503). The ``Decision``
  names one ``worker_id`` of ``workers``, optionally a ``PrefetchHint`` (then override
  ``sends_hints``), per-worker ``scores`` (``/admin/explain`` shows them; ``hit_blocks``
  there is counted as the expected cache hit) and a ``reason``.
- ``on_first_token`` / ``on_finish``: optional feedback, for a policy that learns.
- ``prefill_params``: optional, the parameters it takes on a disaggregated pool's
  prefill engines.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from index.prefix_index import TierMatch

NO_MATCH = TierMatch(0, 0, 0, 0)
# Engine-reported running/waiting counts are bounded by this (the router refuses larger
# reports, and policies clamp to it): no engine queues a million requests, and the bound
# keeps every estimate's float arithmetic finite.
MAX_ENGINE_COUNT = 1 << 20


@dataclass(slots=True)
class RouteRequest:
    """What a policy knows of one request."""

    request_id: str
    model: str
    num_tokens: int  # prompt tokens
    block_hashes: list[int]  # router rolling hashes of the prompt's full blocks
    block_size: int
    session_key: str | None = None
    max_tokens: int | None = None


@dataclass(slots=True)
class WorkerView:
    """One candidate worker as the policy sees it at decision time."""

    worker_id: str
    match: TierMatch = NO_MATCH  # leading blocks of the request held, per tier
    inflight_requests: int = 0  # routed by this router (and its peers), not finished
    inflight_prefill_tokens: int = 0  # uncached prompt tokens not yet past first token
    decode_streams: int = 0  # requests past first token, still generating
    engine_running: int | None = None  # engine-reported, when known
    engine_waiting: int | None = None
    kv_usage: float | None = None  # engine-reported KV cache usage, 0..1
    healthy: bool = True
    in_sync: bool = True  # False while the index may be stale for this worker
    # the oldest of this router's prefills on the worker (part of inflight_prefill_tokens)
    # and how long it has been computing: the policy discounts what is already done
    running_prefill_tokens: int = 0
    running_prefill_ms: float = 0.0
    # the engine's KV cache in blocks (pages), GPU and host memory, when known: how much
    # of what is routed there it keeps without computing it again (None: unknown, the
    # policy assumes room)
    capacity_blocks: int | None = None

    @classmethod
    def of(
        cls,
        worker_id: str,
        match: TierMatch,
        in_sync: bool,
        inflight_requests: int,
        inflight_prefill_tokens: int,
        decode_streams: int,
        engine_running: int | None,
        engine_waiting: int | None,
        kv_usage: float | None,
        running_prefill: tuple[int, float] = (0, 0.0),
        capacity_blocks: int | None = None,
    ) -> WorkerView:
        """The view the simulators build, and the router too, inlined (``Router.views``:
        a frame less per candidate): a worker whose events are out of sync shows no
        match, since its index rows may name blocks it no longer holds."""
        # positional: this runs for every candidate of every request
        match = match if in_sync else NO_MATCH
        return cls(
            worker_id, match, inflight_requests, inflight_prefill_tokens, decode_streams,
            engine_running, engine_waiting, kv_usage, True, in_sync, *running_prefill,
            capacity_blocks,
        )  # fmt: skip


# Where a prefetch target loads blocks from: the source's host memory over the network,
# or the shared pool.
HintTier = Literal["cpu", "shared"]


@dataclass(slots=True)
class PrefetchHint:
    """Ask ``target_worker`` to pull the request's first ``blocks`` blocks early."""

    source_worker: str | None  # who holds them (None: the shared pool)
    target_worker: str
    blocks: int
    tier: HintTier
    deadline_ms: float  # when the target's prefill is expected to start


@dataclass(slots=True)
class Decision:
    worker_id: str
    prefetch: PrefetchHint | None = None
    # per worker, the numbers behind the choice (e.g. {"ttft_ms": .., "hit_blocks": ..})
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    reason: str = ""


class NoWorkerError(RuntimeError):
    """No healthy candidate: the router answers 503."""


class Policy(ABC):
    """Chooses a worker for a request. Subclasses set ``name`` and implement ``select``."""

    name: ClassVar[str]
    # What the policy takes in place of its defaults on the prefill engines of a
    # disaggregated pool (``registry.make_prefill_policy``): a prefill pool computes
    # prompts only, so what a queued token and a recomputed one cost there differ.
    prefill_params: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    @property
    def sends_hints(self) -> bool:
        """Whether ``select`` may give a prefetch hint: the router keeps the engines' own
        block names, which only hints read, when some policy does (router/http/app.py)."""
        return False

    def prunable(self, request: RouteRequest) -> bool:
        """Whether ``select`` may see, in a wide pool, only the candidates that can win
        (router/routing/prune.py): true only where each candidate's cost depends on its
        own view and the policy's state, not on the other candidates. False (a plugin's
        default): every candidate."""
        return False

    def weighs_hits(self, request: RouteRequest) -> bool:
        """Whether ``select`` reads the candidates' matches. False (``least_load``): in a
        wide pool the router walks the index for none of them (router/routing/prune.py),
        the views show ``NO_MATCH``, and it looks up the chosen target's alone (its
        predicted hit). True (the default): every candidate's match."""
        return True

    def must_see(self, request: RouteRequest) -> Collection[str]:
        """Candidates a pruned list must keep whatever their load: those the policy's
        own state favours (a session's request in flight there, say)."""
        return ()

    @abstractmethod
    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        """Pick one of ``workers`` (healthy ones only); raise ``NoWorkerError`` if none."""

    def on_first_token(self, request: RouteRequest, worker_id: str, ttft_ms: float) -> None:  # noqa: B027
        """Called with the request's observed time to first token on ``worker_id`` (only
        where one is seen: a streamed answer; policies may learn engine speed from it)."""

    def on_finish(self, request: RouteRequest, worker_id: str) -> None:  # noqa: B027
        """Called once the request is done (stateful policies may release state)."""


def expected_hit_blocks(decision: Decision, chosen: WorkerView) -> int:
    """Leading blocks the chosen worker is expected to serve from cache: the policy's own
    estimate where it gives one (``scores[...]["hit_blocks"]``: it may know of blocks the
    index does not show yet, such as those a request still queued there will compute),
    else the index's match. The router counts the rest as in-flight prefill."""
    score = decision.scores.get(chosen.worker_id)
    hit = score.get("hit_blocks") if score else None
    own = chosen.match.total
    return int(hit) if hit is not None and hit > own else own


def prefix_depth(n: int, held: Callable[[int], bool]) -> int:
    """The largest ``d <= n`` with ``held(d - 1)`` true, for a ``held`` that is true up to
    some depth and false after (block hashes chain their parents, so what holds block i
    holds every block before it): a binary search over depth."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if held(mid - 1):
            lo = mid
        else:
            hi = mid - 1
    return lo
