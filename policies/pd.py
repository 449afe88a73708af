"""Prefill/decode disaggregation: the decode side's policy and the two-sided choice.

The order is llm-d's decode-first rule. The decode engine is chosen first, by decode
load and KV room (``decode_load``), counting its own prefix: the KV connectors pull only
the blocks the decode engine lacks (vLLM's NixlConnector asks for the prompt past its
local prefix hits), so a decode engine holding the conversation receives less. Then the
uncached part of the prompt *on that engine* decides whether a remote prefill pays:
under ``local_prefill_tokens`` the decode engine prefills the suffix itself (a second
request and a KV transfer cost more than a short chunk); otherwise the prefill engine is
chosen by the arm's policy (``cache_aware``: its prefix, queue, tiers, prefetch). With
no usable prefill engine the decode engine prefills locally too: slower, not an error.

Plain synchronous code, like every policy: the router and the simulator build the
``WorkerView``s of each side and act on the ``PdDecision``.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from index.hashing import cacheable_blocks

from .base import (
    MAX_ENGINE_COUNT,
    NO_MATCH,
    Decision,
    NoWorkerError,
    Policy,
    RouteRequest,
    WorkerView,
)
from .cost_model import EngineCosts
from .registry import POLICY_NAMES, make_policy
from .selection import healthy

_MAX_TRACKED = 65_536  # requests remembered at most (finishes never reported are forgotten)


class DecodeLoad(Policy):
    """The decode engine where this request's decoding costs least, per candidate::

        tpot     = step + (streams + 1) * token + (context + prompt) * kv_read
        cost     = transfer_weight * transfer of the blocks it lacks + waiting * step
                 + output * tpot

    ``streams`` are the decode streams there (the router's and the engine's report,
    whichever is larger), ``context`` the KV tokens of the requests this policy sent
    there and that are not finished (decode attention reads all of it every step: on
    long contexts that, not the stream count, sets the TPOT). An engine whose reported
    ``kv_usage`` is ``kv_full`` or more has no room for the prompt's pages and would
    preempt: it is taken only when every engine is that full. Ties (within ``tie_ms``)
    go to the engine holding the most of the prompt, then at random.

    ``transfer_weight`` is what a millisecond of transfer counts against one of decoding;
    the blocks an engine holds shorten its transfer either way (the connector pulls only
    what it lacks). At 1 (the client waits for both alike) the rule kept requests on the
    engines holding their prefix at the price of TPOT; the default 0 leaves the held
    prefix to break ties only (among engines within ``tie_ms``, the one holding the most
    of the prompt). PD simulator, 4 + 4 engines (BENCHMARKS.md, session 7): this default
    against weight 1 on Mooncake synthetic seed 1 gave TPOT p90 7.921 against 8.001 ms
    (Dynamo's rule 7.925), the same TTFT p90 (5,975 ms); on the agent trace (seed 0) TPOT
    p90 10.17 against 10.48 ms, TTFT p90 1,004 against 958 ms (SGLang's rule 1,037);
    weight 0.5 kept synthetic's TPOT p90 at 7.98. TTFT p90 is set by the prefill queue
    (seconds on the Mooncake traces), which the transfer adds little to. A pool with
    ``pd_local_prefill_tokens`` wants the holder more (there it saves the whole remote
    prefill, not only the transfer): an arm's ``decode_params`` can set the weight.

    ``context`` counts a request from its choice, which comes before its prefill: on the
    Mooncake synthetic trace 80 % of it is requests still queued for a prefill engine.
    That is the forecast, not an error: counting only requests whose KV had landed raised
    TPOT p90 from 7.93 to 8.21 ms (seeds 0 and 1 alike), since they land while this one
    decodes.
    """

    name = "decode_load"

    def __init__(
        self,
        rng: random.Random | None = None,
        *,
        costs: EngineCosts | Mapping[str, Any] | None = None,
        kv_full: float = 0.95,
        default_output_tokens: int = 256,
        tie_ms: float = 0.25,
        transfer_weight: float = 0.0,
    ) -> None:
        super().__init__(rng)
        if not transfer_weight >= 0:
            raise ValueError(f"decode_load: transfer_weight must be >= 0, got {transfer_weight}")
        if not 0 < kv_full <= 1:
            raise ValueError(f"decode_load: kv_full must be in (0, 1], got {kv_full}")
        if not default_output_tokens >= 1:
            raise ValueError("decode_load: default_output_tokens must be >= 1")
        if not tie_ms >= 0:
            raise ValueError(f"decode_load: tie_ms must be >= 0, got {tie_ms}")
        self.costs = EngineCosts.from_config(costs)
        self.kv_full = kv_full
        self.default_output_tokens = default_output_tokens
        self.tie_ms = tie_ms
        self.transfer_weight = transfer_weight
        self._active: dict[str, int] = {}
        self._routed: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def select(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        cands = healthy(workers)
        roomy = [w for w in cands if not (w.kv_usage is not None and w.kv_usage >= self.kv_full)]
        cands = roomy or cands
        c = self.costs
        bs = request.block_size
        ntok = request.num_tokens
        cacheable = cacheable_blocks(ntok, bs)
        out = request.max_tokens if isinstance(request.max_tokens, int) else 0
        out = min(out, 1 << 20) if out > 0 else self.default_output_tokens
        costs: list[float] = []
        hits: list[int] = []
        scores: dict[str, dict[str, float]] = {}
        # a retry of a request already counted somewhere must not count itself
        own_worker, own_tokens = self._routed.get(request.request_id, ("", 0))
        for w in cands:
            m = w.match if w.in_sync else NO_MATCH
            hit = min(m.total, cacheable)
            pending = max(0, w.inflight_requests - w.decode_streams)
            streams = w.decode_streams + pending
            if w.engine_running is not None:
                streams = max(streams, min(w.engine_running, MAX_ENGINE_COUNT))
            context = self._active.get(w.worker_id, 0)
            if w.worker_id == own_worker:
                context -= own_tokens
            tpot = (
                c.decode_ms_per_step
                + (streams + 1) * c.prefill_ms_per_token
                + (context + ntok) * c.decode_ms_per_kv_token
            )
            transfer = c.prefetch_ms(max(0, ntok - hit * bs))
            waiting = min(w.engine_waiting or 0, MAX_ENGINE_COUNT) * c.decode_ms_per_step
            cost = self.transfer_weight * transfer + waiting + out * tpot
            costs.append(cost)
            hits.append(hit)
            scores[w.worker_id] = {
                "cost_ms": cost,
                "tpot_ms": tpot,
                "transfer_ms": transfer,
                "wait_ms": waiting,
                "hit_blocks": hit,
                "streams": streams,
                "context_tokens": context,
            }
        lo = min(costs) + self.tie_ms
        ties = [i for i, cost in enumerate(costs) if cost <= lo]
        most = max(hits[i] for i in ties)  # among equals, where the fewest blocks move
        ties = [i for i in ties if hits[i] == most]
        i = ties[0] if len(ties) == 1 else ties[self.rng.randrange(len(ties))]
        chosen = cands[i].worker_id
        self._track(request.request_id, chosen, ntok + out)
        reason = f"min decode cost: tpot {scores[chosen]['tpot_ms']:.1f} ms"
        return Decision(chosen, scores=scores, reason=reason)

    def on_finish(self, request: RouteRequest, worker_id: str) -> None:
        routed = self._routed.pop(request.request_id, None)
        if routed is not None:
            self._release(*routed)

    def _track(self, request_id: str, worker_id: str, tokens: int) -> None:
        old = self._routed.pop(request_id, None)
        if old is not None:  # the same id routed again (a retry): count it once
            self._release(*old)
        self._routed[request_id] = (worker_id, tokens)
        self._active[worker_id] = self._active.get(worker_id, 0) + tokens
        if len(self._routed) > _MAX_TRACKED:
            self._release(*self._routed.popitem(last=False)[1])

    def _release(self, worker_id: str, tokens: int) -> None:
        left = self._active.get(worker_id, 0) - tokens
        if left > 0:
            self._active[worker_id] = left
        else:
            self._active.pop(worker_id, None)


# The decode side takes ``decode_load`` or any pool policy (the baselines compared with it).
DECODE_POLICIES: tuple[str, ...] = (DecodeLoad.name, *POLICY_NAMES)


def make_decode_policy(name: str, rng: random.Random | None = None, **params: Any) -> Policy:
    """The decode side's policy ``name`` (ValueError on an unknown name or parameter)."""
    if name == DecodeLoad.name:
        try:
            return DecodeLoad(rng, **params)
        except TypeError as exc:
            raise ValueError(f"policy {name!r}: {exc}") from None
    return make_policy(name, rng, **params)


@dataclass(slots=True)
class PdDecision:
    """Both sides of one disaggregated request; ``prefill`` None: decode prefills itself."""

    decode: Decision
    prefill: Decision | None
    uncached_on_decode: int  # prompt tokens the decode engine does not hold
    reason: str


def choose(
    request: RouteRequest,
    prefill_views: Sequence[WorkerView],
    decode_views: Sequence[WorkerView],
    prefill_policy: Policy,
    decode_policy: Policy,
    local_prefill_tokens: int = 0,
) -> PdDecision:
    """Decode first, then a remote prefill unless the decode engine's uncached suffix is
    under ``local_prefill_tokens`` or no prefill engine is usable (see the module doc).
    ``NoWorkerError`` when no decode engine is usable."""
    decode = decode_policy.select(request, decode_views)
    bs = request.block_size
    view = next(v for v in decode_views if v.worker_id == decode.worker_id)
    held = min(view.match.total if view.in_sync else 0, cacheable_blocks(request.num_tokens, bs))
    uncached = max(0, request.num_tokens - held * bs)
    if uncached < local_prefill_tokens:
        reason = f"local prefill: {uncached} uncached tokens < {local_prefill_tokens}"
        return PdDecision(decode, None, uncached, reason)
    try:
        prefill = prefill_policy.select(request, prefill_views)
    except NoWorkerError:
        return PdDecision(decode, None, uncached, "local prefill: no usable prefill engine")
    return PdDecision(decode, prefill, uncached, "remote prefill")
