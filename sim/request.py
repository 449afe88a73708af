"""One request's life in the simulator: what the trace says, what happened to it."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from policies import RouteRequest

if TYPE_CHECKING:
    from sim.traces import Trace


class SimRequest:
    """Plain mutable record; slots keep thousands of live ones cheap."""

    __slots__ = (
        "admit_ms",
        "arrival_ms",
        "best_hit_blocks",
        "computed",
        "decode_from",
        "engine_hashes",
        "est_prefill",
        "finish_ms",
        "first_token_ms",
        "hint_deadline_ms",
        "hit_gpu_blocks",
        "hit_host_blocks",
        "idx",
        "input_len",
        "output_len",
        "promised_blocks",
        "rid",
        "route",
        "tokens",
        "worker",
    )

    def __init__(
        self,
        idx: int,
        arrival_ms: float,
        input_len: int,
        output_len: int,
        tokens: array[int],
        engine_hashes: array[int],
        route: RouteRequest,
    ) -> None:
        self.idx = idx
        self.rid = route.request_id
        self.arrival_ms = arrival_ms
        self.input_len = input_len
        self.output_len = output_len
        self.tokens = tokens
        self.engine_hashes = engine_hashes
        self.route = route
        self.worker = -1
        self.est_prefill = 0  # the router's estimate of uncached tokens, for its load count
        self.best_hit_blocks = 0  # the longest match on any worker when it was routed
        self.promised_blocks = 0  # the hit the router counted on where it sent the request
        self.admit_ms = -1.0  # prefill started (pages allocated)
        self.first_token_ms = -1.0
        self.finish_ms = -1.0
        self.computed = 0  # prompt tokens in place (hits + computed)
        self.hit_gpu_blocks = 0
        self.hit_host_blocks = 0
        self.decode_from = 0  # engine step of the first token
        self.hint_deadline_ms = -1.0  # a prefetch hint's expected admission wait (-1: none)

    @classmethod
    def arrival(cls, trace: Trace, i: int, block_size: int) -> SimRequest:
        """Trace request ``i`` as it reaches the router (the mixed and the PD simulator)."""
        tr = trace.requests[i]
        route = RouteRequest(
            request_id=f"r{i}",
            model="sim",
            num_tokens=tr.input_len,
            block_hashes=tr.router_hashes.tolist(),
            block_size=block_size,
            session_key=tr.session,
            max_tokens=tr.output_len,
        )
        return cls(
            i, tr.arrival_ms, tr.input_len, tr.output_len, trace.tokens(i), tr.engine_hashes, route
        )
