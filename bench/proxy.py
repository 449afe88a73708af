"""Router overhead, side by side in one run: direct vs cache-router vs SGLang's Rust router.

One engine process answers every request at once with a canned OpenAI response (a raw
asyncio HTTP/1.1 server, so the engine is never the bottleneck). The same raw
keep-alive client drives, in turn: the engine directly, ``cache-router serve`` in front
of it (a subprocess) and, when ``sglang_router`` is importable by ``--sglang-python``
(e.g. the throwaway venv /tmp/sglvenv), ``sglang_router.launch_router --policy
cache_aware`` in front of the same engine. Each target gets a latency phase
(concurrency 1: added latency without queueing) and a throughput phase (requests/s,
router CPU seconds per request from /proc over the router's whole process tree).

    python bench/proxy.py [--requests 4000] [--concurrency 32] [--sglang-python PATH]
        [--granian-python PATH] [--baseline DIR]

``--granian-python``: a python with ``granian`` (a Rust HTTP server) adds
``cache_router_granian``, the same router app served by granian's ASGI interface
(``granian_app`` below) instead of uvicorn, to compare serving stacks in one run.

Prints one JSON object; never asserts. Targets (issue 4): CPU per request no worse than
SGLang's router, added p99 under 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sim.mock.natsd import free_ports  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
SYSTEM = "You are a helpful assistant that answers briefly and precisely. " * 12

# -- the engine: a canned-answer HTTP/1.1 server ------------------------------------------

_COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": 200,
            "completion_tokens": 1,
            "total_tokens": 201,
            "prompt_tokens_details": {"cached_tokens": 192},
        },
    }
)
_INFO = orjson.dumps({"model_path": "bench", "tokenizer_path": "bench", "is_generation": True})
_MODELS = orjson.dumps({"object": "list", "data": [{"id": "bench", "object": "model"}]})


def _response(body: bytes) -> bytes:
    head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    return f"{head}content-length: {len(body)}\r\n\r\n".encode() + body


_ANSWERS = {
    b"/v1/chat/completions": _response(_COMPLETION),
    b"/v1/completions": _response(_COMPLETION),
    b"/v1/models": _response(_MODELS),
    b"/server_info": _response(_INFO),
    b"/model_info": _response(_INFO),
    b"/get_model_info": _response(_INFO),
    b"/get_server_info": _response(_INFO),
}
_OTHER = _response(b"{}")


class _EngineProtocol(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower() + b"\r\n"
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                length = int(head[at + 15 : head.find(b"\r\n", at)])
            if len(self.buf) < end + 4 + length:
                return
            path = head.split(b" ", 2)[1].split(b"?", 1)[0]
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            own = self.answer_request(path, body)
            self.transport.write(_ANSWERS.get(path, _OTHER) if own is None else own)

    def answer_request(self, path: bytes, body: bytes) -> bytes | None:
        """A subclass's own answer (bench/hotpath.py's streaming engine); None: canned."""
        return None

    @staticmethod
    def answer(obj: object) -> bytes:
        """``obj`` as a whole JSON response."""
        return _response(orjson.dumps(obj))


def run_engine(port: int) -> None:
    import uvloop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_EngineProtocol, "127.0.0.1", port, backlog=4096)
        await server.serve_forever()

    uvloop.run(serve())


# -- the client: keep-alive connections, one request at a time each ----------------------


async def _read_response(reader: asyncio.StreamReader) -> int:
    return (await _read_timed(reader, 0.0))[0]


async def _read_timed(reader: asyncio.StreamReader, sent: float) -> tuple[int, float | None]:
    """A response's status and its first body chunk's time after ``sent`` (s; None: no
    chunked body), its body read to the end."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    low = head.lower()
    at = low.find(b"content-length:")
    if at >= 0:
        await reader.readexactly(int(low[at + 15 : low.find(b"\r\n", at)]))
        return status, None
    first = None
    while b"transfer-encoding: chunked" in low:
        size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
        await reader.readexactly(size + 2)
        if first is None:
            first = time.perf_counter() - sent
        if size == 0:
            break
    return status, first


