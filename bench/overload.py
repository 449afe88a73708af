"""Past saturation: admission at the router against the policies without it (issue 31).

Two mock engines of known capacity (``--max-num-seqs 4``, ``--decode-tps 100``, answers
of 20 tokens) behind one ``cache-router serve`` per configuration (a policy, admission
on or off). The pool's capacity C is measured first (requests/s, closed loop at twice
the engines' slots). Then, per configuration and per offered load L (multiples of C),
for ``--duration`` seconds, three open-loop Poisson streams of streamed completions:

- ``steady``: tenant ``steady``, priority 0, ``--steady-share`` of C (the well-behaved
  tenant, far under its half of the pool);
- ``urgent``: tenant ``flood``, priority -10, ``--urgent-share`` of C (urgent requests:
  strict priority comes before fair shares);
- ``flood``: tenant ``flood``, priority 0, the rest of L x C (at L = 3 about 5.5x its
  half of the pool).

Tenants travel in ``x-tenant-id``, priorities in the body's ``priority`` (vLLM's field).
A baseline run without the flood gives each stream's TTFT "alone". Reported per run:
each stream's TTFT p50/p99 (time to the first token chunk), the steady stream's p99
over its baseline and the urgent one's over its unloaded value, goodput (requests/s
answered 200 with TTFT within ``--slo``), shed answers by code with their latency (a
``queue_timeout`` counted from its deadline) and whether each carried ``Retry-After``,
and *lost*: requests with no complete answer (an error, a cut stream, no answer within
``--client-timeout``).

    flock /tmp/cpu-heavy.lock python bench/overload.py [--loads 0.5,1,2,3] [--duration 6]

Prints one JSON object; never asserts. The router's admission settings come from its
config (defaults), but for what this script varies per configuration, each a list:
``--queue-timeout`` (``CACHE_ROUTER_QUEUE_TIMEOUT``), ``--lifo on,off``
(``queue_lifo``: a standing queue newest first), ``--engine-priority off,on``
(``engine_priority_scheduling``: urgent requests sent past a full engine) and
``--pool-reserve off,on`` (``pool_reserve``: idle slots kept for entitled requests). The mock
engines run ``--scheduling-policy priority`` (as the vLLM ones: vLLM refuses a request's
priority under FCFS). Each result carries the machine's load average (``loadavg``) and
``starved``: the seconds the router's event-loop thread and the client's waited runnable
for a CPU during the run (the kernel's ``schedstat`` run delay), and how late the
client's loop woke at most. On the 2-core machine with real vLLM engines beside them both
waited seconds: shed answers took up to 1-3 s from the client's clock while the router
sent each within a few ms of its decision (``--engine-nice`` helps only in part).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.load import (  # noqa: E402
    http_get,
    processes,
    samples,
    stream_complete,
    wait_ready,
)
from router.forward.upstream import Upstream, UpstreamError  # noqa: E402
from sim.mock.natsd import free_ports  # noqa: E402

MODEL = "overload-model"
RUN = ["r0"]  # the current run's tag, the first part of every request id
MAX_TOKENS = [20]  # the answers' length (--max-tokens)
STREAMS = ("steady", "urgent", "flood")
# stream -> (tenant, priority)
WHO = {"steady": ("steady", 0), "urgent": ("flood", -10), "flood": ("flood", 0)}


@dataclass
class Outcome:
    stream: str
    sent: float
    status: int = 0
    ttft: float | None = None  # seconds to the first token chunk
    answered: float | None = None  # seconds to the response's head (shed answers)
    code: str = ""
    retry_after: bool = False
    complete: bool = False
    error: str = ""
    rid: str = ""  # its x-request-id (``--requests-out``)
    worker: str = ""  # the engine the router chose (x-cache-router-worker)


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    loop_lag_max: float = 0.0  # the client's event loop, seconds late at most
    loop_lags: int = 0  # wake-ups more than LAG late


LAG = 0.02  # a wake-up of the client's loop this late counts as a lag


def runnable_wait(tid: int | None = None) -> float:
    """Seconds a thread (None: this one) has waited runnable for a CPU, in all: the
    kernel's ``schedstat`` run delay (0 where there is none). A loop that is late while
    this grows as much was starved by the machine, not busy."""
    path = "/proc/thread-self/schedstat" if tid is None else f"/proc/{tid}/task/{tid}/schedstat"
    try:
        return int(Path(path).read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


async def _watch_loop(run: Run, every: float = 0.01) -> None:
    """How late this loop wakes (a starved client measures every answer late)."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(every)
        late = loop.time() - t - every
        if late > LAG:
            run.loop_lags += 1
            run.loop_lag_max = max(run.loop_lag_max, late)


