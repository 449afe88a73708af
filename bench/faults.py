"""The fault run: bounded load through two router replicas while engines, agents, NATS
and a router are killed, frozen and restarted; every request accounted for by cause.

Processes: a ``nats-server`` (JetStream store kept across its restart), ``--engines``
mock engines (KV events over ZMQ, each logging every request id it receives to a file
that outlives the process), one ``cache-router agent`` per engine, two ``cache-router
serve`` replicas reading the event stream. ``--concurrency`` clients send completions
(every fourth streamed) round-robin over the replicas until the schedule ends:

    t= 4 s  engine e0 SIGKILL        t= 7 s  e0 started again (same ports, empty)
    t=11 s  engine e1 SIGSTOP        t=15 s  SIGCONT
    t=18 s  agent a1 SIGKILL         t=20 s  a1 started again
    t=23 s  NATS stopped             t=27 s  started again on its port, store kept
    t=31 s  router r0 SIGTERM        t=34 s  r0 started again
    t=38 s  load stops; the replicas must be in sync again

A client that cannot connect to a replica (it is restarting) sends the request to the
other one, as a load balancer would: nothing was sent. Each request ends *served* (a
200 with its own id echoed and a complete body) or *failed* with a cause; failures are
split by whether an engine ever received the id. *Duplicated*: ids engines received
more than once (a request retried after it may have run). *Lost*: neither served nor
failed clearly (a hang past the client's timeout, a 200 with a cut or foreign body).

    flock /work/bench.lock nice -n 5 python bench/faults.py [--concurrency 16]

``--migration``: what moving a broken stream costs (router.forward.migrate). Four mock
engines (1x speed: 50 tokens/s per request, 10K prompt tokens/s) behind their agents and
one router; eight conversations with long contexts, each cached on two engines (sent to
them directly: their KV events tell the router); two streams per conversation through
the router; the engine carrying the most streams is SIGKILLed once every stream has its
first tokens. Per migrated stream: the gap the client saw (the longest pause between two
tokens, the break's) and the extra prefill (the continuation's prompt tokens the new
engine did not have cached: the original prompt plus the tokens sent, less its
``cached_tokens``), once with the router's cache-aware choice of the new engine, once
with ``random`` (the replay to any healthy engine other routers do). Every stream must
complete with its full length.

    flock /tmp/cpu-heavy.lock python bench/faults.py --migration

Prints one JSON object; never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from itertools import pairwise
from pathlib import Path
from typing import Any

import orjson
from load import MODEL, complete, processes, request, samples, serve_counted, wait_ready

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.forward.upstream import ConnectFailed, Upstream, UpstreamError  # noqa: E402
from sim.mock.natsd import EmbeddedNats, free_ports  # noqa: E402

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ADMIN = "fault-admin"
SCHEDULE: list[tuple[float, str, str]] = [
    (4, "kill", "e0"), (7, "start", "e0"),
    (11, "stop", "e1"), (15, "cont", "e1"),
    (18, "kill", "a1"), (20, "start", "a1"),
    (23, "kill", "nats"), (27, "start", "nats"),
    (31, "term", "r0"), (34, "start", "r0"),
]  # fmt: skip
END = 38.0


# -- the engine: a mock engine that logs the ids it receives (load.IdCounter) ---------------


async def serve_engine(args: argparse.Namespace) -> None:
    from sim.mock.engine import MockEngine, MockEngineConfig
    from sim.mock.scheduler import Timing

    cfg = MockEngineConfig(
        port=args.engine_port,
        worker_id=args.worker_id,
        model=MODEL,
        gpu_blocks=4096,
        max_num_seqs=256,
        timing=Timing(speed=args.speed),
        zmq_endpoint=args.zmq,
        replay_endpoint=args.replay,
    )
    await serve_counted(MockEngine(cfg), args.ids_file)


# -- the stack ------------------------------------------------------------------------------


class Stack:
    def __init__(self, args: argparse.Namespace, tmp: Path, procs: list[Any]) -> None:
        self.args = args
        self.tmp = tmp
        self.procs = procs
        n = args.engines
        ports = free_ports(4 * n + 2)
        self.engine_ports = ports[:n]
        self.zmq = ports[n : 2 * n]
        self.replay = ports[2 * n : 3 * n]
        self.router_ports = ports[3 * n : 3 * n + 2]
        self.nats = EmbeddedNats(store=tmp / "js").start()
        self.live: dict[str, subprocess.Popen[bytes]] = {}
        self.log: list[dict[str, Any]] = []

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        err = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
        self.live[name] = proc
        self.procs.append(proc)

    def start(self, name: str) -> None:
        py = sys.executable
        kind, i = name[0], int(name[1:])
        if kind == "e":
            self._spawn(name, [
                py, __file__, "--engine-port", str(self.engine_ports[i]), "--worker-id", name,
                "--speed", str(self.args.speed), "--zmq", f"tcp://127.0.0.1:{self.zmq[i]}",
                "--replay", f"tcp://127.0.0.1:{self.replay[i]}",
                "--ids-file", str(self.tmp / f"ids-{name}.txt"),
            ])  # fmt: skip
        elif kind == "a":
            self._spawn(name, [
                py, "-m", "router.cli", "agent", "--worker-id", f"e{i}",
                "--zmq-endpoint", f"tcp://127.0.0.1:{self.zmq[i]}",
                "--replay-endpoint", f"tcp://127.0.0.1:{self.replay[i]}",
                "--engine-url", f"http://127.0.0.1:{self.engine_ports[i]}",
                "--nats-url", self.nats.url, "--log-level", "WARNING",
            ])  # fmt: skip
        else:
            env = {
                **os.environ,
                "CACHE_ROUTER_HEALTH_INTERVAL": "0.5",
                "CACHE_ROUTER_HEALTH_TIMEOUT": "0.5",
                "CACHE_ROUTER_BLIND_AFTER": "0.5",
                "CACHE_ROUTER_DRAIN_TIMEOUT": "10",
            }
            workers = [
                f"--worker=e{j}=http://127.0.0.1:{p}" for j, p in enumerate(self.engine_ports)
            ]
            self._spawn(name, [
                py, "-m", "router.cli", "serve", "--port", str(self.router_ports[i]),
                "--nats-url", self.nats.url, "--replica-id", name, "--admin-token", ADMIN,
                "--log-level", "warning", *workers,
            ], env)  # fmt: skip

    def act(self, action: str, name: str, t: float) -> None:
        self.log.append({"t": round(t, 1), "action": action, "target": name})
        if name == "nats":
            if action == "kill":
                self.nats.stop()
            else:
                self.nats.start()
            return
        proc = self.live[name]
        if action == "start":
            self.start(name)
        elif action == "kill":
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        elif action == "term":
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        elif action == "stop":
            proc.send_signal(signal.SIGSTOP)
        elif action == "cont":
            proc.send_signal(signal.SIGCONT)

    def index_state(self) -> dict[str, Any]:
        out = {}
        for i, port in enumerate(self.router_ports):
            status, body = http_get_auth(port, "/admin/index")
            info = orjson.loads(body) if status == 200 else {}
            pools = info.get("pools", {})
            out[f"r{i}"] = {
                "in_sync": {w: s for p in pools.values() for w, s in p["in_sync"].items()},
                "events_applied": sum(p["events_applied"] for p in pools.values()),
                "nats_connected": info.get("nats", {}).get("connected"),
            }
        return out


def http_get_auth(port: int, path: str) -> tuple[int, bytes]:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            f"GET {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ADMIN}\r\n"
            "connection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head[9:12]), body


# -- the client -------------------------------------------------------------------------------


async def drive(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    urls = [f"http://127.0.0.1:{p}" for p in stack.router_ports]
    upstream = Upstream(connect_timeout=5.0, max_idle=args.concurrency)
    outcome: dict[str, str] = {}  # request id -> "served" or the failure's cause
    failed_at: dict[str, list[float]] = {}  # cause -> seconds into the run
    rerouted = Counter[str]()
    stop = asyncio.Event()
    counter = iter(range(1 << 30))
    t0 = time.monotonic()

    async def one(i: int) -> None:
        stream = i % 4 == 0
        body, headers = request(i, stream, args.max_tokens)
        rid = f"load-{i}"
        for attempt in range(len(urls) * 3):
            url = urls[(i + attempt) % len(urls)]
            try:
                resp = await upstream.send(url, "/v1/completions", headers, body, args.timeout)
                try:
                    chunks = [c async for c in resp.chunks(args.timeout)]
                finally:
                    resp.close()
            except ConnectFailed:
                rerouted["router_unreachable"] += 1  # nothing sent: another replica
                await asyncio.sleep(0.1)
                continue
            except UpstreamError as exc:
                outcome[rid] = f"transport_{type(exc).__name__}"
                return
            data = b"".join(chunks)
            if resp.status != 200:
                try:
                    code = orjson.loads(data)["error"]["code"]
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    code = "?"
                outcome[rid] = f"status_{resp.status}_{code}"
            elif (resp.header(b"x-echo-request-id") or b"").decode() != rid:
                outcome[rid] = "lost_wrong_echo"
            elif not complete(data, stream):
                broken = stream and b"upstream_broken" in data
                outcome[rid] = "stream_upstream_broken" if broken else "lost_incomplete_body"
            else:
                outcome[rid] = "served"
            return
        outcome[rid] = "no_replica_reachable"

    async def client() -> None:
        while not stop.is_set():
            i = next(counter)
            await one(i)
            cause = outcome[f"load-{i}"]
            if cause != "served":
                failed_at.setdefault(cause, []).append(round(time.monotonic() - t0, 1))

    async def faults() -> None:
        for at, action, name in SCHEDULE:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
            await asyncio.to_thread(stack.act, action, name, time.monotonic() - t0)
            if action == "start" and name[0] in "er":
                port = (stack.engine_ports if name[0] == "e" else stack.router_ports)[int(name[1:])]
                await asyncio.to_thread(wait_ready, port, stack.live[name])
        await asyncio.sleep(max(0.0, END - (time.monotonic() - t0)))
        stop.set()

    clients = [asyncio.create_task(client()) for _ in range(args.concurrency)]
    await faults()
    await asyncio.gather(*clients)
    upstream.close()
    return {
        "outcome": outcome,
        "failed_at": failed_at,
        "rerouted": dict(rerouted),
        "wall_s": time.monotonic() - t0,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp, processes() as procs:
        stack = Stack(args, Path(tmp), procs)
        try:
            for i in range(args.engines):
                stack.start(f"e{i}")
            for i in range(args.engines):
                wait_ready(stack.engine_ports[i], stack.live[f"e{i}"])
                stack.start(f"a{i}")
            for i in range(2):
                stack.start(f"r{i}")
                wait_ready(stack.router_ports[i], stack.live[f"r{i}"])
            result = asyncio.run(drive(stack, args))
            deadline = time.monotonic() + 30
            while True:  # the replicas must converge once the faults are over
                state = stack.index_state()
                synced = all(all(r["in_sync"].values()) for r in state.values())
                if synced or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            seen: Counter[str] = Counter()
            for i in range(args.engines):
                path = Path(tmp) / f"ids-e{i}.txt"
                if path.exists():
                    seen.update(line for line in path.read_text().split("\n") if line)
        finally:
            stack.nats.stop()
    outcome: dict[str, str] = result["outcome"]
    causes = Counter(v for v in outcome.values() if v != "served")
    reached = Counter(v for k, v in outcome.items() if v != "served" and k in seen)
    never = Counter(v for k, v in outcome.items() if v != "served" and k not in seen)
    lost = Counter(v for v in outcome.values() if v.startswith("lost_"))
    return {
        "requests": len(outcome),
        "served": sum(1 for v in outcome.values() if v == "served"),
        "failed_by_cause": dict(causes),
        "failed_reached_an_engine": dict(reached),
        "failed_never_reached_an_engine": dict(never),
        "lost": sum(lost.values()),
        "duplicated": sum(1 for n in seen.values() if n > 1),
        "failed_at_s": {cause: ts[:20] for cause, ts in result["failed_at"].items()},
        "rerouted_by_client": result["rerouted"],
        "index_after": state,
        "converged": synced,
        "faults": stack.log,
        "wall_s": round(result["wall_s"], 1),
        "concurrency": args.concurrency,
        "engines": args.engines,
        "cpu_count": os.cpu_count(),
    }


# -- the migration's cost -------------------------------------------------------------------

CONTEXT_TOKENS = 2000  # per conversation (the fallback tokenizer: 4 bytes a token)


def context(c: int) -> str:
    words = f"conversation {c:02d} keeps its own long context in the engines' caches. "
    return (words * (4 * CONTEXT_TOKENS // len(words) + 1))[: 4 * CONTEXT_TOKENS]


async def migration_round(stack: Stack) -> dict[str, Any]:
    """One round on a running stack: warm, stream, kill the busiest engine, measure."""
    import httpx

    args = stack.args
    engine_urls = [f"http://127.0.0.1:{p}" for p in stack.engine_ports]
    router_url = f"http://127.0.0.1:{stack.router_ports[0]}"
    n = len(engine_urls)
    async with httpx.AsyncClient(timeout=120) as http:
        for c in range(8):  # each context on two engines, sent to them directly
            for e in (c % n, (c + 1) % n):
                body = {"model": MODEL, "prompt": context(c), "max_tokens": 1}
                (await http.post(engine_urls[e] + "/v1/completions", json=body)).raise_for_status()
        await asyncio.sleep(1.0)  # their KV events reach the router
        started = [asyncio.Event() for _ in range(16)]

        async def stream(i: int) -> dict[str, Any]:
            body = {
                "model": MODEL, "prompt": context(i % 8) + f" question {i}:",
                "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
            }  # fmt: skip
            times: list[float] = []
            usage: dict[str, Any] = {}
            done = 0
            worker, error = "", None
            try:
                async with http.stream("POST", router_url + "/v1/completions", json=body) as resp:
                    worker = resp.headers.get("x-cache-router-worker", "")
                    async for line in resp.aiter_lines():
                        if line == "data: [DONE]":
                            done += 1
                        elif line.startswith("data: {"):
                            obj = orjson.loads(line[6:])
                            usage = obj.get("usage") or usage
                            if any(ch.get("text") for ch in obj.get("choices", [])):
                                times.append(time.perf_counter())
                                if len(times) == 5:
                                    started[i].set()
            except httpx.HTTPError as exc:  # counted: the stream did not complete
                error = type(exc).__name__
            started[i].set()
            return {"worker": worker, "times": times, "usage": usage, "done": done, "error": error}

        tasks = [asyncio.create_task(stream(i)) for i in range(16)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        victim = await asyncio.to_thread(busiest, stack)
        await asyncio.to_thread(stack.act, "kill", victim, 0.0)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    moved = [r for r in results if r["worker"] == victim]
    gaps, extra = [], []
    for r in moved:
        steps = [b - a for a, b in pairwise(r["times"])]
        if not steps:
            continue
        at = max(range(len(steps)), key=steps.__getitem__)  # the break: the longest pause
        gaps.append(steps[at])
        prompt = int(r["usage"].get("prompt_tokens", 0))
        cached = int((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        extra.append(prompt + at + 1 - cached)  # the prompt and the tokens sent, less the hit
    return {
        "victim": victim,
        "migrated_streams": len(moved),
        "all_complete_full_length": all(
            len(r["times"]) == args.max_tokens and r["done"] == 1 and r["error"] is None
            for r in results
        ),
        "gap_ms": percentiles(gaps),
        "extra_prefill_tokens": percentiles(extra, scale=1),
        "extra_prefill_total": sum(extra),
    }


def run_migration(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"engines": 4, "streams": 16, "max_tokens": args.max_tokens}
    for policy in ("cache_aware", "random"):
        with tempfile.TemporaryDirectory(prefix="migrate-") as tmp, processes() as procs:
            args.engines = 4
            stack = Stack(args, Path(tmp), procs)
            try:
                for i in range(4):
                    stack.start(f"e{i}")
                for i in range(4):
                    wait_ready(stack.engine_ports[i], stack.live[f"e{i}"])
                    stack.start(f"a{i}")
                env = {**os.environ, "CACHE_ROUTER_POLICY": policy}
                workers = [f"--worker=e{j}=http://127.0.0.1:{p}" for j, p in
                           enumerate(stack.engine_ports)]  # fmt: skip
                stack._spawn("r0", [
                    sys.executable, "-m", "router.cli", "serve",
                    "--port", str(stack.router_ports[0]), "--nats-url", stack.nats.url,
                    "--admin-token", ADMIN, "--log-level", "warning", *workers,
                ], {**env, "CACHE_ROUTER_HEALTH_INTERVAL": "0.5",
                    "CACHE_ROUTER_HEALTH_TIMEOUT": "0.5"})  # fmt: skip
                wait_ready(stack.router_ports[0], stack.live["r0"])
                out[policy] = asyncio.run(migration_round(stack))
            finally:
                stack.nats.stop()
    return out


def busiest(stack: Stack) -> str:
    """The engine running the most requests now (its /metrics)."""
    counts = {}
    for i, port in enumerate(stack.engine_ports):
        status, body = http_get_auth(port, "/metrics")
        running = sum(v for _, v in samples(body.decode(), "vllm:num_requests_running"))
        counts[f"e{i}"] = running if status == 200 else -1
    return max(counts, key=lambda k: counts[k])


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * scale, 1)

    return {"p50": at(0.5), "p99": at(0.99), "n": len(ordered)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--speed", type=float, default=200.0, help="mock engine speed factor")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=60.0, help="client wait per request")
    ap.add_argument("--migration", action="store_true", help="the migration's cost instead")
    ap.add_argument("--engine-port", type=int, help=argparse.SUPPRESS)  # internal: engine
    ap.add_argument("--worker-id", default="e0", help=argparse.SUPPRESS)
    ap.add_argument("--zmq", help=argparse.SUPPRESS)
    ap.add_argument("--replay", help=argparse.SUPPRESS)
    ap.add_argument("--ids-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_port:
        import uvloop

        uvloop.run(serve_engine(args))
        return
    with contextlib.suppress(KeyboardInterrupt):
        if args.migration:
            args.speed = 1.0 if args.speed == 200.0 else args.speed
            args.max_tokens = 160 if args.max_tokens == 8 else args.max_tokens
            print(json.dumps(run_migration(args), indent=2))
        else:
            print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
