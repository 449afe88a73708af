"""Load tracking: request flights, engine load reports and /metrics scrapes."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.workers.load import (
    EngineLoad,
    RunningPrefills,
    WorkerLoad,
    parse_engine_metrics,
    parse_load_report,
)

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
"""

SGLANG = """sglang:num_running_reqs{model_name="m"} 4
sglang:num_queue_reqs{model_name="m"} 9
sglang:token_usage{model_name="m"} 0.75
sglang:cache_hit_rate{model_name="m"} 0.5
"""

OLD_VLLM = "vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.125\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VLLM, EngineLoad(5, 7, 0.5)),
        (SGLANG, EngineLoad(4, 9, 0.75)),
        (OLD_VLLM, EngineLoad(1, None, 0.125)),
        ("garbage line\n# only comments\n", EngineLoad(None, None, None)),
    ],
)
def test_engine_metrics_from_vllm_and_sglang(text, expected):
    assert parse_engine_metrics(text) == expected


def test_load_report_json():
    assert parse_load_report(b'{"running": 2, "waiting": 1, "kv_usage": 0.5, "ts": 1}') == (
        EngineLoad(2, 1, 0.5)
    )
    for bad in (b"[]", b'{"running": "x"}', b'{"waiting": true}', b"nope"):
        with pytest.raises(ValueError):
            parse_load_report(bad)


def test_stale_engine_numbers_are_ignored():
    load = WorkerLoad()
    assert load.engine_fresh(5.0, now=0.0) is None
    load.report(EngineLoad(1, 2, 0.3), now=10.0)
    assert load.engine_fresh(5.0, now=14.0) == EngineLoad(1, 2, 0.3)
    assert load.engine_fresh(5.0, now=16.0) is None


@given(
    st.lists(
        st.tuples(st.integers(0, 5000), st.lists(st.sampled_from("fx"), max_size=4)),
        max_size=30,
    )
)
def test_flights_always_return_the_load_they_took(plan):
    """Against a plain model: whatever order first bytes and finishes come in, twice or
    not at all, counters match the flights still open and end at zero."""
    load = WorkerLoad()
    flights = []
    for prefill, steps in plan:
        f = load.begin(prefill)
        flights.append(f)
        for step in steps:
            f.first_byte() if step == "f" else f.finish()
        waiting = [x for x in flights if x.state == 0]
        decoding = [x for x in flights if x.state == 1]
        assert load.inflight_requests == len(waiting) + len(decoding)
        assert load.inflight_prefill_tokens == sum(x.prefill for x in waiting)
        assert load.decode_streams == len(decoding)
        # the flights timed are exactly those still prefilling (a 0-token one is not)
        assert len(load.prefills) == sum(1 for x in waiting if x.prefill > 0)
    for f in flights:
        f.finish()
    assert (load.inflight_requests, load.inflight_prefill_tokens, load.decode_streams) == (0, 0, 0)
    assert len(load.prefills) == 0


def test_running_prefills_time_the_oldest_from_when_it_could_start() -> None:
    """Only the oldest runs (an engine prefills first come, first served), and it starts
    when it was sent or when the one before it left, whichever is later."""
    p = RunningPrefills()
    assert p.oldest(5.0) == (0, 0.0)
    a, b, c, d = object(), object(), object(), object()
    p.add(a, 1000, 10.0)
    p.add(b, 500, 12.0)
    p.add(c, 300, 13.0)
    assert p.oldest(40.0) == (1000, 30.0)
    assert p.oldest(5.0) == (1000, 0.0)  # a clock before its start: not begun
    p.remove(b, 50.0)  # not the oldest: the oldest keeps its start
    assert p.oldest(60.0) == (1000, 50.0)
    p.remove(a, 70.0)  # the oldest left: c, sent at 13, starts computing at 70
    assert p.oldest(75.0) == (300, 5.0)
    p.remove(a, 72.0)  # twice: nothing changes
    assert p.oldest(75.0) == (300, 5.0)
    p.remove(c, 80.0)
    p.add(d, 200, 100.0)  # sent to an idle engine: starts when sent
    assert p.oldest(130.0) == (200, 30.0)


def test_worker_load_shows_its_oldest_flight_until_the_first_byte() -> None:
    load = WorkerLoad()
    first = load.begin(800, now=0.0)
    load.begin(0, now=1.0)  # a passthrough's unknown prompt is not timed
    second = load.begin(300, now=2.0)
    assert load.prefills.oldest(100.0) == (800, 100.0)
    first.first_byte()
    tokens, ran = load.prefills.oldest(time.monotonic() * 1000.0 + 5.0)
    assert tokens == 300 and 5.0 <= ran < 60_000.0  # from its predecessor's first byte
    second.finish()
    assert load.prefills.oldest(1e12) == (0, 0.0)