def _body(stream: str, i: int) -> bytes:
    tenant, priority = WHO[stream]
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": f"{tenant} request {i}: write twenty short words about queues, please.",
        "max_tokens": MAX_TOKENS[0],
        "ignore_eos": True,
        "stream": True,
    }
    if priority:
        body["priority"] = priority
    return orjson.dumps(body)


async def _one(
    upstream: Upstream, url: str, stream: str, i: int, timeout: float, out: list[Outcome]
) -> None:
    tenant, _ = WHO[stream]
    o = Outcome(stream, time.perf_counter(), rid=f"{RUN[0]}-{stream}-{i}")
    headers = [(b"content-type", b"application/json"), (b"x-tenant-id", tenant.encode()),
               (b"x-request-id", o.rid.encode())]  # fmt: skip
    out.append(o)
    try:
        async with asyncio.timeout(timeout):
            resp = await upstream.send(url, "/v1/completions", headers, _body(stream, i), timeout)
            o.status = resp.status
            o.answered = time.perf_counter() - o.sent
            o.retry_after = resp.header(b"retry-after") is not None
            o.worker = (resp.header(b"x-cache-router-worker") or b"").decode()
            body = b""
            try:
                async for chunk in resp.chunks(timeout):
                    if o.ttft is None and resp.status == 200 and b'"text"' in chunk:
                        o.ttft = time.perf_counter() - o.sent
                    body += chunk
            finally:
                resp.close()
    except TimeoutError:
        o.error = "client_timeout"
        return
    except UpstreamError as exc:
        o.error = type(exc).__name__
        return
    if o.status == 200:
        o.complete = stream_complete(body)
        if not o.complete:
            o.error = "incomplete"
    else:
        try:
            o.code = orjson.loads(body)["error"]["code"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            o.code = "?"


async def _offer(
    url: str, rates: dict[str, float], duration: float, timeout: float, seed: int
) -> Run:
    """Open loop: each stream a Poisson process at its rate for ``duration`` seconds."""
    upstream = Upstream(connect_timeout=10.0, max_idle=512)
    run = Run()
    tasks: list[asyncio.Task[None]] = []
    watch = asyncio.create_task(_watch_loop(run))

    async def stream(name: str, rate: float) -> None:
        rng = random.Random(f"{seed}:{name}")
        t0 = time.perf_counter()
        at, i = 0.0, 0
        while rate > 0:
            at += rng.expovariate(rate)
            if at >= duration:
                return
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(upstream, url, name, i, timeout, run.outcomes)))
            i += 1

    await asyncio.gather(*(stream(n, r) for n, r in rates.items()))
    await asyncio.gather(*tasks)
    watch.cancel()
    upstream.close()
    return run


