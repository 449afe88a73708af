"""bench/load.py's reading of a Prometheus scrape (``samples``), which every bench uses."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from load import samples  # noqa: E402

SCRAPE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a b"} 3.0
vllm:num_requests_running{engine="1",model_name="a b"} 2.0
# HELP vllm:num_requests_running_peak A name the first one starts.
# TYPE vllm:num_requests_running_peak gauge
vllm:num_requests_running_peak{engine="0",model_name="a b"} 9.0
# HELP cache_router_admission_limit The learnt limit.
# TYPE cache_router_admission_limit gauge
cache_router_admission_limit{worker="w 0"} 4.0
# HELP cache_router_admission_queued Requests held.
# TYPE cache_router_admission_queued counter
cache_router_admission_queued_total{tenant="t"} 7.0
cache_router_admission_queued_created{tenant="t"} 1.7e9
"""


def test_samples_reads_names_exactly_with_their_labels() -> None:
    running = samples(SCRAPE, "vllm:num_requests_running")
    assert [v for _, v in running] == [3.0, 2.0]  # not the _peak one a prefix match takes
    assert running[0][0] == {"engine": "0", "model_name": "a b"}
    assert samples(SCRAPE, "cache_router_admission_limit") == [({"worker": "w 0"}, 4.0)]
    assert samples(SCRAPE, "cache_router_admission_queued_total") == [({"tenant": "t"}, 7.0)]
    assert samples(SCRAPE, "absent") == []
