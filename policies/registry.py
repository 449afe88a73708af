"""Policies by name: the one place that maps a config string to a policy class."""

from __future__ import annotations

import inspect
import random
from typing import Any

from .base import Policy
from .baselines import LeastLoad, PowerOfTwo, RandomPolicy, RoundRobin
from .cache_aware import CacheAware
from .dynamo_kv import DynamoKv
from .session_affinity import SessionAffinity
from .sglang_cache_aware import SGLangCacheAware

_CLASSES: tuple[type[Policy], ...] = (
    RoundRobin,
    RandomPolicy,
    LeastLoad,
    PowerOfTwo,
    SessionAffinity,
    SGLangCacheAware,
    DynamoKv,
    CacheAware,
)
_REGISTRY: dict[str, type[Policy]] = {cls.name: cls for cls in _CLASSES}
POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def policy_params(name: str) -> dict[str, Any]:
    """The tunable parameters of policy ``name`` and their defaults."""
    cls = _lookup(name)
    return {
        p.name: p.default
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def _lookup(name: str) -> type[Policy]:
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    return cls


def make_prefill_policy(name: str, rng: random.Random | None = None, **params: Any) -> Policy:
    """Policy ``name`` for a disaggregated pool's prefill engines: its class's
    ``prefill_params`` in place of its defaults, then ``params`` (ValueError as
    ``make_policy``)."""
    return make_policy(name, rng, **{**_lookup(name).prefill_params, **params})


def make_policy(name: str, rng: random.Random | None = None, **params: Any) -> Policy:
    """Build policy ``name`` with ``params`` (ValueError on an unknown name or parameter)."""
    cls = _lookup(name)
    allowed = policy_params(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        known = ", ".join(allowed) or "none"
        raise ValueError(f"policy {name!r} has no parameter(s) {unknown}; known: {known}")
    return cls(rng, **params)
