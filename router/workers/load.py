"""Per-worker load: what this router has in flight, plus what the engine reports.

The router's own counters move at once (a burst of requests sees each other), while
engine numbers arrive late (``kv.load.<worker>`` reports or ``/metrics`` scrapes) but
include traffic from other routers; policies get both.

In-flight prefill tokens are the uncached prompt tokens of requests still waiting for
their first byte: that is the queue a new request would wait behind. They stay counted
whole until the first byte, but the oldest of them has been computing for a while: an
engine prefills its queue first come, first served, so ``RunningPrefills`` keeps this
router's flights per worker in arrival order and says how long the oldest has run (since
it was sent, or since the one before it left, whichever is later). The policy turns that
time into tokens at its own cost model (``policies.cost_model.computed_tokens``): a
prefix holder whose long prompt is nearly done no longer looks as busy as when it began
(issue 15: on conversation seed 2 a holder showed 93,389 tokens with 11,469 left to
compute, and the request left a 424-of-429-block match for an idle engine).

With router replicas (``router.events.replicas``) the counters also hold what the peers have
in flight on the worker; ``own()`` is this router's part, the one it tells its peers.
"""

from __future__ import annotations

import enum
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from policies.base import MAX_ENGINE_COUNT

if TYPE_CHECKING:
    from index._native import LoadBoard


@dataclass(slots=True)
class EngineLoad:
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    # why requests wait (``router.admission.capacity.cause``), each None where the engine
    # does not say: of ``waiting``, those held back for reasons of their own (vLLM's
    # ``reason="deferred"``: a LoRA budget, a KV transfer, a grammar), the requests it
    # preempted so far (a counter), and its KV cache's size in tokens
    deferred: int | None = None
    preemptions: float | None = None
    kv_tokens: int | None = None


class RunningPrefills:
    """One engine's prefills in flight, oldest first, and how long the oldest has run.

    Plain and synchronous, in the caller's clock (the router's monotonic milliseconds,
    the simulator's virtual ones): the router and both simulators count with it. Only the
    oldest is discounted, since an engine works through its queue in order; the later
    ones have not started, or barely.
    """

    __slots__ = ("_flights", "_head_since")

    def __init__(self) -> None:
        self._flights: dict[object, tuple[int, float]] = {}  # key -> (tokens, sent at)
        self._head_since = -math.inf  # when the previous oldest left

    def __len__(self) -> int:
        return len(self._flights)

    def add(self, key: object, tokens: int, now: float) -> None:
        self._flights[key] = (tokens, now)

    def remove(self, key: object, now: float) -> None:
        """The flight's prefill is over (first token, an error, a cancel); once the oldest
        leaves, the next one starts computing now at the earliest."""
        flights = self._flights
        if key not in flights:
            return
        if next(iter(flights)) is key:
            self._head_since = now
        del flights[key]

    def smallest(self) -> int:
        """The fewest tokens of one flight (0 with none)."""
        return min((tokens for tokens, _ in self._flights.values()), default=0)

    def oldest(self, now: float) -> tuple[int, float]:
        """``(tokens, running time)`` of the oldest flight; ``(0, 0.0)`` with none."""
        flights = self._flights
        if not flights:
            return 0, 0.0
        tokens, sent = next(iter(flights.values()))
        began = sent if sent > self._head_since else self._head_since
        return tokens, (now - began if now > began else 0.0)


