"""A/B experiments: arms (policy + parameters + weight), sticky per session key.

A session must stay on one arm, or its cache hits and TTFT would be credited to a mix of
policies. The arm is a pure function of the key (xxh3 of salt + key mapped onto the
cumulative weights), so every router replica and every restart agrees without sharing
state. Requests without a session key get a weighted random arm.

In a disaggregated pool an arm acts on each side: ``policy`` picks the prefill engine
(and the engine of a mixed pool), ``decode_policy`` (when the arm names one; else the
router's ``decode_policy``) the decode engine. An arm that varies one side keeps the
other fixed, so the comparison credits the side it changes. The prefill side has its
own instance of ``policy``: the class's ``prefill_params`` in place of its defaults,
then the arm's ``params``, then its ``prefill_params`` (a prefill pool's costs are not
a mixed pool's: ``policies.cache_aware``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .base import Policy
from .pd import make_decode_policy
from .registry import make_policy, make_prefill_policy

_TWO64 = float(2**64)


@dataclass(frozen=True, slots=True)
class Arm:
    """One arm: ``policy`` built with ``params``, chosen with relative ``weight``; in a
    disaggregated pool ``decode_policy`` with ``decode_params`` on the decode side
    (None: the router's own) and ``policy`` with ``prefill_params`` over ``params`` on
    the prefill side."""

    name: str
    policy: str
    params: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    decode_policy: str | None = None
    decode_params: Mapping[str, Any] = field(default_factory=dict)
    prefill_params: Mapping[str, Any] = field(default_factory=dict)


_ARM_KEYS = frozenset(
    {"name", "policy", "weight", "params", "decode_policy", "decode_params", "prefill_params"}
)


def parse_arm(raw: object, where: str) -> Arm:
    """An arm from a plain table ``{"name", "policy", "weight" (1.0), "params" ({})}``, as
    the router's TOML ``[[arms]]`` and ``Experiment.from_config`` give it; ValueError
    naming ``where`` and the key otherwise."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a table/dict, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _ARM_KEYS)
    missing = sorted({"name", "policy"} - {k for k in raw if raw[k]})
    if unknown or missing:
        raise ValueError(
            f"{where}: an arm needs name and policy: unknown key(s) {unknown}, missing "
            f"key(s) {missing}; expected name, policy, weight, params, decode_policy, "
            "decode_params, prefill_params"
        )
    params = raw.get("params") or {}
    prefill_params = raw.get("prefill_params") or {}
    if not isinstance(params, Mapping) or not isinstance(prefill_params, Mapping):
        raise ValueError(f"{where} {raw['name']!r}: params and prefill_params must be tables/dicts")
    decode = raw.get("decode_policy")
    decode_params = raw.get("decode_params") or {}
    if decode is not None and not (isinstance(decode, str) and decode):
        raise ValueError(f"{where} {raw['name']!r}: decode_policy must be a policy name")
    if not isinstance(decode_params, Mapping):
        raise ValueError(f"{where} {raw['name']!r}: decode_params must be a table/dict")
    if decode_params and decode is None:
        raise ValueError(f"{where} {raw['name']!r}: decode_params without decode_policy")
    try:
        weight = float(raw.get("weight", 1.0))
    except (TypeError, ValueError):
        raise ValueError(f"{where} {raw['name']!r}: weight must be a number") from None
    if not weight > 0:
        raise ValueError(f"{where} {raw['name']!r}: weight must be > 0, got {weight}")
    return Arm(
        str(raw["name"]),
        str(raw["policy"]),
        dict(params),
        weight,
        decode,
        dict(decode_params),
        dict(prefill_params),
    )


class Experiment:
    """Assigns requests to arms and owns one policy instance per arm."""

    def __init__(
        self, arms: Sequence[Arm], rng: random.Random | None = None, *, salt: str = ""
    ) -> None:
        if not arms:
            raise ValueError("an experiment needs at least one arm")
        names = [a.name for a in arms]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate arm name(s) {dupes}")
        for a in arms:
            if not a.weight > 0:
                raise ValueError(f"arm {a.name!r}: weight must be > 0, got {a.weight}")
        self.arms: tuple[Arm, ...] = tuple(arms)
        self.rng = rng or random.Random()
        self.salt = salt.encode() + b"\x00" if salt else b""
        total = sum(a.weight for a in arms)
        acc = 0.0
        self._bounds: list[float] = []
        for a in arms:
            acc += a.weight / total
            self._bounds.append(acc)
        self._bounds[-1] = 1.0  # float sums must not leave a gap at the top
        # built now, so a bad policy name or parameter fails at config load, not mid-traffic
        self._policies: dict[str, Policy] = {
            a.name: make_policy(a.policy, random.Random(self.rng.getrandbits(64)), **a.params)
            for a in arms
        }
        self._decode: dict[str, Policy] = {
            a.name: make_decode_policy(
                a.decode_policy, random.Random(self.rng.getrandbits(64)), **a.decode_params
            )
            for a in arms
            if a.decode_policy is not None
        }
        self._prefill: dict[str, Policy] = {
            a.name: make_prefill_policy(
                a.policy,
                random.Random(self.rng.getrandbits(64)),
                **{**a.params, **a.prefill_params},
            )
            for a in arms
        }

    @classmethod
    def from_config(
        cls,
        arms: Iterable[Mapping[str, Any]],
        rng: random.Random | None = None,
        *,
        salt: str = "",
    ) -> Experiment:
        """Arms from plain dicts (see ``parse_arm``)."""
        return cls([parse_arm(raw, f"arm #{i}") for i, raw in enumerate(arms)], rng, salt=salt)

    def assign(self, session_key: str | None) -> Arm:
        """The arm for a request: fixed per session key, weighted random without one."""
        if session_key is None:
            u = self.rng.random()
        else:
            u = xxhash.xxh3_64_intdigest(self.salt + session_key.encode()) / _TWO64
        for arm, bound in zip(self.arms, self._bounds, strict=True):
            if u < bound:
                return arm
        return self.arms[-1]

    def policy_for(self, arm: Arm | str) -> Policy:
        """The policy instance of ``arm`` (one per arm, kept for the experiment's life)."""
        return self._policies[self._name(arm)]

    def prefill_policy_for(self, arm: Arm | str) -> Policy:
        """The instance of ``arm``'s policy that picks prefill engines (see the module doc)."""
        return self._prefill[self._name(arm)]

    def decode_policy_for(self, arm: Arm | str) -> Policy | None:
        """The decode-side policy instance of ``arm``; None when it names none."""
        return self._decode.get(self._name(arm))

    @property
    def sends_hints(self) -> bool:
        """Whether any arm's policy may give a prefetch hint that is sent: a mixed pool's
        or a prefill pool's (router/pd/exchange.py sends no decode-side hint)."""
        sides = (self._policies, self._prefill)
        return any(p.sends_hints for side in sides for p in side.values())

    def _name(self, arm: Arm | str) -> str:
        """``arm``'s name; ValueError when this experiment has no arm of that name."""
        name = arm if isinstance(arm, str) else arm.name
        if name not in self._policies:
            raise ValueError(f"no arm named {name!r} in this experiment")
        return name
