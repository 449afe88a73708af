"""One request's life in the simulator: what the trace says, what happened to it."""

from __future__ import annotations

from array import array

from policies import RouteRequest


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
        tokens: array,
        engine_hashes: array,
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
