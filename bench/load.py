"""Bounded load through router replicas: requests/s, latency percentiles, nothing lost.

Spawns ``--engines`` mock engines (``sim.mock.engine`` at ``--speed``, each wrapped so
it counts the ``x-request-id`` of every completion it serves and echoes it back in
``x-echo-request-id``) and ``--replicas`` routers (``cache-router serve``) in front of
all of them, then sends ``--requests`` completions over ``--concurrency`` keep-alive
connections spread over the replicas (every ``--stream-every``-th one streamed).

Each request carries a unique id. A request counts as served when its answer is a 200
with its own id echoed and a complete body (``data: [DONE]`` for streams, a JSON
object with choices otherwise). Afterwards each engine reports how often it saw each
id: *lost* = ids no engine saw or the client did not get served, *duplicated* = ids
engines saw more than once (a router must never replay a request an engine may have
started).

    python bench/load.py [--requests 20000] [--concurrency 256] [--replicas 2]

Prints one JSON object; never asserts (tests/test_load.py runs a small version and
asserts zero lost and zero duplicated).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.forward.upstream import Upstream, UpstreamError  # noqa: E402
from sim.mock.natsd import free_ports  # noqa: E402

MODEL = "load-model"
SYSTEM = "You are a terse assistant in a load test; every answer is short. " * 4
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


# -- the engine side: a mock engine that counts request ids -----------------------------


class IdCounter:
    """ASGI wrapper: counts each completion's ``x-request-id``, echoes it, serves ``/_ids``;
    with ``log_path`` also appends each id to that file (kept through a SIGKILL)."""

    def __init__(self, app: Any, log_path: str | None = None) -> None:
        self.app = app
        self.seen: Counter[str] = Counter()
        self.fd = None if log_path is None else os.open(
            log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/_ids":
            body = orjson.dumps(self.seen)
            headers = [(b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        rid = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if rid is None or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        self.seen[rid.decode()] += 1
        if self.fd is not None:
            os.write(self.fd, rid + b"\n")  # in the kernel at once: a SIGKILL keeps it

        async def echo(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-echo-request-id", rid)]
            await send(message)

        await self.app(scope, receive, echo)


async def serve_engine(port: int, worker_id: str, speed: float) -> None:
    from sim.mock.engine import MockEngine, MockEngineConfig
    from sim.mock.scheduler import Timing

    cfg = MockEngineConfig(
        port=port,
        worker_id=worker_id,
        model=MODEL,
        gpu_blocks=8192,
        max_num_seqs=1024,
        max_num_batched_tokens=65536,
        timing=Timing(speed=speed),
    )
    await serve_counted(MockEngine(cfg))


async def serve_counted(engine: Any, log_path: str | None = None) -> None:
    """Run a mock engine behind ``IdCounter`` until SIGINT or SIGTERM."""
    engine.app = IdCounter(engine.app, log_path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with engine:
        await stop.wait()


# -- the client -----------------------------------------------------------------------------


def request(i: int, stream: bool, max_tokens: int) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    conv = i % 64
    body = {
        "model": MODEL,
        "prompt": f"{SYSTEM} conversation {conv}, question {i}",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    headers = [
        (b"content-type", b"application/json"),
        (b"x-request-id", f"load-{i}".encode()),
        (b"x-session-id", f"conv-{conv}".encode()),
    ]
    return orjson.dumps(body), headers


def stream_complete(body: bytes) -> bool:
    """Whether a streamed answer is whole: its last event is ``data: [DONE]`` and no event
    is an error (an object with a top-level ``"error"``: the router's ``upstream_broken``
    event, an engine's own). Parsed event by event: a token's text may be anything, and
    a generated ``error`` (``"text":"error"``) made a whole answer count as cut when this
    was a search of the body for ``"error"`` (the tiny model's random tokens, once in a
    few real-vLLM runs of bench/overload.py)."""
    last = None
    for event in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(
            line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if not data:
            continue
        last = data
        if data == b"[DONE]":
            continue
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            return False
        if isinstance(parsed, dict) and "error" in parsed:
            return False
    return last == b"[DONE]"


def complete(body: bytes, stream: bool) -> bool:
    if stream:
        return stream_complete(body)
    try:
        return bool(orjson.loads(body)["choices"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False


async def drive(urls: list[str], args: argparse.Namespace) -> dict[str, Any]:
    upstream = Upstream(connect_timeout=10.0, max_idle=args.concurrency)
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    served: set[str] = set()
    per_replica: Counter[str] = Counter()
    todo = iter(range(args.requests))

    async def one(i: int) -> None:
        stream = args.stream_every > 0 and i % args.stream_every == 0
        body, headers = request(i, stream, args.max_tokens)
        rid = f"load-{i}"
        url = urls[i % len(urls)]
        t0 = time.perf_counter()
        try:
            resp = await upstream.send(url, "/v1/completions", headers, body, 60.0)
            try:
                chunks = [c async for c in resp.chunks(60.0)]
            finally:
                resp.close()
        except UpstreamError as exc:
            failures[type(exc).__name__] += 1
            return
        latencies.append(time.perf_counter() - t0)
        if resp.status != 200:
            try:
                code = orjson.loads(b"".join(chunks))["error"]["code"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                code = "?"
            failures[f"status_{resp.status}_{code}"] += 1
        elif (resp.header(b"x-echo-request-id") or b"").decode() != rid:
            failures["wrong_echo"] += 1
        elif not complete(b"".join(chunks), stream):
            failures["incomplete_body"] += 1
        else:
            served.add(rid)
            per_replica[url] += 1

    async def worker() -> None:
        for i in todo:
            await one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    upstream.close()
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(len(latencies) * p))] * 1000

    return {
        "wall_s": wall,
        "requests_per_s": args.requests / wall,
        "latency_ms": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": pct(1.0)}
        if latencies
        else {},
        "served": served,
        "failures": dict(failures),
        "per_replica": dict(per_replica),
    }


# -- processes ----------------------------------------------------------------------------


def http_get(port: int, path: str) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head[9:12]), body


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Each sample named ``name`` in a Prometheus text scrape, with its labels: the client
    library's parser, so a label value with a space or a name another starts with is not
    misread as a split of the line would."""
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"process on port {port} exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            if http_get(port, "/health")[0] == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port} did not come up")
        time.sleep(0.05)


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    py = sys.executable
    quiet = {"cwd": ROOT, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    with processes() as procs:
        ports = free_ports(args.engines + args.replicas)
        engine_ports, router_ports = ports[: args.engines], ports[args.engines :]
        for i, port in enumerate(engine_ports):
            cmd = [py, __file__, "--engine-port", str(port), "--worker-id", f"e{i}",
                   "--speed", str(args.speed)]  # fmt: skip
            procs.append(subprocess.Popen(cmd, **quiet))
        workers = [f"--worker=e{i}=http://127.0.0.1:{p}" for i, p in enumerate(engine_ports)]
        for port in router_ports:
            cmd = [py, "-m", "router.cli", "serve", "--port", str(port), "--policy", args.policy,
                   "--log-level", "error", *workers]  # fmt: skip
            procs.append(subprocess.Popen(cmd, **quiet))
        for port, proc in zip(engine_ports + router_ports, procs, strict=True):
            wait_ready(port, proc)
        urls = [f"http://127.0.0.1:{p}" for p in router_ports]
        result = asyncio.run(drive(urls, args))
        seen: Counter[str] = Counter()
        per_engine = {}
        for i, port in enumerate(engine_ports):
            counts = orjson.loads(http_get(port, "/_ids")[1])
            per_engine[f"e{i}"] = sum(counts.values())
            seen.update(counts)
    wanted = {f"load-{i}" for i in range(args.requests)}
    served: set[str] = result.pop("served")
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "replicas": args.replicas,
        "engines": args.engines,
        "policy": args.policy,
        "stream_every": args.stream_every,
        "cpu_count": os.cpu_count(),
        **result,
        "ok": len(served),
        "lost": len(wanted - (served & set(seen))),
        "not_served": len(wanted - served),
        "never_reached_an_engine": len(wanted - set(seen)),
        "duplicated": sum(1 for n in seen.values() if n > 1),
        "unknown_ids_at_engines": len(set(seen) - wanted),
        "per_engine": per_engine,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--speed", type=float, default=10_000.0, help="mock engine speed factor")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--stream-every", type=int, default=4, help="stream every Nth; 0: never")
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--engine-port", type=int, help=argparse.SUPPRESS)  # internal: engine
    ap.add_argument("--worker-id", default="e0", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_port:
        import uvloop

        uvloop.run(serve_engine(args.engine_port, args.worker_id, args.speed))
        return
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
