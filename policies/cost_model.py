"""Engine timing constants and the per-worker time-to-first-token estimate built on them.

One set of constants serves two users: the ``cache_aware`` policy estimates with them and
the simulator's engines run on them, so the policy is judged against the same physics it
assumes (a policy tuned to a different engine would be tested on a lie).

The defaults describe one Llama-3-8B-class model (fp16 KV, 128 KiB per token) on one
H100-class GPU. They need no tuning per trace: the policy compares workers against each
other, and queue wait and prefill are both charged in prefill-token time, so the choice
depends on token counts, not on how fast the GPU is. Only the tier and network rates
matter in relative terms (loading a block from host memory is ~10x cheaper than
recomputing it, from local disk ~2x, over the network ~4x).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from index.hashing import cacheable_blocks
from index.prefix_index import TierMatch

from .base import MAX_ENGINE_COUNT, WorkerView

_GB = 1e9


@dataclass(frozen=True, slots=True)
class EngineCosts:
    """Timing constants of one engine (milliseconds, tokens, bytes, GB/s)."""

    prefill_ms_per_token: float = 0.05  # linear layers: ~20k prompt tokens/s
    attn_ms_per_token_ctx: float = 2e-6  # attention: per new token, per token of context
    decode_ms_per_step: float = 6.0  # fixed cost of one scheduler step (weights read once)
    decode_ms_per_kv_token: float = 4e-5  # decode attention reads each context token's KV
    max_batch_tokens: int = 8192  # token budget of one step (chunked prefill)
    kv_bytes_per_token: int = 131072
    cpu_load_gbps: float = 25.0  # host memory -> GPU (PCIe)
    disk_load_gbps: float = 5.0  # local NVMe -> GPU
    shared_load_gbps: float = 10.0  # shared pool (network) -> GPU
    prefetch_gbps: float = 10.0  # peer host memory -> target, over the network
    # derived per-token transfer times, filled in __post_init__
    cpu_ms_per_token: float = field(init=False, repr=False)
    disk_ms_per_token: float = field(init=False, repr=False)
    shared_ms_per_token: float = field(init=False, repr=False)
    prefetch_ms_per_token: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.init and not getattr(self, f.name) > 0:
                raise ValueError(f"EngineCosts.{f.name} must be > 0, got {getattr(self, f.name)}")
        ms_at_1gbps = self.kv_bytes_per_token / _GB * 1000.0  # one token at 1 GB/s
        object.__setattr__(self, "cpu_ms_per_token", ms_at_1gbps / self.cpu_load_gbps)
        object.__setattr__(self, "disk_ms_per_token", ms_at_1gbps / self.disk_load_gbps)
        object.__setattr__(self, "shared_ms_per_token", ms_at_1gbps / self.shared_load_gbps)
        object.__setattr__(self, "prefetch_ms_per_token", ms_at_1gbps / self.prefetch_gbps)

    @classmethod
    def from_config(cls, value: EngineCosts | Mapping[str, Any] | None) -> EngineCosts:
        """Accept an ``EngineCosts``, a plain mapping of its fields (TOML/JSON) or None."""
        if value is None:
            return cls()
        if isinstance(value, EngineCosts):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"costs must be EngineCosts or a mapping, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown EngineCosts field(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    # -- engine physics (the simulator runs on these) ------------------------------
    def prefill_ms(self, tokens: float, context: float = 0.0) -> float:
        """Compute time of ``tokens`` new prompt tokens after ``context`` cached ones.

        Attention grows with context: token ``j`` of the chunk attends to
        ``context + j`` tokens, so the chunk pays ``tokens * (context + tokens / 2)``.
        """
        return tokens * (
            self.prefill_ms_per_token + self.attn_ms_per_token_ctx * (context + 0.5 * tokens)
        )

    def step_ms(
        self,
        prefill_tokens: float = 0.0,
        prefill_context: float = 0.0,
        decode_seqs: int = 0,
        decode_kv_tokens: float = 0.0,
    ) -> float:
        """One scheduler step: a prefill chunk plus ``decode_seqs`` decode tokens."""
        return (
            self.decode_ms_per_step
            + self.prefill_ms(prefill_tokens, prefill_context)
            + decode_seqs * self.prefill_ms_per_token
            + decode_kv_tokens * self.decode_ms_per_kv_token
        )

    def load_ms(self, tier: str, tokens: float) -> float:
        """Time to bring ``tokens`` of KV from ``tier`` ("gpu" is free) into GPU memory."""
        if tier == "gpu":
            return 0.0
        if tier == "cpu":
            return tokens * self.cpu_ms_per_token
        if tier == "disk":
            return tokens * self.disk_ms_per_token
        if tier == "shared":
            return tokens * self.shared_ms_per_token
        raise ValueError(f"unknown tier {tier!r}; expected gpu, cpu, disk or shared")

    def prefetch_ms(self, tokens: float) -> float:
        """Time to pull ``tokens`` of KV from a peer's host memory to the target."""
        return tokens * self.prefetch_ms_per_token


