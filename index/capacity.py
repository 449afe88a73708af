"""Capacity forecast for one model: what hit rate each cache size gives, and where it stops paying.

Two views of the same request stream (``index.reuse``):

- *pooled*: every request in one LRU stack, the pool's memory as one cache. Its curve is
  the ceiling for any routing: no duplicates, no imbalance.
- *per worker*: the requests routed to each worker, in that worker's own stack, so the
  curve includes what the routing costs (a prefix computed on two workers takes room on
  both).

Tiers: a worker's host memory is the next LRU level below its GPU (a block evicted from
GPU moves to host, a host hit moves back), so the two together behave as one LRU of
``gpu + host`` blocks: GPU hits are ``hit(gpu)``, host hits ``hit(gpu + host) - hit(gpu)``.

The *saturation point* is the size from which one more doubling adds less than a point;
the *working set* is the size that reaches 95 % of the ceiling (the unbounded pooled
hit rate). A working set larger than the pool's memory is warned about.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from index.backend import use_native
from index.reuse import StackDistance, doublings, saturation

try:
    from index.native_reuse import NativeStackDistance
except ImportError:  # not built
    NativeStackDistance = None  # type: ignore[assignment,misc]

Stack = StackDistance | NativeStackDistance

SHARES = (0.9, 0.95, 0.99)  # "capacity needed for X % of the ceiling"
WORKING_SET_SHARE = 0.95


@dataclass(frozen=True, slots=True)
class Tiers:
    """A worker's cache sizes in blocks."""

    gpu: int
    host: int = 0

    @property
    def total(self) -> int:
        return self.gpu + self.host


@dataclass(frozen=True, slots=True)
class Sampling:
    """Bounds of each stack (``index.reuse.StackDistance``, native when the core is built:
    ``index.native_reuse``, the same histogram at ~0.2 us a block instead of ~8 us)."""

    max_tracked: int = 8192
    hot_blocks: int = 1024
    horizon: int | None = 1 << 24

    def stack(self) -> Stack:
        cls = NativeStackDistance if use_native() else StackDistance
        return cls(max_tracked=self.max_tracked, hot_blocks=self.hot_blocks, horizon=self.horizon)


class CapacityForecast:
    """The pooled and per-worker stacks of one model (one block size)."""

    def __init__(self, block_size: int, sampling: Sampling | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.sampling = sampling or Sampling()
        self.pooled = self.sampling.stack()
        self.workers: dict[str, Stack] = {}

    def observe(
        self, worker: str | None, hashes: Sequence[int], num_tokens: int, prefetched: int = 0
    ) -> None:
        """One routed request (``worker`` None: not routed, pooled view only).

        ``prefetched``: leading blocks a prefetch hint pulls into the worker before the
        request is admitted; they are hits there although the worker never computed them
        (cache_aware moved 1.5 % of the prompt tokens of Mooncake's conversation trace so,
        and the per-worker forecast came out a point low without them).
        """
        self.pooled.observe(hashes, num_tokens, self.block_size)
        if worker is not None:
            stack = self.workers.get(worker)
            if stack is None:
                stack = self.workers[worker] = self.sampling.stack()
            if prefetched > 0:
                stack.touch(hashes[:prefetched])
            stack.observe(hashes, num_tokens, self.block_size)

    def grid(self, capacities: Mapping[str, Tiers]) -> list[int]:
        """Doubling capacities to past every need and every size, from 16 blocks (from the
        hot set's size once the pooled stack samples: below it its curve is not defined)."""
        top = max([self.pooled.curve.max_need(), *(t.total for t in capacities.values()), 1])
        start = self.sampling.hot_blocks if self.pooled.rate < 1 else 16
        return doublings(max(1, start), 2 * top)

    def report(self, capacities: Mapping[str, Tiers]) -> dict[str, Any]:
        """JSON-ready: curves, sizes, predicted hit rates, saturation, warnings."""
        grid = self.grid(capacities)
        curve = self.pooled.curve
        ceiling = curve.ceiling()
        pool_size = sum(t.total for t in capacities.values())
        rates = curve.hit_rates(grid)
        needed = {
            f"{round(share * 100)}": curve.capacity_for(share * ceiling) if ceiling else 0
            for share in SHARES
        }
        working_set = curve.capacity_for(WORKING_SET_SHARE * ceiling) if ceiling else 0
        warnings = []
        if working_set and pool_size and working_set > pool_size:
            warnings.append(
                f"the working set outgrows the pool: {WORKING_SET_SHARE:.0%} of the ceiling "
                f"hit rate ({ceiling:.3f}) needs {working_set} blocks, the pool holds "
                f"{pool_size}"
            )
        workers = {}
        for wid in sorted(set(capacities) | set(self.workers)):
            stack = self.workers.get(wid)
            if stack is not None:
                workers[wid] = worker_report(stack, capacities.get(wid), grid)
        return {
            "block_size": self.block_size,
            "requests": curve.requests,
            "prompt_tokens": curve.tokens,
            "ceiling_hit_rate": ceiling,
            "working_set_blocks": working_set,
            "needed_blocks": needed,
            "pooled": {
                "capacity_blocks": pool_size,
                "predicted_hit_rate": curve.hit_rate(pool_size) if pool_size else None,
                "saturation_blocks": saturation(grid, rates),
                "curve": [[c, r] for c, r in zip(grid, rates, strict=True)],
                **stack_stats(self.pooled),
            },
            "workers": workers,
            "warnings": warnings,
        }


def worker_report(stack: Stack, tiers: Tiers | None, grid: list[int]) -> dict[str, Any]:
    """One worker's curve, and at its sizes the hit rate by tier and the host tier's curve."""
    curve = stack.curve
    rates = curve.hit_rates(grid)
    out: dict[str, Any] = {
        "requests": curve.requests,
        "saturation_blocks": saturation(grid, rates),
        "curve": [[c, r] for c, r in zip(grid, rates, strict=True)],
        **stack_stats(stack),
    }
    if tiers is None:
        return out
    gpu, total = curve.hit_rates((tiers.gpu, tiers.total))
    hosts = [0, *grid]
    with_host = curve.hit_rates(tiers.gpu + h for h in hosts)
    out.update(
        gpu_blocks=tiers.gpu,
        host_blocks=tiers.host,
        predicted_hit_rate=total,
        predicted_gpu_hit_rate=gpu,
        predicted_host_hit_rate=total - gpu,
        host_curve=[[h, r] for h, r in zip(hosts, with_host, strict=True)],
        host_saturation_blocks=host_saturation(hosts, with_host),
    )
    return out


def host_saturation(hosts: list[int], rates: list[float]) -> int:
    """The host size from which doubling it adds less than a point (0: none pays).

    ``hosts`` is 0 and then doubling sizes; ``rates`` the total hit rate with each.
    """
    if rates[1] - rates[0] < 0.01 and saturation(hosts[1:], rates[1:]) == hosts[1]:
        return 0
    return saturation(hosts[1:], rates[1:])


def stack_stats(stack: Stack) -> dict[str, Any]:
    return {
        "sampling_rate": stack.rate,
        "tracked_blocks": stack.tracked,
        "blocks_seen": stack.accesses,
    }