class WorkerLoad:
    """Load counters of one worker; mutated only on the event loop."""

    __slots__ = (
        "board",
        "decode_streams",
        "engine",
        "engine_seen",
        "inflight_prefill_tokens",
        "inflight_requests",
        "listener",
        "name",
        "peer_decode_streams",
        "peer_prefill_tokens",
        "peer_requests",
        "prefilled",
        "prefills",
        "slot",
        "watched",
    )

    def __init__(self) -> None:
        self.inflight_requests = 0
        self.inflight_prefill_tokens = 0
        self.decode_streams = 0
        self.engine = EngineLoad()
        self.engine_seen = float("-inf")  # monotonic time of the last engine report
        # the peers' part of the three counters above
        self.peer_requests = 0
        self.peer_prefill_tokens = 0
        self.peer_decode_streams = 0
        # this router's own flights waiting for their first byte (the peers' are counts
        # only): when the oldest was sent, in monotonic ms
        self.prefills = RunningPrefills()
        # prompt tokens of this router's flights whose first byte came, so far (what the
        # engine prefilled between two of its reports, for admission: ``capacity.cause``)
        self.prefilled = 0
        # a wide pool's load board (router/routing/prune.py): told each move of the two
        # counters it orders by, so no decision reads every target's load
        self.board: LoadBoard | None = None
        self.slot = 0
        # told this load's name on each move (admission's count of the workers without
        # room, ``Admission.moved``: no pass over every target to find one with room)
        self.listener: Callable[[str], None] | None = None
        self.name = ""
        self.watched = False  # a board or a listener: the moves are told

    def watch(self, board: LoadBoard | None, slot: int = 0) -> None:
        """Tell ``board`` (None: stop) this load's moves, as its ``slot``."""
        self.board, self.slot = board, slot
        self.watched = board is not None or self.listener is not None
        self.moved()

    def listen(self, listener: Callable[[str], None] | None, name: str = "") -> None:
        """Call ``listener(name)`` (None: stop) on each move of this load."""
        self.listener, self.name = listener, name
        self.watched = self.board is not None or listener is not None

    def moved(self) -> None:
        board = self.board
        if board is not None:
            board.set(self.slot, self.inflight_requests, self.inflight_prefill_tokens)
        listener = self.listener
        if listener is not None:
            listener(self.name)

    def begin(self, prefill_tokens: int, now: float | None = None) -> Flight:
        self.inflight_requests += 1
        self.inflight_prefill_tokens += prefill_tokens
        flight = Flight(self, prefill_tokens)
        if prefill_tokens > 0:  # a passthrough's unknown prompt neither waits nor discounts
            self.prefills.add(flight, prefill_tokens, _now_ms() if now is None else now)
        if self.watched:
            self.moved()
        return flight

    def own(self) -> tuple[int, int, int]:
        """This router's in-flight requests, prefill tokens and decode streams."""
        return (
            self.inflight_requests - self.peer_requests,
            self.inflight_prefill_tokens - self.peer_prefill_tokens,
            self.decode_streams - self.peer_decode_streams,
        )

    def add_peer(self, requests: int, prefill_tokens: int, decode_streams: int) -> None:
        """Count load a peer replica routed here (negative numbers take it back)."""
        self.inflight_requests += requests
        self.inflight_prefill_tokens += prefill_tokens
        self.decode_streams += decode_streams
        self.peer_requests += requests
        self.peer_prefill_tokens += prefill_tokens
        self.peer_decode_streams += decode_streams
        if self.watched:
            self.moved()

    def report(self, engine: EngineLoad, now: float | None = None) -> None:
        self.engine = engine
        self.engine_seen = time.monotonic() if now is None else now

    def engine_fresh(self, stale_after: float, now: float | None = None) -> EngineLoad | None:
        """The engine's numbers if reported within ``stale_after`` seconds, else None."""
        now = time.monotonic() if now is None else now
        return self.engine if now - self.engine_seen <= stale_after else None

    def snapshot(self) -> dict[str, Any]:
        e = self.engine
        return {
            "inflight_requests": self.inflight_requests,
            "inflight_prefill_tokens": self.inflight_prefill_tokens,
            "decode_streams": self.decode_streams,
            "peer_requests": self.peer_requests,
            "peer_prefill_tokens": self.peer_prefill_tokens,
            "engine_running": e.running,
            "engine_waiting": e.waiting,
            "kv_usage": e.kv_usage,
        }


class FlightState(enum.IntEnum):
    WAITING = 0  # for the first byte: its prompt counts as in-flight prefill
    DECODING = 1  # counts as a decode stream
    FINISHED = 2


# Module names: the hot path tests the state once per chunk, a global is the cheapest read.
WAITING, DECODING, FINISHED = FlightState


class Flight:
    """One request's share of a worker's load; each transition happens at most once."""

    __slots__ = ("load", "prefill", "state")

    def __init__(self, load: WorkerLoad, prefill: int) -> None:
        self.load = load
        self.prefill = prefill
        self.state = WAITING

    def first_byte(self) -> None:
        if self.state is WAITING:
            load = self.load
            load.inflight_prefill_tokens -= self.prefill
            load.prefilled += self.prefill
            load.prefills.remove(self, _now_ms())
            load.decode_streams += 1
            self.state = DECODING
            if load.watched:
                load.moved()

    def finish(self) -> None:
        if self.state is WAITING:
            self.load.inflight_prefill_tokens -= self.prefill
            self.load.prefills.remove(self, _now_ms())
        elif self.state is DECODING:
            self.load.decode_streams -= 1
        else:
            return
        self.load.inflight_requests -= 1
        self.state = FINISHED
        if self.load.watched:
            self.load.moved()


def _now_ms() -> float:
    return time.monotonic() * 1000.0


def parse_load_report(data: bytes) -> EngineLoad:
    """A ``kv.load.<worker>`` JSON report ``{running, waiting, kv_usage, ts}``.

    Anyone who may publish on ``kv.load.*`` writes these numbers into every routing
    decision, so each is checked: finite, not negative, counts at most
    ``MAX_ENGINE_COUNT``, usage at most 1 (a forged ``waiting: 1e308`` used to overflow
    the policy's float math and turn every request into a 500). ``ValueError`` otherwise.
    """
    obj = orjson.loads(data)
    if not isinstance(obj, dict):
        raise ValueError("load report is not a JSON object")
    _num(obj.get("ts"), "ts", math.inf)  # unused, but a report with a bad one is not trusted
    return EngineLoad(
        running=_count(obj.get("running"), "running"),
        waiting=_count(obj.get("waiting"), "waiting"),
        kv_usage=_num(obj.get("kv_usage"), "kv_usage", 1.0),
        deferred=_count(obj.get("deferred"), "deferred"),
        preemptions=_num(obj.get("preemptions"), "preemptions", math.inf),
        kv_tokens=_tokens(obj.get("kv_tokens"), "kv_tokens"),
    )