async def _capacity(url: str, seconds: float, concurrency: int) -> float:
    """Requests/s of the pool, closed loop (``concurrency`` clients, no think time)."""
    upstream = Upstream(connect_timeout=10.0, max_idle=concurrency)
    done = 0
    end = time.perf_counter() + seconds
    out: list[Outcome] = []

    async def client(k: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < end:
            await _one(upstream, url, "steady", k * 100_000 + i, 30.0, out)
            i += 1
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(concurrency)))
    upstream.close()
    return done / (time.perf_counter() - t0)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _summary(run: Run, duration: float, slo: float, queue_timeout: float) -> dict[str, Any]:
    by: dict[str, list[Outcome]] = defaultdict(list)
    for o in run.outcomes:
        by[o.stream].append(o)
    streams = {}
    for name, outs in by.items():
        ttft = [o.ttft for o in outs if o.ttft is not None and o.complete]
        streams[name] = {
            "sent": len(outs),
            "ok": sum(o.complete for o in outs),
            "ttft_p50_s": _pct(ttft, 0.5),
            "ttft_p99_s": _pct(ttft, 0.99),
            "shed": sum(o.status in (429, 503) for o in outs),
        }
    shed = [o for o in run.outcomes if o.status in (429, 503)]
    shed_latency = [
        (o.answered or 0.0) - (queue_timeout if o.code == "queue_timeout" else 0.0) for o in shed
    ]
    good = [o for o in run.outcomes if o.complete and o.ttft is not None and o.ttft <= slo]
    lost = [o for o in run.outcomes if not o.complete and o.status not in (429, 503)]
    return {
        "sent": len(run.outcomes),
        "ok": sum(o.complete for o in run.outcomes),
        "goodput_rps": len(good) / duration,
        "streams": streams,
        "shed": dict(Counter(f"{o.status} {o.code}" for o in shed)),
        "shed_without_retry_after": sum(not o.retry_after for o in shed),
        "shed_answer_p50_ms": None if not shed else 1000 * (_pct(shed_latency, 0.5) or 0.0),
        "shed_answer_max_ms": None if not shed else 1000 * max(shed_latency),
        "lost": len(lost),
        "lost_by": dict(Counter(o.error or f"status {o.status} {o.code}" for o in lost)),
    }


def _scrape(port: int) -> str:
    return http_get(port, "/metrics")[1].decode()


def _engine_load(port: int) -> tuple[float, float]:
    """An engine's (running, waiting) from its ``/metrics``."""
    text = _scrape(port)
    running = sum(v for _, v in samples(text, "vllm:num_requests_running"))
    return running, sum(v for _, v in samples(text, "vllm:num_requests_waiting"))


def _router_limits(port: int) -> dict[str, float]:
    """The limits admission learnt, per worker (``cache_router_admission_limit``)."""
    return {
        labels["worker"]: v
        for labels, v in samples(_scrape(port), "cache_router_admission_limit")
    }


class Sampler(threading.Thread):
    """The engines' running and waiting every ``every`` seconds while a run lasts: where
    the requests wait (in the engines' queues, or at the router); with ``router``, the
    limits its admission learnt, every fifth sample."""

    def __init__(self, ports: list[int], every: float = 0.05, router: int | None = None) -> None:
        super().__init__(daemon=True)
        self.ports, self.every, self.router = ports, every, router
        self.samples: list[list[tuple[float, float]]] = [[] for _ in ports]
        self.limits: dict[str, list[float]] = defaultdict(list)
        self.stop = threading.Event()

    def run(self) -> None:
        tick = 0
        while not self.stop.wait(self.every):
            for i, port in enumerate(self.ports):
                with contextlib.suppress(OSError):
                    self.samples[i].append(_engine_load(port))
            tick += 1
            if self.router is not None and tick % 5 == 0:
                with contextlib.suppress(OSError):
                    for worker, limit in _router_limits(self.router).items():
                        self.limits[worker].append(limit)

    def summary(self) -> dict[str, Any]:
        out = {}
        for i, loads in enumerate(self.samples):
            if not loads:
                continue
            waiting = [w for _, w in loads]
            out[f"e{i}"] = {
                "running_mean": round(sum(r for r, _ in loads) / len(loads), 2),
                "waiting_mean": round(sum(waiting) / len(waiting), 2),
                "waiting_max": max(waiting),
                "waiting_share": round(sum(w > 0 for w in waiting) / len(waiting), 2),
            }
        for worker, limits in sorted(self.limits.items()):
            out.setdefault(worker, {})["learnt_limit"] = {
                "mean": round(sum(limits) / len(limits), 2), "min": min(limits),
                "max": max(limits), "samples": len(limits),
            }  # fmt: skip
        return out


