"""Online LRU reuse (stack) distances of a block stream: the hit rate of every cache size.

LRU is a stack algorithm: a cache of ``C`` blocks holds exactly the ``C`` most recently
used ones. So one pass that records, for each block a request reuses, how many distinct
blocks were used since that block's previous use (its stack depth), gives the hit rate
of every capacity at once: a reuse at depth ``d`` hits in every cache of more than ``d``
blocks (Mattson et al., 1970).

The order within a request follows the engines: a hit is decided at admission, against
the cache as it was before the request, and a finished request's blocks are freed tail
first (vLLM's free queue, ``sim.cache.PrefixCache.release``), so the prompt's first
block ends most recent. Every request that uses a block uses its whole prefix (the
hashes chain), so a block's ancestors are always more recent than the block: whenever a
block is cached its prefix is cached too, and a reuse at depth ``d`` is a *leading*
(usable) hit in every cache of more than ``d`` blocks, with no need to look at the
blocks before it. That is what lets blocks be sampled one by one.

Sampling is SHARDS (Waldspurger et al., FAST'15): only blocks whose hash falls under a
threshold are tracked (rate ``R`` = threshold / 2**64; block hashes are xxh3 outputs,
uniform already); a depth of ``d`` tracked blocks estimates ``d / R`` blocks, and each
tracked reuse stands for ``1 / R``. Fixed size: when more than ``max_tracked`` blocks are
tracked, the threshold drops to the largest tracked hash and that block leaves
(SHARDS-adj), so memory and the cost of a request stay bounded whatever the traffic.
Tracked blocks deeper than ``horizon`` blocks are dropped (their next reuse counts as a
miss at every size up to the horizon), so a long-running stream keeps its rate.

Spatial sampling alone misses the heaviest hitters: on Mooncake's conversation trace one
512-token system prompt (8 blocks of 64) is in all 12,031 prompts, 11 % of all hits, and
at a 1 % rate it is usually not sampled at all (the curve came out 4 points low). Those
blocks are always recent, so a small *hot set* (the blocks of the last ``hot_blocks``
distinct uses, kept exactly) counts every reuse shallower than that without sampling;
SHARDS covers the deeper ones. With 4,096 tracked blocks and a 1,024-block hot set the
curve is within 0.4 points of the exact one at every size from 4K to 2M blocks on that
trace (0.3 % rate, 80 us a request). Once sampling, the curve is only defined from
``hot_blocks`` up; before (every block tracked) it is exact at every size.

Plain synchronous code, no clock, no I/O. ``sortedcontainers`` gives the O(log n)
order statistics: the depth of a block is the number of tracked blocks whose last use
is later than its own.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from itertools import accumulate

from sortedcontainers import SortedDict

_FULL = 1 << 64

# Histogram of the capacity a hit needs: exact up to 64 blocks, then 32 buckets per
# doubling (3 % wide), up to 2**47 blocks. A curve read between two bucket edges is
# interpolated; at 3 % of the capacity the hit rate moves far less than a point.
_SUB = 32
_EXACT = 2 * _SUB
_MAX_BITS = 47
NUM_BUCKETS = _EXACT + (_MAX_BITS - 6) * _SUB
MAX_CAPACITY = (1 << _MAX_BITS) - 1


def bucket_of(need: int) -> int:
    """The histogram bucket of a hit that needs ``need`` (>= 1) blocks of cache."""
    if need < _EXACT:
        return need
    if need > MAX_CAPACITY:
        need = MAX_CAPACITY
    b = need.bit_length() - 1
    return _EXACT + (b - 6) * _SUB + (need >> (b - 5)) - _SUB


def bucket_range(j: int) -> tuple[int, int]:
    """Capacities ``[low, high)`` that bucket ``j`` holds."""
    if j < _EXACT:
        return j, j + 1
    b, q = divmod(j - _EXACT, _SUB)
    shift = b + 1
    return (_SUB + q) << shift, (_SUB + q + 1) << shift


class ReuseCurve:
    """Token-weighted histogram of the cache size (blocks) each reused block needs.

    ``hit_rate(C)`` is the share of prompt tokens an LRU cache of ``C`` blocks serves
    from cache. ``tokens`` counts every prompt token seen (the denominator, exact).
    """

    __slots__ = ("buckets", "requests", "tokens")

    def __init__(self) -> None:
        self.buckets = [0.0] * NUM_BUCKETS
        self.tokens = 0
        self.requests = 0

    def add(self, need: int, weight: float) -> None:
        self.buckets[bucket_of(need)] += weight

    def merge(self, other: ReuseCurve) -> None:
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets, strict=True)]
        self.tokens += other.tokens
        self.requests += other.requests

    def ceiling(self) -> float:
        """The hit rate of an unbounded cache: only first uses miss."""
        return min(1.0, sum(self.buckets) / self.tokens) if self.tokens else 0.0

    def max_need(self) -> int:
        """The largest capacity any recorded hit needs (0: no hit yet)."""
        for j in range(NUM_BUCKETS - 1, -1, -1):
            if self.buckets[j]:
                return bucket_range(j)[1] - 1
        return 0

    def hit_rates(self, capacities: Iterable[int]) -> list[float]:
        """The hit rate at each capacity (blocks), read off one cumulative pass."""
        caps = list(capacities)
        if not self.tokens:
            return [0.0] * len(caps)
        cum = list(accumulate(self.buckets, initial=0.0))  # cum[j]: weight below bucket j
        out = []
        for c in caps:
            if c < 1:
                out.append(0.0)
                continue
            j = bucket_of(c)
            low, high = bucket_range(j)
            inside = min(c, high - 1) - low + 1  # capacities of bucket j that c covers
            w = cum[j] + self.buckets[j] * inside / (high - low)
            out.append(min(1.0, w / self.tokens))
        return out

    def hit_rate(self, capacity: int) -> float:
        return self.hit_rates((capacity,))[0]

    def capacity_for(self, hit_rate: float) -> int | None:
        """The smallest capacity whose hit rate reaches ``hit_rate`` (None: none does)."""
        if not self.tokens or hit_rate > self.ceiling():
            return None
        if hit_rate <= 0:
            return 0
        goal = hit_rate * self.tokens * (1 - 1e-12)  # rounding must not push it a bucket on
        acc = 0.0
        for j, w in enumerate(self.buckets):
            if w and acc + w >= goal:
                low, high = bucket_range(j)
                # the bucket's weight is spread evenly over its capacities
                return min(high - 1, max(low, low - 1 + math.ceil((goal - acc) * (high - low) / w)))
            acc += w
        return self.max_need()


def doublings(start: int, stop: int) -> list[int]:
    """``start, 2*start, ...`` up to the first value >= ``stop``."""
    out = [max(1, start)]
    while out[-1] < stop:
        out.append(out[-1] * 2)
    return out


def saturation(capacities: Sequence[int], rates: Sequence[float], gain: float = 0.01) -> int:
    """The first capacity from which every further doubling adds less than ``gain``.

    ``capacities`` double from one to the next; the last one is taken as saturated.
    """
    point = capacities[-1]
    for i in range(len(capacities) - 2, -1, -1):
        if rates[i + 1] - rates[i] >= gain:
            break
        point = capacities[i]
    return point


def check_sampling(max_tracked: int, rate: float, horizon: int | None, hot_blocks: int) -> None:
    """``ValueError`` for sampling settings no stack distance (Python or native) takes."""
    if max_tracked < 1:
        raise ValueError(f"max_tracked must be >= 1, got {max_tracked}")
    if not 0 < rate <= 1:
        raise ValueError(f"rate must be in (0, 1], got {rate}")
    if horizon is not None and horizon < 1:
        raise ValueError(f"horizon must be >= 1 block, got {horizon}")
    if hot_blocks < 0:
        raise ValueError(f"hot_blocks must be >= 0, got {hot_blocks}")


class StackDistance:
    """SHARDS-sampled LRU stack distances of one stream of requests' block hashes."""

    __slots__ = (
        "_by_time",
        "_clock",
        "_heap",
        "_hot",
        "_hot_bucket",
        "_hot_prev",
        "_last",
        "accesses",
        "curve",
        "horizon",
        "hot_blocks",
        "max_tracked",
        "sampled",
        "threshold",
    )

    def __init__(
        self,
        *,
        max_tracked: int = 1 << 15,
        rate: float = 1.0,
        horizon: int | None = None,
        hot_blocks: int = 0,
    ) -> None:
        check_sampling(max_tracked, rate, horizon, hot_blocks)
        self.max_tracked = max_tracked
        self.hot_blocks = hot_blocks
        self._hot: dict[int, None] = {}  # the hot set's current generation
        self._hot_prev: dict[int, None] = {}  # and the previous one
        self._hot_bucket = bucket_of(max(1, hot_blocks - 1))  # full at capacity hot_blocks
        self.horizon = horizon
        self.threshold = min(_FULL, int(rate * _FULL))
        self._last: dict[int, int] = {}  # tracked hash -> time of its last use
        self._by_time: SortedDict = SortedDict()  # time -> hash, oldest first
        self._heap: list[int] = []  # -hash of tracked blocks (and of some gone): the largest
        self._clock = 0
        self.curve = ReuseCurve()
        self.accesses = 0  # blocks seen
        self.sampled = 0  # of them, blocks tracked

    @property
    def rate(self) -> float:
        return self.threshold / _FULL

    @property
    def tracked(self) -> int:
        return len(self._last)

    def touch(self, hashes: Sequence[int]) -> None:
        """Blocks that arrive without a request (a prefetch): used, no hit recorded."""
        if hashes:
            self.observe(hashes, 0, 1, count=False)

    def observe(
        self, hashes: Sequence[int], num_tokens: int, block_size: int, *, count: bool = True
    ) -> None:
        """One request: prompt of ``num_tokens`` tokens, ``hashes`` of its full blocks.

        The engine recomputes at least the last prompt token, so only the first
        ``(num_tokens - 1) // block_size`` blocks can hit.
        """
        curve = self.curve
        if count:
            curve.tokens += num_tokens
            curve.requests += 1
            self.accesses += len(hashes)
        eligible = (num_tokens - 1) // block_size if count else 0
        buckets = curve.buckets
        threshold = self.threshold
        lead = 0  # leading blocks in the hot set: reused at a depth below hot_blocks
        if self.hot_blocks:
            lead = self._touch_hot(hashes, min(len(hashes), eligible))
            if threshold == _FULL:
                lead = 0  # every block is tracked: their depths are exact, use those
            elif lead:
                buckets[self._hot_bucket] += lead * block_size
        # Block hashes are xxh3 outputs (index.hashing), uniform already: no mixing. A
        # plain filter, then the few positions, costs half of filtering (i, h) pairs.
        # Each position is searched from the previous one on: from the start, a cold
        # 128K-token prompt (8K blocks, a quarter sampled) cost 100-340 ms here, on the
        # event loop; from the previous one it is one pass over the hashes in all.
        if threshold == _FULL:
            picked = list(enumerate(hashes))
        else:
            picked = []
            at = -1
            for h in [h for h in hashes if h < threshold]:
                at = hashes.index(h, at + 1)
                picked.append((at, h))
        if not picked:
            return
        self.sampled += len(picked)
        rate = threshold / _FULL
        weight = block_size / rate
        last, by_time = self._last, self._by_time
        n = len(by_time)
        # a block out of the hot set is deeper than half of it (while sampling with one)
        floor = self.hot_blocks // 2 + 1 if self.hot_blocks and threshold < _FULL else 1
        for i, m in picked:
            if i < lead or i >= eligible:
                continue
            t = last.get(m)
            if t is not None:
                depth = n - by_time.bisect_right(t)
                buckets[bucket_of(max(floor, int(depth / rate) + 1))] += weight
        clock = self._clock
        for _i, m in reversed(picked):  # tail first: the first block ends most recent
            t = last.get(m)
            if t is None:
                heapq.heappush(self._heap, -m)
            else:
                del by_time[t]
            clock += 1
            last[m] = clock
            by_time[clock] = m
        self._clock = clock
        self._bound()

    def _touch_hot(self, hashes: Sequence[int], cap: int) -> int:
        """The leading hot blocks of the first ``cap``; then use every block, tail first.

        The hot set is the blocks used in the current and the previous generation of
        ``hot_blocks / 2`` distinct blocks: it holds every block at a depth below half of
        ``hot_blocks`` and none at ``hot_blocks`` or more. Two plain dicts make it about
        a tenth of the cost of an exact LRU (an ``OrderedDict``'s eviction costs 0.4 us a
        block). Depth grows along the chain, so the hot blocks are a leading run.
        """
        cur, prev = self._hot, self._hot_prev
        lead = 0
        while lead < cap and (hashes[lead] in cur or hashes[lead] in prev):
            lead += 1
        half = self.hot_blocks // 2
        order = list(reversed(hashes))
        start = 0
        while start < len(order):
            room = max(1, half - len(cur))
            cur.update(dict.fromkeys(order[start : start + room]))
            start += room
            if len(cur) >= half:
                self._hot_prev, prev = cur, cur
                self._hot = cur = {}
        return lead

    def _bound(self) -> None:
        last, by_time, heap = self._last, self._by_time, self._heap
        while len(last) > self.max_tracked:
            m = -heapq.heappop(heap)
            t = last.pop(m, None)
            if t is not None:  # the largest: from now on only hashes below it are sampled
                self.threshold = m
                del by_time[t]
        if self.horizon is not None:
            # the oldest tracked block sits at depth len - 1 (tracked), (len - 1) / R blocks
            limit = self.horizon * self.threshold / _FULL
            while by_time and len(by_time) - 1 > limit:
                _t, m = by_time.popitem(0)
                del last[m]  # its heap entry goes when it comes up
            if len(heap) > 2 * len(last) + 64:
                self._heap = heap = [-m for m in last]
                heapq.heapify(heap)
