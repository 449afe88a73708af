"""Admission learns an engine's limit only from waiting that its slots or its memory
explain, never from waiting behind a step's token budget (issues 31 and 35).

On real vLLM (CPU build 0.32, 8 slots, a 2,048-token budget, prompts of 500-1,800
tokens) the engines reported requests waiting whenever a step's budget was spent, and
the router learnt limits of 3-4 on engines of 8 slots. These tests replay that shape of
reports, and the simulator's engines of the same shape, and check that slot-capped or
memory-bound waiting still sets a limit and that deferred waiting never counts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest

from agent.load import parse_load
from policies.cost_model import EngineCosts
from router.admission.capacity import BUDGET, FULL, Capacity, cause
from router.admission.core import AdmissionSettings
from router.admission.gate import Gate
from router.workers.load import EngineLoad, WorkerLoad, parse_engine_metrics, parse_load_report
from sim.cache import PrefixCache
from sim.gen_trace import write
from sim.mock.scheduler import Scheduler, Sequence, Timing
from sim.simulator import SimConfig, Simulation
from sim.traces import load_trace

KV = 256 * 32  # bench/e2e.py's engines: 256 pages of 32 tokens


def test_cause_tells_compute_from_slots_and_memory() -> None:
    # an engine of 8 slots mid-prefill: 4 running, the next prompts over one step
    assert cause(4, 4, BUDGET, kv_usage=0.3, kv_tokens=KV, prefill=2900, need=600) == "compute"
    # fewer running than it was ever seen running: its slots are not what keeps them
    assert cause(3, 8, BUDGET, kv_usage=0.3, kv_tokens=KV, prefill=100, need=50) == "compute"
    # at the most it ran, with little prompt left to start: its slots
    assert cause(4, 4, BUDGET, kv_usage=0.1, kv_tokens=KV, prefill=90, need=15) == "slots"
    assert cause(4, 4, BUDGET) == "slots"  # nothing else known: as before
    assert cause(4, 4, 0, prefill=10_000) == "slots"  # budget 0: every waiting counts
    # memory, whatever the prompts: full, preempting, or no room for any prompt sent
    assert cause(3, 8, BUDGET, kv_usage=FULL, prefill=9000) == "memory"
    assert cause(3, 8, BUDGET, kv_usage=0.2, preempted=True, prefill=9000) == "memory"
    assert cause(5, 8, BUDGET, kv_usage=0.85, kv_tokens=KV, prefill=3000, need=1300) == "memory"
    # room for the smallest prompt sent: memory does not explain it
    assert cause(5, 8, BUDGET, kv_usage=0.85, kv_tokens=KV, prefill=3000, need=1000) == "compute"


def _vllm_budget_reports() -> Iterator[tuple[int, int, int]]:
    """(running, waiting, prompt tokens to prefill) as a vLLM CPU engine of 8 slots and
    a 2,048-token budget reported them every 0.5 s under conversation@1.5 (prompts of
    500-1,800 tokens), from the very first report on: the step spent its budget on the
    prompts it started or finished (their first token since the last report, or none
    yet) and left the next ones waiting, whose tokens count too."""
    rng = random.Random(7)
    for _ in range(200):
        running = rng.choice((1, 2, 3, 3, 4, 4, 5))
        waiting = rng.choice((1, 1, 2, 3))
        spent = rng.randint(2048 - running, 2 * 2048)  # one step's budget at least
        yield running, waiting, spent + sum(rng.randint(500, 1800) for _ in range(waiting))


def test_token_budget_waiting_teaches_no_slot_limit() -> None:
    """Fails on the rule until session 21 (limits of 3-5 on an engine of 8 slots)."""
    cap = Capacity(engine_queue=1)
    now = 0.0
    for running, waiting, pending in _vllm_budget_reports():
        now += 0.5
        cap.report(
            "e1", running, waiting, now, kv_usage=0.3, kv_tokens=KV, preemptions=0.0,
            prefill=pending, need=500,
        )  # fmt: skip
        assert cap.limit("e1") is None and cap.first("e1") is None, (running, waiting)
    assert not cap.limited and cap.room("e1", 50) > 8


def test_slot_capped_waiting_still_teaches_the_limit() -> None:
    """bench/overload.py's mock engines: 4 slots, prompts of ~15 tokens, a flood."""
    cap = Capacity(engine_queue=1)
    cap.report("m", 2, 0, 0.0, kv_usage=0.01, prefill=30, need=15)
    assert not cap.report("m", 4, 6, 0.25, kv_usage=0.02, prefill=150, need=15)
    assert cap.first("m") == 4  # provisional: a tenant over its share is held already
    assert cap.report("m", 4, 9, 0.5, kv_usage=0.02, prefill=195, need=15)
    assert cap.limit("m") == 4 and cap.room("m", 5) == 0


