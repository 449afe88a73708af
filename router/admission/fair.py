"""Fair shares counted in tokens, and per-tenant token-rate limits.

Both count prompt and generated tokens, as the engines spend them: a tenant sending few
long prompts takes as much of the pool as one sending many short ones, which a count of
requests would not see (AIBrix and the VTC paper count tokens for that reason).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable


class VirtualCounters:
    """Virtual token counters (Sheng et al., "Fairness in Serving Large Language Models",
    OSDI 2024): a tenant's counter is the tokens served to it divided by its weight, and
    the backlogged tenant with the lowest counter is served next.

    A tenant that becomes backlogged is lifted to the lowest counter among those already
    backlogged: time spent idle banks no credit, so a tenant back from a quiet hour cannot
    take the whole pool until it has "caught up". When nobody is backlogged the counters
    are cleared (``reset``): they only mean something relative to each other during a busy
    period, and clearing bounds their memory to the tenants of one busy period.
    """

    __slots__ = ("_counters", "_weight")

    def __init__(self, weight: Callable[[str], float]) -> None:
        self._weight = weight
        self._counters: dict[str, float] = {}

    def value(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def lift(self, tenant: str, backlogged: Iterable[str]) -> None:
        """``tenant`` joins the backlog: no lower than the lowest counter already in it."""
        floor = min((self.value(t) for t in backlogged if t != tenant), default=None)
        if floor is not None and self.value(tenant) < floor:
            self._counters[tenant] = floor

    def charge(self, tenant: str, tokens: float) -> None:
        """``tokens`` served to ``tenant`` (negative: an estimate taken back)."""
        self._counters[tenant] = self.value(tenant) + tokens / self._weight(tenant)

    def reset(self) -> None:
        self._counters.clear()

    def __len__(self) -> int:
        return len(self._counters)


class TokenBucket:
    """A token-rate limit: ``rate`` tokens a second, at most ``burst`` saved up.

    A request is charged its prompt and its expected answer when admitted, and the
    estimate is settled when it ends (``settle``), so the bucket may go below zero: the
    tenant then waits for what it already spent. A request larger than ``burst`` passes
    when the bucket is full, since it could never pass otherwise.
    """

    __slots__ = ("_at", "_level", "burst", "rate")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if not (rate > 0 and burst > 0):
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate = rate
        self.burst = burst
        self._level = burst
        self._at = now

    def level(self, now: float) -> float:
        if now > self._at:
            self._level = min(self.burst, self._level + (now - self._at) * self.rate)
            self._at = now
        return self._level

    def take(self, tokens: float, now: float) -> float:
        """Charge ``tokens`` if the bucket holds them (0.0); else charge nothing and return
        the seconds until it will."""
        need = min(tokens, self.burst)
        level = self.level(now)
        if level >= need:
            self._level = level - tokens
            return 0.0
        return (need - level) / self.rate

    def settle(self, tokens: float) -> None:
        """Give back (positive) or charge (negative) the difference to an estimate."""
        self._level = min(self.burst, self._level + tokens)


def retry_after(seconds: float) -> int:
    """A ``Retry-After`` value: whole seconds, at least 1, at most a minute (a client told
    to come back in an hour has been told nothing useful)."""
    if not seconds > 0:  # NaN too
        return 1
    return math.ceil(min(seconds, 60.0))
