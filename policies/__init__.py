"""Routing policies behind one small interface (see ``base``), built by name.

Plain synchronous code: a policy sees ``RouteRequest`` and ``WorkerView``s and returns a
``Decision``; it imports only ``index``.

    base                the interface and the plain data it sees
    registry            policy names -> classes, built-in or plugins (entry points)
    selection           helpers every policy shares (healthy candidates, fair minimum)
    cost_model          engine timing constants and the TTFT estimate
    cache_aware         the default: lowest estimated TTFT, with prefetch hints
    baselines           cache-blind: round_robin, random, least_load, power_of_two
    session_affinity    consistent hashing with bounded load (the gateway's)
    sglang_cache_aware  SGLang router's ``cache_aware``, for comparison
    dynamo_kv           Dynamo's KV-router cost, for comparison
    experiments         A/B arms, sticky per session key
"""

from .base import Decision, NoWorkerError, Policy, PrefetchHint, RouteRequest, WorkerView
from .cost_model import EngineCosts
from .registry import (
    POLICY_NAMES,
    known_policies,
    make_policy,
    make_prefill_policy,
    policy_params,
)

__all__ = [
    "POLICY_NAMES",
    "Decision",
    "EngineCosts",
    "NoWorkerError",
    "Policy",
    "PrefetchHint",
    "RouteRequest",
    "WorkerView",
    "known_policies",
    "make_policy",
    "make_prefill_policy",
    "policy_params",
]
