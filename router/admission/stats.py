"""What admission counts, per tenant and priority, for ``/metrics`` and ``/admin``.

Tenant names can come from a client's header and priorities from its body, so both are
labels from a bounded set: the first ``MAX_TENANTS`` names (configured tenants first)
and ``MAX_PRIORITIES`` priorities keep their own series, the rest share ``other``. An
attacker cycling names cannot grow the scrape without bound.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_TENANTS = 64
MAX_PRIORITIES = 16
OTHER = "other"
NO_TENANT = ""  # requests naming no tenant share this one (label "none")
# seconds a ticket waited before it was bound
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Labels:
    """Names kept as themselves up to a bound, then ``other``."""

    __slots__ = ("_known", "_max")

    def __init__(self, bound: int, first: Iterable[str] = ()) -> None:
        self._max = bound
        self._known: set[str] = set(first)

    def __call__(self, name: str) -> str:
        if name in self._known:
            return name
        if len(self._known) < self._max:
            self._known.add(name)
            return name
        return OTHER


@dataclass(slots=True)
class Series:
    """One (tenant, priority)'s counts."""

    queued: int = 0  # tickets that waited at the router
    admitted: int = 0  # bound to a worker (at once or after waiting)
    tokens: int = 0  # prompt and generated tokens of those, as settled
    left: int = 0  # their client went away while they waited
    shed: dict[str, int] = field(default_factory=dict)  # by code
    wait_buckets: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))
    wait_sum: float = 0.0


class AdmissionStats:
    __slots__ = ("_priorities", "_tenants", "series")

    def __init__(self, tenants: Iterable[str] = ()) -> None:
        self._tenants = Labels(MAX_TENANTS, [NO_TENANT, *tenants])
        self._priorities = Labels(MAX_PRIORITIES)
        self.series: dict[tuple[str, str], Series] = {}

    def key(self, tenant: str, priority: int) -> tuple[str, str]:
        name = self._tenants(tenant)
        return ("none" if name == NO_TENANT else name), self._priorities(str(priority))

    def _at(self, tenant: str, priority: int) -> Series:
        key = self.key(tenant, priority)
        found = self.series.get(key)
        if found is None:
            found = self.series[key] = Series()
        return found

    def queued(self, tenant: str, priority: int) -> None:
        self._at(tenant, priority).queued += 1

    def left(self, tenant: str, priority: int) -> None:
        self._at(tenant, priority).left += 1

    def shed(self, tenant: str, priority: int, code: str) -> None:
        shed = self._at(tenant, priority).shed
        shed[code] = shed.get(code, 0) + 1

    def admitted(self, tenant: str, priority: int, tokens: int, waited: float) -> None:
        s = self._at(tenant, priority)
        s.admitted += 1
        s.tokens += tokens
        s.wait_buckets[bisect_left(WAIT_BUCKETS, waited)] += 1
        s.wait_sum += waited

    def tokens(self, tenant: str, priority: int, tokens: int) -> None:
        self._at(tenant, priority).tokens += tokens