def test_memory_bound_waiting_still_teaches_and_cuts_the_limit() -> None:
    cap = Capacity(engine_queue=1)
    cap.report("e", 8, 0, 0.0, kv_usage=0.5)  # it ran 8 once
    # long prompts in a full cache: 6 running, the rest can get no pages
    cap.report("e", 6, 3, 0.5, kv_usage=0.93, kv_tokens=KV, prefill=4000, need=700)
    cap.report("e", 6, 3, 1.0, kv_usage=0.93, kv_tokens=KV, prefill=4000, need=700)
    assert cap.limit("e") == 6
    # free pages under the smallest prompt sent there: memory, though under FULL
    cap2 = Capacity()
    for t in (0.0, 0.5):
        cap2.report("e", 5, 2, t, kv_usage=0.8, kv_tokens=KV, prefill=3000, need=1700)
    assert cap2.limit("e") == 5
    # preemptions since the last report (a counter): memory
    cap3 = Capacity()
    cap3.report("e", 8, 0, 0.0, preemptions=3.0)
    cap3.report("e", 5, 2, 0.5, kv_usage=0.5, preemptions=4.0, prefill=5000)
    cap3.report("e", 5, 2, 1.0, kv_usage=0.5, preemptions=6.0, prefill=5000)
    assert cap3.limit("e") == 5
    cap4 = Capacity()  # the same counter standing still: no preemption, no limit
    for t in (0.0, 0.5, 1.0):
        cap4.report("e", 5, 2, t, kv_usage=0.5, preemptions=4.0, prefill=5000)
    assert cap4.limit("e") is None


def test_deferred_waiting_never_counts() -> None:
    cap = Capacity()
    for t in (0.0, 0.5, 1.0):  # all deferred (a LoRA budget, a KV transfer): nothing
        cap.report("e", 4, 3, t, deferred=3, kv_usage=0.95, prefill=30)
    assert cap.limit("e") is None and cap.first("e") is None
    for t in (1.5, 2.0):  # two of three deferred: one waits for a slot
        cap.report("e", 4, 3, t, deferred=2, kv_usage=0.1, prefill=30)
    assert cap.limit("e") == 4