def _requests(port: int, n: int) -> list[bytes]:
    """``n`` distinct chat requests: 64 conversations sharing a system prompt, growing turns."""
    out = []
    for i in range(n):
        conv, turn = i % 64, i // 64
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(turn % 6 + 1):
            messages.append({"role": "user", "content": f"conversation {conv} question {t}"})
            messages.append({"role": "assistant", "content": "an answer of a few words"})
        body = orjson.dumps({"model": "bench", "messages": messages[:-1], "max_tokens": 1})
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\nx-session-id: s{conv}\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        out.append(head.encode() + body)
    return out


async def _drive(port: int, requests: list[bytes], concurrency: int) -> dict[str, float]:
    latencies: list[float] = []
    errors = 0
    queue = iter(requests)

    async def worker() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for req in queue:
                t0 = time.perf_counter()
                writer.write(req)
                if await _read_response(reader) != 200:
                    errors += 1
                latencies.append(time.perf_counter() - t0)
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return load_summary(latencies, errors, time.perf_counter() - t0)


def load_summary(latencies: list[float], errors: int, wall: float) -> dict[str, float]:
    """A load run's count, errors, rate and latency percentiles (``latencies`` in s)."""
    latencies.sort()
    return {
        "requests": len(latencies),
        "errors": errors,
        "requests_per_s": len(latencies) / wall,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
    }


# -- processes ------------------------------------------------------------------------------


def tree_cpu_seconds(pid: int) -> float:
    """user+system CPU of ``pid`` and all its live descendants (threads included)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        parents[int(entry.name)] = int(fields[1])
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
    total = 0
    for p, t in ticks.items():
        q = p
        while q and q != pid:
            q = parents.get(q, 0)
        if q == pid:
            total += t
    return total / CLK_TCK


def wait_http(port: int, path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    req = f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode()
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(req)
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"port {port}{path} did not come up")


@contextlib.contextmanager
def process(
    cmd: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """``cmd`` running (in ``cwd``, with ``env`` added to ours) until the block ends."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def granian_app() -> object:
    """The router's ASGI app for ``granian --factory proxy:granian_app``, built from the
    ``cache-router serve`` flags in ``ROUTER_ARGS``."""
    import shlex

    from router.http.app import build_app
    from router.http.serve import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_app(config_from_args(parser.parse_args(shlex.split(os.environ["ROUTER_ARGS"]))))


def sglang_python(given: str | None) -> str | None:
    """A python that can import sglang_router: the flag, this one, or /tmp/sglvenv."""
    for py in [given] if given else [sys.executable, "/tmp/sglvenv/bin/python"]:
        if py and (Path(py).exists() or shutil.which(py)):
            ok = subprocess.run([py, "-c", "import sglang_router"], capture_output=True)
            if ok.returncode == 0:
                return py
    return None