def _num(value: Any, name: str, high: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"load report {name} is not a number: {value!r}")
    if not 0 <= value <= high:  # NaN fails this too
        raise ValueError(f"load report {name} {value!r} is outside [0, {high:g}]")
    return float(value)


def _count(value: Any, name: str) -> int | None:
    number = _num(value, name, MAX_ENGINE_COUNT)
    return None if number is None else int(number)


def _tokens(value: Any, name: str) -> int | None:
    number = _num(value, name, MAX_KV_TOKENS)
    return None if number is None else int(number)


# Prometheus names (newest vLLM, older vLLM, SGLang); the first present in a scrape wins.
# The node agent (``agent.load``) reads the same gauges for its load reports.
RUNNING_GAUGES = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING_GAUGES = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
# Why requests wait (vLLM 0.32 and newer; older engines have none of these): waiting by
# reason ("capacity": slots, KV or the step's token budget; "deferred": held back for
# their own reasons), preemptions so far, the KV cache's size (vLLM: the labels of its
# ``cache_config_info``; SGLang: a gauge)
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
PREEMPTION_COUNTERS = ("vllm:num_preemptions_total",)
KV_INFO = "vllm:cache_config_info"
KV_TOKEN_GAUGES = ("sglang:max_total_num_tokens",)
MAX_KV_TOKENS = 1 << 40  # a KV cache's tokens, at most (a bound on a forged report)


def parse_engine_metrics(text: str) -> EngineLoad:
    """Engine load from a Prometheus text scrape of a vLLM or SGLang ``/metrics``.

    Counts are summed over series (one per DP engine); KV usage is the highest series,
    since the fullest rank is the one that queues.
    """
    values: dict[str, list[float]] = {}
    wanted = set(RUNNING_GAUGES + WAITING_GAUGES + KV_USAGE_GAUGES + PREEMPTION_COUNTERS)
    wanted |= set(KV_TOKEN_GAUGES)
    deferred: list[float] = []
    kv_tokens: list[float] = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name == KV_INFO:  # the size in its labels: blocks of block_size tokens
            size = _kv_tokens(line)
            if size is not None:
                kv_tokens.append(size)
            continue
        if name not in wanted and name != WAITING_BY_REASON:
            continue
        fields = line.rsplit("}", 1)[-1].split() if "{" in line else line.split()[1:]
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue
        if name == WAITING_BY_REASON:
            if 0 <= value <= MAX_ENGINE_COUNT and 'reason="deferred"' in line:
                deferred.append(value)
        elif name in KV_TOKEN_GAUGES:
            if 0 < value <= MAX_KV_TOKENS:
                kv_tokens.append(value)
        elif 0 <= value <= (MAX_ENGINE_COUNT if name not in PREEMPTION_COUNTERS else 2**53):
            values.setdefault(name, []).append(value)  # NaN, inf, negatives: not a load

    def first(names: tuple[str, ...]) -> list[float] | None:
        return next((values[n] for n in names if n in values), None)

    running, waiting = first(RUNNING_GAUGES), first(WAITING_GAUGES)
    usage = first(KV_USAGE_GAUGES)
    preempted = first(PREEMPTION_COUNTERS)
    return EngineLoad(
        running=None if running is None else min(int(sum(running)), MAX_ENGINE_COUNT),
        waiting=None if waiting is None else min(int(sum(waiting)), MAX_ENGINE_COUNT),
        kv_usage=None if usage is None else min(max(usage), 1.0),
        deferred=min(int(sum(deferred)), MAX_ENGINE_COUNT) if deferred else None,
        preemptions=None if preempted is None else sum(preempted),
        # the smallest rank's: the one whose cache fills first
        kv_tokens=int(min(kv_tokens)) if kv_tokens else None,
    )


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def labels_of(series: str) -> dict[str, str]:
    """The labels of one Prometheus series (``name{key="value",...} number``, or what
    is between its braces)."""
    return dict(_LABEL.findall(series))


def _kv_tokens(line: str) -> float | None:
    """A ``vllm:cache_config_info`` sample's KV cache size in tokens: its
    ``kv_cache_size_tokens`` label, else ``num_gpu_blocks`` x ``block_size`` (None: no
    size in it)."""
    labels = labels_of(line)
    try:
        size = labels.get("kv_cache_size_tokens")
        tokens = (
            float(size)
            if size not in (None, "", "None")
            else float(labels["num_gpu_blocks"]) * float(labels["block_size"])
        )
    except (KeyError, ValueError):
        return None
    return tokens if 0 < tokens <= MAX_KV_TOKENS else None