Waits = dict[tuple[str, str], tuple[list[float], float]]


def _router_waits(port: int) -> Waits:
    """The router's admission wait histograms: (tenant, priority) -> (cumulative bucket
    counts, sum of seconds), from ``cache_router_admission_wait_seconds``."""
    text = _scrape(port)
    out: Waits = {}
    buckets = samples(text, "cache_router_admission_wait_seconds_bucket")
    for labels, value in sorted(buckets, key=lambda b: float(b[0]["le"])):
        out.setdefault((labels["tenant"], labels["priority"]), ([], 0.0))[0].append(value)
    for labels, value in samples(text, "cache_router_admission_wait_seconds_sum"):
        key = (labels["tenant"], labels["priority"])
        out[key] = (out.get(key, ([], 0.0))[0], value)
    return out


def _wait_summary(before: Waits, after: Waits) -> dict[str, Any]:
    """Per stream, between two scrapes: requests admitted, their mean wait at the router,
    and the histogram bucket holding its p99 (upper bound, seconds)."""
    from router.admission.stats import WAIT_BUCKETS

    bounds = [*WAIT_BUCKETS, float("inf")]
    names = {(t, str(p)): s for s, (t, p) in WHO.items()}
    out = {}
    for key, (buckets, total) in after.items():
        old, old_total = before.get(key, ([0.0] * len(buckets), 0.0))
        diff = [a - b for a, b in zip(buckets, old, strict=True)]
        n = diff[-1] if diff else 0.0
        if not n or key not in names:
            continue
        p99 = next(b for b, c in zip(bounds, diff, strict=True) if c >= 0.99 * n)
        out[names[key]] = {
            "admitted": int(n),
            "router_wait_mean_s": round((total - old_total) / n, 4),
            "router_wait_p99_le_s": p99,
        }
    return out


def _idle(ports: list[int], timeout: float = 120.0) -> None:
    """Wait until no engine runs or queues anything (the last run's backlog drained)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(sum(_engine_load(port)) for port in ports):
            return
        time.sleep(0.2)


@dataclass(frozen=True)
class Config:
    policy: str
    admission: bool
    queue_timeout: float
    lifo: bool = True
    engine_priority: bool = False
    pool_reserve: bool = False
    tree: str = ""  # the router's code from this checkout ("": this one)


def _loadavg() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


def _router(procs: list[subprocess.Popen[bytes]], port: int, engines: list[int],
            c: Config) -> subprocess.Popen[bytes]:  # fmt: skip
    env = {
        **os.environ,
        "CACHE_ROUTER_ADMISSION": "true" if c.admission else "false",
        "CACHE_ROUTER_QUEUE_TIMEOUT": str(c.queue_timeout),
        "CACHE_ROUTER_QUEUE_LIFO": "true" if c.lifo else "false",
        "CACHE_ROUTER_ENGINE_PRIORITY_SCHEDULING": "true" if c.engine_priority else "false",
        "CACHE_ROUTER_POOL_RESERVE": "true" if c.pool_reserve else "false",
        # the engines' load as /metrics scrapes, 4 a second (no NATS in this run)
        "CACHE_ROUTER_HEALTH_INTERVAL": "0.25",
        "CACHE_ROUTER_LOAD_STALE_AFTER": "0.2",
    }
    if c.tree:  # its modules first (the shared interpreter may have another installed)
        env["PYTHONPATH"] = c.tree
    workers = [f"--worker=e{i}=http://127.0.0.1:{p}" for i, p in enumerate(engines)]
    cmd = [sys.executable, "-m", "router.cli", "serve", "--port", str(port), "--policy", c.policy,
           "--log-level", "error", *workers]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=c.tree or ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    procs.append(proc)
    wait_ready(port, proc)
    return proc


@contextlib.contextmanager
def _vllm(args: argparse.Namespace, work: Path) -> Iterator[list[int]]:
    """Two real vLLM CPU engines (tests/real_engines/vllm_engine.py's, ``--max-num-seqs``
    slots each, one core each); their ports."""
    sys.path.insert(0, str(ROOT / "tests" / "real_engines"))
    from vllm_engine import Engine, running

    model = work / "model"
    make = [args.vllm_python, str(ROOT / "tests/real_engines/make_model.py"), str(model)]
    subprocess.run(make, check=True, stdout=subprocess.DEVNULL)
    engines = []
    for i in range(args.engines):
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1",
               "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}  # fmt: skip
        # priority scheduling: vLLM refuses a request's priority under FCFS
        extra = ("--max-num-seqs", str(args.max_num_seqs), "--scheduling-policy", "priority")
        engines.append(Engine(f"e{i}", args.vllm_python, model, work, env, "tcp", extra=extra))
    with running(engines):
        if args.engine_nice:
            for e in engines:
                assert e.proc is not None
                _renice(e.proc.pid, args.engine_nice)
        yield [e.port for e in engines]


def _renice(root: int, nice: int) -> None:
    """Every thread of ``root`` and of its descendants at ``nice`` (Linux: a niceness is a
    thread's)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry.name))
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, int(task.name), nice)