def _e2e_trace(tmp: Path, seed: int = 0) -> Any:
    """100 prompts of 500-1,800 distinct tokens, 16-token answers, 4 a second."""
    rng = random.Random(seed)
    lines, t, block = [], 0.0, 0
    for _ in range(100):
        t += rng.expovariate(4.0)
        n = rng.randint(500, 1800)
        k = -(-n // 512)
        lines.append({
            "timestamp": int(t * 1000), "input_length": n, "output_length": 16,
            "hash_ids": list(range(block, block + k)),
        })  # fmt: skip
        block += k
    return load_trace(write(tmp / "e2e.jsonl", lines), block_size=32)


# bench/sweep.py's "cpu": bench/e2e.py's vLLM CPU engines as measured
CPU = {
    "prefill_ms_per_token": 0.15, "attn_ms_per_token_ctx": 2e-4, "decode_ms_per_step": 12,
    "decode_ms_per_kv_token": 1e-6, "max_batch_tokens": 2048,
}  # fmt: skip


def _run(trace: Any, blocks: int) -> tuple[dict[str, Any], int, list[int | None]]:
    config = SimConfig(
        workers=2, l1_blocks=blocks, max_num_seqs=8, costs=EngineCosts.from_config(CPU),
        admission=AdmissionSettings(),
    )  # fmt: skip
    sim = Simulation(trace, "cache_aware", config)
    report = sim.run()
    assert sim.admission is not None
    core = sim.admission.core
    held = sum(s.queued for s in core.stats.series.values())
    return report, held, [core.capacity.limit(t) for t in sim.targets]


def test_simulated_vllm_engines_hold_nothing_for_their_token_budget(tmp_path: Path) -> None:
    """The simulator's engines of bench/e2e.py's shape with KV room to spare (4,096
    pages): the budget keeps requests waiting, neither slots nor memory do. Until
    session 21 admission learnt limits of 8 there and held 19 requests."""
    trace = _e2e_trace(tmp_path)
    off = Simulation(
        trace, "cache_aware",
        SimConfig(workers=2, l1_blocks=4096, max_num_seqs=8, costs=EngineCosts.from_config(CPU)),
    ).run()  # fmt: skip
    on, held, limits = _run(trace, 4096)
    assert held == 0 and limits == [None, None]
    assert on["ttft_p50_ms"] == off["ttft_p50_ms"] and on["ttft_p99_ms"] == off["ttft_p99_ms"]
    # the same engines with 256 pages: their KV caches fill, and that is learnt
    _, held, limits = _run(trace, 256)
    assert any(limit is not None for limit in limits)


def test_engine_reports_carry_why_requests_wait() -> None:
    text = "\n".join((
        '# TYPE vllm:num_requests_running gauge',
        'vllm:num_requests_running{engine="0",model_name="m"} 4.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 1.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 2.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:num_preemptions_total{engine="0",model_name="m"} 7.0',
        'vllm:cache_config_info{block_size="32",enable_prefix_caching="True",'
        'engine="0",num_gpu_blocks="256"} 1.0',
    ))  # fmt: skip
    load = parse_engine_metrics(text)
    assert (load.running, load.waiting, load.deferred) == (4, 3, 2)
    assert (load.preemptions, load.kv_tokens, load.kv_usage) == (7.0, KV, 0.25)
    sized = text.replace('engine="0",num_gpu_blocks', 'kv_cache_size_tokens="9000",num_gpu_blocks')
    assert parse_engine_metrics(sized).kv_tokens == 9000
    sglang = "sglang:num_running_reqs 2\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n"
    sglang += "sglang:max_total_num_tokens 65536\n"
    assert parse_engine_metrics(sglang).kv_tokens == 65536
    old = parse_engine_metrics("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n")
    assert (old.deferred, old.preemptions, old.kv_tokens) == (None, None, None)
    # through the node agent's kv.load report and back
    report = orjson.dumps(parse_load(text, ts=1.0).to_json())
    assert parse_load_report(report) == load
    bare = orjson.dumps({"running": 1, "waiting": 0, "kv_usage": 0.1, "ts": 1.0})
    assert parse_load_report(bare) == EngineLoad(1, 0, 0.1)
    for forged in ({"deferred": -1}, {"preemptions": -1.0}, {"kv_tokens": 1e300}):
        body = {"running": 1, "waiting": 0, "kv_usage": 0.1, "ts": 1.0, **forged}
        with pytest.raises(ValueError):
            parse_load_report(orjson.dumps(body))


class _Registry:
    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    def __iter__(self) -> Iterator[Any]:
        return iter(self.workers)

    def watch_moves(self, hook: Any) -> None:
        pass


def test_the_gate_hands_on_the_prompts_an_engine_has_not_started() -> None:
    """What the router has sent an engine and seen no first token of is what tells a
    spent budget from full slots: the gate passes it with each report."""
    load = WorkerLoad()
    worker = SimpleNamespace(id="e0", load=load, targets=("e0",))
    gate = Gate(AdmissionSettings(), cast("Any", None), cast("Any", _Registry([worker])))
    flights = [load.begin(tokens, now=0.0) for tokens in (1500, 900, 700)]
    for i in range(3):  # 3 running, 2 waiting behind 3,100 tokens not started: compute
        load.report(EngineLoad(3, 2, 0.3, kv_tokens=KV), now=float(i))
        gate.poll()
    assert gate.core.capacity.limit("e0") is None
    for f in flights:  # their first tokens: the engine prefilled them since its report
        f.first_byte()
    small = [load.begin(20, now=1.0) for _ in range(5)]  # short prompts behind full slots
    load.report(EngineLoad(3, 2, 0.3, kv_tokens=KV), now=10.0)
    gate.poll()
    assert gate.core.capacity.first("e0") is None  # those 3,100 tokens spent its steps
    for i in range(2):  # then 100 tokens to start and 3 running: slots keep them waiting
        load.report(EngineLoad(3, 2, 0.3, kv_tokens=KV), now=11.0 + i)
        gate.poll()
    assert gate.core.capacity.limit("e0") == 3
    assert len(small) == 5


def test_the_mock_engine_reports_waiting_as_vllm_does() -> None:
    """A request that comes during a step is in vLLM's input queue, not waiting, until
    the next schedule: the mock says waiting only for what a schedule left there."""
    cache = PrefixCache(16, 64)
    sched = Scheduler(cache, Timing(speed=1e6), lambda events: None, max_num_seqs=1)

    def seq(n: int) -> Sequence:
        return Sequence(list(range(n, n + 8)), [], 4, ["x"] * 4, "length")

    sched.submit(seq(0))
    assert sched.reported_waiting == 0  # not scheduled yet: vLLM's input queue

    async def steps() -> None:
        await sched._step()  # takes the first into its one slot
        sched.submit(seq(100))  # arrives during the step
        assert len(sched.waiting) == 1 and sched.reported_waiting == 0
        await sched._step()  # the slot is taken: the schedule leaves it waiting
        assert sched.reported_waiting == 1

    import asyncio

    asyncio.run(steps())