def measure(port: int, pid: int | None, args: argparse.Namespace) -> dict[str, float]:
    """Latency phase at concurrency 1, then a throughput phase with CPU accounting."""
    asyncio.run(_drive(port, _requests(port, 500), 8))  # warm up connections and caches
    latency = asyncio.run(_drive(port, _requests(port, args.latency_requests), 1))
    cpu0 = tree_cpu_seconds(pid) if pid else 0.0
    load = asyncio.run(_drive(port, _requests(port, args.requests), args.concurrency))
    out = {
        "p50_ms": latency["p50_ms"],
        "p99_ms": latency["p99_ms"],
        "requests_per_s": load["requests_per_s"],
        "loaded_p50_ms": load["p50_ms"],
        "loaded_p99_ms": load["p99_ms"],
        "errors": latency["errors"] + load["errors"],
    }
    if pid:
        out["cpu_us_per_request"] = (tree_cpu_seconds(pid) - cpu0) / load["requests"] * 1e6
    return out


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over rounds (the machine may be shared: one round can be unlucky)."""
    keys = runs[0].keys()
    return {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000, help="throughput phase requests")
    ap.add_argument("--latency-requests", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="targets alternate; medians reported")
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--sglang-python", help="python with sglang_router (default: auto)")
    ap.add_argument("--granian-python", help="python with granian: the router under it too")
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="also cache_router_baseline: cache-router run from this checkout (before/after)",
    )
    ap.add_argument("--engine", type=int, help=argparse.SUPPRESS)  # internal: run the engine
    args = ap.parse_args()
    if args.engine:
        run_engine(args.engine)
        return

    (engine_port,) = free_ports(1)
    engine_url = f"http://127.0.0.1:{engine_port}"
    py = sglang_python(args.sglang_python)
    serve = ["--worker", f"w0={engine_url}", "--policy", args.policy, "--log-level", "error"]
    targets: dict[str, list[str] | None] = {
        "direct": None,
        "cache_router": [sys.executable, "-m", "router.cli", "serve", "--port", "{port}", *serve],
    }
    if args.baseline:
        targets["cache_router_baseline"] = [
            "env", "-C", args.baseline, sys.executable, "-m", "router.cli", "serve",
            "--port", "{port}", *serve,
        ]  # fmt: skip
    envs: dict[str, dict[str, str]] = {}
    if args.granian_python:
        targets["cache_router_granian"] = [
            str(Path(args.granian_python).parent / "granian"), "--interface", "asgi",
            "--host", "127.0.0.1", "--port", "{port}", "--workers", "1", "--loop", "uvloop",
            "--http", "1", "--no-ws", "--log-level", "error", "--factory", "proxy:granian_app",
        ]  # fmt: skip
        envs["cache_router_granian"] = {
            "ROUTER_ARGS": " ".join(serve),
            "PYTHONPATH": f"{ROOT / 'bench'}:{ROOT}",
        }
    if py is not None:
        targets["sglang_router"] = [
            py, "-m", "sglang_router.launch_router", "--worker-urls", engine_url,
            "--policy", "cache_aware", "--host", "127.0.0.1", "--port", "{port}",
            "--prometheus-port", "{port2}", "--log-level", "error",
        ]  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    with process([sys.executable, __file__, "--engine", str(engine_port)]):
        wait_http(engine_port, "/health")
        for _ in range(args.rounds):
            for name, cmd in targets.items():
                if cmd is None:
                    runs[name].append(measure(engine_port, None, args))
                    continue
                port, port2 = free_ports(2)
                argv = [a.format(port=port, port2=port2) for a in cmd]
                with process(argv, env=envs.get(name)) as proc:
                    wait_http(port, "/health")
                    time.sleep(1.0)  # SGLang activates its workers after /health answers
                    runs[name].append(measure(port, proc.pid, args))
    result: dict[str, object] = {
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "policy": args.policy,
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],  # other work on the machine skews all numbers
    }
    direct = median_of(runs["direct"])
    result["direct"] = direct
    for name in targets:
        if name == "direct":
            continue
        med = median_of(runs[name])
        for key in ("p50_ms", "p99_ms"):
            med["added_" + key] = med[key] - direct[key]
        result[name] = med
    if "sglang_router" in result:
        for name in ("cache_router", "cache_router_granian", "cache_router_baseline"):
            ours, theirs = result.get(name), result["sglang_router"]
            if not isinstance(ours, dict):
                continue
            assert isinstance(theirs, dict)
            result[f"ratios_{name}_over_sglang"] = {
                key: ours[key] / theirs[key]
                for key in ("cpu_us_per_request", "requests_per_s", "added_p50_ms", "added_p99_ms")
                if theirs.get(key)
            }
    else:
        result["sglang_router"] = "not importable: pass --sglang-python"
    if args.baseline:
        ours, base = result["cache_router"], result["cache_router_baseline"]
        assert isinstance(ours, dict) and isinstance(base, dict)
        result["ratios_cache_router_over_baseline"] = {
            key: ours[key] / base[key] for key in ("cpu_us_per_request", "requests_per_s")
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