# -- estimates per worker --------------------------------------------------------------
# The plain reference of the estimate. ``CacheAware.select`` inlines the same arithmetic
# (function calls would triple its cost) and a property test holds the two equal.


def decode_seqs(view: WorkerView) -> int:
    """Sequences decoding on the worker: the router's count, or the engine's if larger."""
    if view.engine_running is None:
        return view.decode_streams
    prefilling = max(view.inflight_requests - view.decode_streams, 0)
    return max(view.decode_streams, min(view.engine_running, MAX_ENGINE_COUNT) - prefilling)


def computed_tokens(costs: EngineCosts, view: WorkerView, speed: float = 1.0) -> float:
    """Tokens of the oldest prefill running on ``view`` already computed: the time it has
    run at the linear rate (``prefill_ms_per_token``, times the worker's learned
    ``speed``), at most its tokens.

    The linear rate alone, because the queue's attention stays charged in full
    (``queued_attn_ms``, until the prompt's first token): the queue's charge then falls
    by the time the prompt has run, until its linear part is spent. The router and the
    simulator count the running time (``router.load.RunningPrefills``); the policy,
    whose costs these are, turns it into tokens. Measured at each arrival (PD simulator,
    Mooncake synthetic seed 1; BENCHMARKS.md, session 10), the oldest prompt's time
    left so charged is off its true time by 624 ms on the mean (median +25 ms), counted
    whole by 1,837 ms (median +1,034 ms).
    """
    tokens = view.running_prefill_tokens
    if tokens <= 0:
        return 0.0
    done = view.running_prefill_ms / (costs.prefill_ms_per_token * speed)
    return done if done < tokens else float(tokens)


def queue_tokens(view: WorkerView, fallback_tokens: float, computed: float = 0.0) -> float:
    """Prompt tokens ahead of a new request on ``view`` still to compute.

    The router's own in-flight prefill tokens are exact for what it routed; waiting
    requests the engine reports beyond those (another router, direct traffic) are
    charged at the mean size of ours, or at ``fallback_tokens`` when we have none.
    ``computed``: the tokens of them already computed (``computed_tokens``), where the
    policy counts a running prefill by what is left.
    """
    tokens = float(view.inflight_prefill_tokens)
    waiting = view.engine_waiting
    if waiting is not None:
        pending = max(view.inflight_requests - view.decode_streams, 0)
        if waiting > pending:
            per = tokens / pending if pending and tokens else fallback_tokens
            tokens += (min(waiting, MAX_ENGINE_COUNT) - pending) * per
    return tokens - computed


def steps_ms(costs: EngineCosts, tokens: float, decode: int, kv_tokens: float = 0.0) -> float:
    """Fixed step costs while ``tokens`` prefill with ``decode`` sequences decoding.

    Each step carries at most ``max_batch_tokens`` tokens and pays its fixed cost, one
    token per decoding sequence and decode attention over their ``kv_tokens`` of
    context, so decoding neighbours slow a prefill down (on agent traces, with contexts
    of 30-100K tokens, the KV term is the largest part of a step).
    """
    steps = tokens / costs.max_batch_tokens
    return (steps if steps > 1.0 else 1.0) * (
        costs.decode_ms_per_step
        + decode * costs.prefill_ms_per_token
        + kv_tokens * costs.decode_ms_per_kv_token
    )


def queue_wait_ms(
    costs: EngineCosts,
    view: WorkerView,
    fallback_tokens: float,
    kv_tokens: float = 0.0,
    queued_attn_ms: float = 0.0,
    computed: float = 0.0,
) -> float:
    """Expected wait before a new request's prefill starts on ``view``.

    Linear in the queued tokens, plus ``queued_attn_ms``: the attention of the queued
    prompts over their own contexts, known for those the policy routed (charging the
    queue as one long sequence would make attention grow with the square of the queue).
    """
    tokens = queue_tokens(view, fallback_tokens, computed)
    if tokens <= 0:
        return 0.0
    steps = steps_ms(costs, tokens, decode_seqs(view), kv_tokens)
    return tokens * costs.prefill_ms_per_token + queued_attn_ms + steps


