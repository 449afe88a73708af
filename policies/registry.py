"""Policies by name: the one place that maps a config string to a policy class.

The built-in policies are listed here; any other is a plugin, found through the
entry-point group ``cache_router.policies`` of the installed packages: a package that
declares ::

    [project.entry-points."cache_router.policies"]
    my_policy = "my_package.module:MyPolicy"

is used with ``--policy my_policy`` (or ``policy = "my_policy"``, an arm's ``policy``)
once it is installed beside the router, with no change to the router. The entry point's
name must be the class's ``name``, and the class a ``policies.base.Policy`` (see its
docstring for the interface, and docs/policies.md). A built-in name cannot be taken over.
"""

from __future__ import annotations

import inspect
import random
from importlib.metadata import entry_points
from typing import Any

from .base import Policy
from .baselines import LeastLoad, PowerOfTwo, RandomPolicy, RoundRobin
from .cache_aware import CacheAware
from .dynamo_kv import DynamoKv
from .session_affinity import SessionAffinity
from .sglang_cache_aware import SGLangCacheAware

ENTRY_POINT_GROUP = "cache_router.policies"

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
POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)  # the built-in ones


def plugin_names() -> tuple[str, ...]:
    """The names installed packages declare in ``cache_router.policies`` (not loaded)."""
    return tuple(sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} - set(_REGISTRY)))


def known_policies() -> tuple[str, ...]:
    """Every name ``make_policy`` takes: the built-in ones, then the plugins'."""
    return POLICY_NAMES + plugin_names()


def _plugin(name: str) -> type[Policy] | None:
    """The plugin class registered under ``name``, loaded once (None: no such plugin)."""
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        return None
    if len(found) > 1:
        where = ", ".join(sorted(ep.value for ep in found))
        raise ValueError(f"policy {name!r} is declared by several installed packages: {where}")
    (ep,) = found
    try:
        cls = ep.load()
    except Exception as exc:  # a broken plugin must say which one, not crash the router
        raise ValueError(f"policy {name!r} ({ep.value}) failed to load: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Policy)) or inspect.isabstract(cls):
        raise ValueError(f"policy {name!r} ({ep.value}) is not a concrete policies.base.Policy")
    if getattr(cls, "name", None) != name:
        raise ValueError(
            f"policy {name!r} ({ep.value}) names itself {getattr(cls, 'name', None)!r}: "
            "the entry point's name and the class's name must be the same"
        )
    return cls


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
        cls = _plugin(name)
        if cls is None:
            known = ", ".join(known_policies())
            raise ValueError(
                f"unknown policy {name!r}; known: {known} (a plugin's package declares it in "
                f"the {ENTRY_POINT_GROUP!r} entry points)"
            )
        _REGISTRY[name] = cls
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