def run(args: argparse.Namespace) -> dict[str, Any]:
    MAX_TOKENS[0] = args.max_tokens
    with contextlib.ExitStack() as stack:
        ports = None
        if args.vllm:
            global MODEL
            MODEL = "tiny"  # vllm_engine's served model name
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="overload-")))
            ports = stack.enter_context(_vllm(args, work))
        return _run(args, ports)


def _run(args: argparse.Namespace, vllm_ports: list[int] | None) -> dict[str, Any]:
    py = sys.executable
    quiet = {"cwd": ROOT, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    timeouts = [float(x) for x in str(args.queue_timeout).split(",")]
    onoff = {"on": True, "off": False}
    lifos = [onoff[x] for x in args.lifo.split(",")]
    prios = [onoff[x] for x in args.engine_priority.split(",")]
    reserves = [onoff[x] for x in args.pool_reserve.split(",")]
    configs = [Config(p, False, timeouts[0]) for p in args.policies.split(",") if p]
    configs += [
        Config(p, True, t, lifo, prio, reserve)
        for p in args.admission_policies.split(",")
        if p
        for t in timeouts
        for lifo in lifos
        for prio in prios
        for reserve in reserves
    ]
    if args.compare_tree:  # the same admission configurations on another checkout's code
        tree = str(Path(args.compare_tree).resolve())
        configs += [replace(c, tree=tree) for c in configs if c.admission]
    loads = [float(x) for x in args.loads.split(",")]
    results: list[dict[str, Any]] = []
    with processes() as procs:
        engine_ports = vllm_ports or free_ports(args.engines)
        for i, port in enumerate([] if vllm_ports else engine_ports):
            cmd = [py, "-m", "router.cli", "mock-engine", "--port", str(port), "--model", MODEL,
                   "--worker-id", f"e{i}", "--max-num-seqs", str(args.max_num_seqs),
                   "--scheduling-policy", "priority",
                   "--decode-tps", str(args.decode_tps), "--log-level", "WARNING"]  # fmt: skip
            procs.append(subprocess.Popen(cmd, **quiet))  # type: ignore[call-overload]
        for port, proc in zip(engine_ports, procs, strict=False):
            wait_ready(port, proc)
        # the pool's capacity, and each stream alone, through a router without admission
        (port,) = free_ports(1)
        router = _router(procs, port, engine_ports, Config("least_load", False, timeouts[0]))
        url = f"http://127.0.0.1:{port}"
        capacity = asyncio.run(_capacity(url, args.capacity_seconds, 4 * args.max_num_seqs))
        _idle(engine_ports)
        rates = {"steady": args.steady_share * capacity, "urgent": args.urgent_share * capacity}
        alone = _summary(
            asyncio.run(_offer(url, rates, args.duration, args.client_timeout, args.seed)),
            args.duration, args.slo, timeouts[0],
        )  # fmt: skip
        router.terminate()
        router.wait(10)
        base = {s: alone["streams"][s]["ttft_p99_s"] for s in ("steady", "urgent")}
        for c in configs:
            admission = c.admission
            (port,) = free_ports(1)
            router = _router(procs, port, engine_ports, c)
            url = f"http://127.0.0.1:{port}"
            for k, load in enumerate(loads):
                _idle(engine_ports)
                if k and args.fresh_router:  # nothing learnt in the last run: its onset
                    router.terminate()
                    router.wait(10)
                    (port,) = free_ports(1)
                    router = _router(procs, port, engine_ports, c)
                    url = f"http://127.0.0.1:{port}"
                flood = max(0.0, load * capacity - rates["steady"] - rates["urgent"])
                offered = {**rates, "flood": flood}
                t0 = time.perf_counter()
                waits = _router_waits(port) if admission else {}
                sampler = Sampler(engine_ports, router=port if admission else None)
                sampler.start()
                waited = (runnable_wait(router.pid), runnable_wait())
                RUN[0] = _label(c, load)
                start = time.perf_counter()
                run_ = asyncio.run(
                    _offer(url, offered, args.duration, args.client_timeout, args.seed)
                )
                sampler.stop.set()
                sampler.join()
                starved = {
                    "router_runnable_wait_s": round(runnable_wait(router.pid) - waited[0], 2),
                    "client_runnable_wait_s": round(runnable_wait() - waited[1], 2),
                    "client_loop_lag_max_s": round(run_.loop_lag_max, 3),
                    "client_loop_lags": run_.loop_lags,
                }
                summary = _summary(run_, args.duration, args.slo, c.queue_timeout)
                if args.requests_out:
                    _requests_out(Path(args.requests_out), RUN[0], start, run_)
                st = summary["streams"]
                steady = st.get("steady", {}).get("ttft_p99_s")
                urgent = st.get("urgent", {}).get("ttft_p99_s")
                results.append(
                    {
                        "policy": c.policy,
                        "admission": admission,
                        "queue_timeout_s": c.queue_timeout if admission else None,
                        "lifo": c.lifo if admission else None,
                        "engine_priority": c.engine_priority if admission else None,
                        "pool_reserve": c.pool_reserve if admission else None,
                        "tree": c.tree or None,
                        "load": load,
                        "loadavg": _loadavg(),
                        "offered_rps": {k: round(v, 2) for k, v in offered.items()},
                        "steady_p99_over_alone": _ratio(steady, base["steady"]),
                        "urgent_p99_over_unloaded": _ratio(urgent, base["urgent"]),
                        **summary,
                        "engines": sampler.summary(),
                        "starved": starved,
                        "router_wait": _wait_summary(waits, _router_waits(port))
                        if admission
                        else None,
                        "wall_s": round(time.perf_counter() - t0, 1),
                    }
                )  # fmt: skip
                print(orjson.dumps(results[-1]).decode(), file=sys.stderr)
            router.terminate()
            router.wait(10)
    return {
        "engine": "vllm (CPU)" if vllm_ports else "mock",
        "engines": args.engines,
        "max_num_seqs": args.max_num_seqs,
        "decode_tps": None if vllm_ports else args.decode_tps,
        "max_tokens": MAX_TOKENS[0],
        "capacity_rps": round(capacity, 2),
        "slo_ttft_s": args.slo,
        "duration_s": args.duration,
        "queue_timeouts_s": timeouts,
        "loadavg_at_end": _loadavg(),
        "fresh_router": args.fresh_router,
        "alone": alone,
        "cpu_count": os.cpu_count(),
        "results": results,
    }


def _label(c: Config, load: float) -> str:
    """A run's tag: its configuration and load."""
    if not c.admission:
        return f"{c.policy}-L{load:g}"
    named = (("-lifo", c.lifo), ("-prio", c.engine_priority), ("-reserve", c.pool_reserve),
             ("-" + Path(c.tree).name, bool(c.tree)))  # fmt: skip
    flags = "".join(k for k, on in named if on)
    return f"{c.policy}-adm-qt{c.queue_timeout:g}{flags}-L{load:g}"


def _requests_out(folder: Path, label: str, start: float, run_: Run) -> None:
    """Every request of a run, one JSON line each (``--requests-out``): its stream, when it
    was sent (seconds from the run's start, and on the machine's monotonic clock, which the
    router and the engines share), its TTFT, status, code and engine."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"{label}.jsonl").open("wb") as f:
        for o in run_.outcomes:
            line = {
                "rid": o.rid, "stream": o.stream, "at_s": round(o.sent - start, 4),
                "sent_mono": o.sent, "ttft_s": o.ttft, "status": o.status, "code": o.code,
                "worker": o.worker, "complete": o.complete,
            }  # fmt: skip
            f.write(orjson.dumps(line) + b"\n")


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else round(value / base, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", default="0.5,1,2,3", help="offered load, multiples of capacity")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds of load per run")
    ap.add_argument("--policies", default="cache_aware,least_load,dynamo_kv,sglang_cache_aware")
    ap.add_argument("--admission-policies", default="cache_aware,least_load",
                    help="policies also run with admission on")  # fmt: skip
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--vllm", action="store_true", help="real vLLM CPU engines, not mocks")
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get(
            "CACHE_ROUTER_VLLM_PYTHON", "/tmp/cache-router-vllm-venv/bin/python"
        ),
    )
    ap.add_argument(
        "--engine-nice", type=int, default=0,
        help="with --vllm: the engines' niceness (every thread of theirs), so that the router "
        "and the client, on the same cores, are not starved of CPU by them",
    )  # fmt: skip
    ap.add_argument("--decode-tps", type=float, default=100.0)
    ap.add_argument("--max-tokens", type=int, default=20, help="each answer's length")
    ap.add_argument("--steady-share", type=float, default=0.12)
    ap.add_argument("--urgent-share", type=float, default=0.1)
    ap.add_argument("--slo", type=float, default=0.5, help="goodput's TTFT bound, seconds")
    ap.add_argument("--queue-timeout", default="2", help="seconds, a list: each a configuration")
    ap.add_argument("--lifo", default="on", help="queue_lifo per configuration: on, off or on,off")
    ap.add_argument(
        "--engine-priority", default="off",
        help="engine_priority_scheduling per configuration: off, on or off,on",
    )  # fmt: skip
    ap.add_argument(
        "--pool-reserve", default="off",
        help="pool_reserve per configuration: off, on or off,on",
    )  # fmt: skip
    ap.add_argument("--client-timeout", type=float, default=60.0)
    ap.add_argument("--capacity-seconds", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fresh-router", action="store_true",
        help="a new router for every load, so that each run starts with nothing learnt (the "
        "flood's onset); without, one router per configuration serves its loads in turn",
    )  # fmt: skip
    ap.add_argument(
        "--compare-tree", default="",
        help="another checkout (a path): every admission configuration is also run with the "
        "router's code from there, in the same run (e.g. main against a branch)",
    )  # fmt: skip
    ap.add_argument(
        "--requests-out", default="",
        help="a folder: every request of each run as JSON lines, <configuration>-L<load>.jsonl",
    )  # fmt: skip
    print(orjson.dumps(run(ap.parse_args()), option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