def admit_wait_ms(
    costs: EngineCosts, view: WorkerView, fallback_tokens: float, computed: float = 0.0
) -> float:
    """Expected wait before the engine admits a new request (looks up its prefix).

    A chunked-prefill engine admits a waiting request as soon as a step has budget left
    after the prompts ahead of it, i.e. once fewer than ``max_batch_tokens`` of them
    remain; a prefetch must land by then to count. Zero when it fits the next step.
    """
    tokens = queue_tokens(view, fallback_tokens, computed) - costs.max_batch_tokens
    if tokens <= 0:
        return 0.0
    return tokens * costs.prefill_ms_per_token + steps_ms(costs, tokens, decode_seqs(view))


def uncached_tokens(num_tokens: int, hit_blocks: int, block_size: int) -> int:
    """Prompt tokens left to compute. The engine never serves the block holding the
    last prompt token from cache (``index.hashing.cacheable_blocks``): a prompt of
    exactly ``k`` blocks recomputes its whole last block, not one token."""
    cap = cacheable_blocks(num_tokens, block_size)
    left = num_tokens - (hit_blocks if hit_blocks < cap else cap) * block_size
    return left if left > 1 else 1


def prefill_time_ms(
    costs: EngineCosts,
    num_tokens: int,
    hit_blocks: int,
    block_size: int,
    decode: int,
    kv_tokens: float = 0.0,
) -> float:
    """Compute time of the request's uncached tokens, with its hits as attention context."""
    left = uncached_tokens(num_tokens, hit_blocks, block_size)
    return costs.prefill_ms(left, num_tokens - left) + steps_ms(costs, left, decode, kv_tokens)


def load_time_ms(costs: EngineCosts, match: TierMatch, block_size: int) -> float:
    """Time to load the lower-tier part of a (cumulative) tier match into GPU memory."""
    return block_size * (
        (match.cpu - match.gpu) * costs.cpu_ms_per_token
        + (match.disk - match.cpu) * costs.disk_ms_per_token
        + (match.total - match.disk) * costs.shared_ms_per_token
    )


def prefetch_fits(costs: EngineCosts, tokens: float, admit_ms: float, tier: str = "cpu") -> bool:
    """Whether ``tokens`` of KV can reach the target before it admits the request.

    "cpu" pulls from a peer's host memory over the network; "shared" from the pool.
    """
    if tokens <= 0 or admit_ms <= 0:
        return False
    transfer = costs.prefetch_ms(tokens) if tier == "cpu" else costs.load_ms(tier, tokens)
    return transfer <= admit_ms


def estimate_ttft(
    costs: EngineCosts,
    view: WorkerView,
    match: TierMatch,
    num_tokens: int,
    block_size: int,
    kv_tokens: float = 0.0,
    queued_attn_ms: float = 0.0,
    computed: float = 0.0,
) -> tuple[float, float, float]:
    """(queue_ms, prefill_ms, load_ms) of a request on ``view`` without prefetch.

    ``kv_tokens``: context of the requests in flight on the worker (decode attention);
    ``queued_attn_ms``: attention of the prompts queued there (``queue_wait_ms``);
    ``computed``: queued tokens already computed (``computed_tokens``).
    """
    dec = decode_seqs(view)
    return (
        queue_wait_ms(costs, view, num_tokens, kv_tokens, queued_attn_ms, computed),
        prefill_time_ms(costs, num_tokens, match.total, block_size, dec, kv_tokens),
        load_time_ms(costs, match, block_size),
    )


def estimate_ttft_prefetched(
    costs: EngineCosts,
    view: WorkerView,
    match: TierMatch,
    num_tokens: int,
    block_size: int,
    hit_blocks: int,
    moved_blocks: int,
    kv_tokens: float = 0.0,
    queued_attn_ms: float = 0.0,
    computed: float = 0.0,
) -> tuple[float, float, float]:
    """(queue_ms, prefill_ms, load_ms) when ``moved_blocks`` were pulled in while queued.

    The request then hits ``hit_blocks``; the pulled blocks sit in the target's host
    memory (loaded at the cpu rate), its own lower tiers load as before.
    """
    own = TierMatch(match.gpu, match.cpu, match.disk, match.disk)
    load = load_time_ms(costs, own, block_size) + costs.load_ms("cpu", moved_blocks * block_size)
    dec = decode_seqs(view)
    return (
        queue_wait_ms(costs, view, num_tokens, kv_tokens, queued_attn_ms, computed),
        prefill_time_ms(costs, num_tokens, hit_blocks, block_size, dec, kv_tokens),
        load,
    )
