"""Routing policies behind one small interface (see ``base``), built by name."""

from .base import Decision, NoWorkerError, Policy, PrefetchHint, RouteRequest, WorkerView
from .cost_model import EngineCosts
from .registry import POLICY_NAMES, make_policy, policy_params

__all__ = [
    "POLICY_NAMES",
    "Decision",
    "EngineCosts",
    "NoWorkerError",
    "Policy",
    "PrefetchHint",
    "RouteRequest",
    "WorkerView",
    "make_policy",
    "policy_params",
]
