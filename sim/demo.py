"""``cache-router demo``: the whole stack on one machine, in about a minute.

It starts an embedded ``nats-server``, mock engines with their node agents and the
router, each as the same ``cache-router`` subcommand ``docker-compose.yml`` runs, then
drives a multi-turn, multi-session chat workload through the router with the OpenAI
client once per policy (fresh engines each time, so every policy starts cold) and
prints hit rate and TTFT side by side. ``--serve`` keeps one stack up instead and
prints where its parts listen, one JSON object per line. Nothing is left running
when it ends or is interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from router.cli import signalled
from sim.mock.natsd import EmbeddedNats, free_ports

MODEL = "mock-model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=4, help="mock engines (4)")
    parser.add_argument("--policies", default="round_robin,cache_aware", help="compared in order")
    parser.add_argument("--sessions", type=int, default=24, help="chat sessions per run (24)")
    parser.add_argument("--turns", type=int, default=5, help="turns per session (5)")
    parser.add_argument("--concurrency", type=int, default=16, help="sessions at once (16)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-blocks", type=int, default=1024, help="KV blocks per engine")
    parser.add_argument("--speed", type=float, default=1.0, help="engine latency divisor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object, no table")
    parser.add_argument(
        "--serve", action="store_true", help="keep one stack (cache_aware) up until interrupted"
    )
    parser.add_argument("--port", type=int, default=0, help="router port with --serve (free)")
    parser.add_argument(
        "--pd",
        nargs="?",
        const="vllm",
        choices=("vllm", "sglang"),
        help="a disaggregated pool: half the engines prefill, half decode, in vLLM's "
        "KV-connector protocol (the default) or SGLang's bootstrap protocol",
    )


@dataclass
class Stack:
    """Child processes of one run: engines, agents, router (NATS is shared)."""

    router_url: str
    engines: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    """One part, quiet but for warnings and errors, which go to the demo's stderr."""
    return subprocess.Popen(
        [sys.executable, "-m", "router.cli", *args, "--log-level=warning"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def wait_healthy(url: str, *procs: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Poll ``url``/health until it answers 200; RuntimeError after ``timeout`` seconds,
    or at once when one of ``procs`` exits (with its stderr, when that is a pipe).

    The one start-up wait of the demo, the tests and the benches' async stacks."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            for p in procs:
                if p.poll() is not None:
                    err = p.stderr.read().decode(errors="replace") if p.stderr else ""
                    raise RuntimeError(f"{url}: a process exited with {p.returncode} {err}")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(url + "/health")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not become healthy in {timeout:g} s")
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def stack(
    nats_url: str,
    policy: str,
    args: argparse.Namespace,
    port: int = 0,
    admin_token: str | None = None,
) -> AsyncIterator[Stack]:
    """Engines + agents + router as subprocesses; all stopped on the way out."""
    procs: list[subprocess.Popen[bytes]] = []
    engines: dict[str, str] = {}
    roles = pd_roles(args.engines) if args.pd else ["mixed"] * args.engines
    ports = free_ports(3 * args.engines + 1)
    config = tempfile.TemporaryDirectory(prefix="cache-router-demo-")
    try:
        for i in range(args.engines):
            wid = f"engine-{i}" if roles[i] == "mixed" else f"{roles[i]}-{i}"
            http_port, pub, rep = ports[3 * i : 3 * i + 3]
            engines[wid] = f"http://127.0.0.1:{http_port}"
            procs.append(
                _spawn(
                    [
                        "mock-engine",
                        f"--port={http_port}",
                        f"--worker-id={wid}",
                        f"--model={MODEL}",
                        f"--block-size={args.block_size}",
                        f"--gpu-blocks={args.gpu_blocks}",
                        f"--speed={args.speed}",
                        f"--seed={args.seed}",
                        f"--zmq-endpoint=tcp://127.0.0.1:{pub}",
                        f"--replay-endpoint=tcp://127.0.0.1:{rep}",
                        f"--role={roles[i]}",
                    ]
                )
            )
            procs.append(
                _spawn(
                    [
                        "agent",
                        f"--worker-id={wid}",
                        f"--engine-url={engines[wid]}",
                        f"--zmq-endpoint=tcp://127.0.0.1:{pub}",
                        f"--replay-endpoint=tcp://127.0.0.1:{rep}",
                        f"--nats-url={nats_url}",
                        "--load-interval=0.2",
                    ]
                )
            )
        router_port = port or ports[-1]
        if args.pd:  # roles and bootstrap ports are worker settings: a TOML file
            workers = [f"--config={pd_config(config.name, args.pd, engines, roles)}"]
            decode = "round_robin" if policy == "round_robin" else "decode_load"
            workers.append(f"--decode-policy={decode}")
        else:
            workers = [f"--worker={wid}={url}" for wid, url in engines.items()]
        procs.append(
            _spawn(
                [
                    "serve",
                    "--host=127.0.0.1",
                    f"--port={router_port}",
                    f"--nats-url={nats_url}",
                    f"--policy={policy}",
                    f"--block-size={args.block_size}",
                    *workers,
                    *([f"--admin-token={admin_token}"] if admin_token else []),
                ]
            )
        )
        router_url = f"http://127.0.0.1:{router_port}"
        for url in [*engines.values(), router_url]:
            await wait_healthy(url, *procs, timeout=60)
        yield Stack(router_url, engines, procs)
    finally:
        _stop(procs)
        config.cleanup()


def pd_roles(engines: int) -> list[str]:
    """Half the engines prefill (at least one), the rest decode (at least one)."""
    if engines < 2:
        raise RuntimeError("--pd needs at least 2 engines (a prefill and a decode one)")
    prefill = engines // 2
    return ["prefill"] * prefill + ["decode"] * (engines - prefill)


def pd_config(folder: str, protocol: str, engines: dict[str, str], roles: list[str]) -> str:
    """The router's TOML for a disaggregated pool; a mock engine's bootstrap server is on
    its HTTP port."""
    lines = [f'pd_protocol = "{protocol}"']
    for (wid, url), role in zip(engines.items(), roles, strict=True):
        port = url.rsplit(":", 1)[1]
        lines += ["[[workers]]", f'id = "{wid}"', f'url = "{url}"', f'model = "{MODEL}"']
        lines += [f'role = "{role}"', f"bootstrap_port = {port}"]
    path = os.path.join(folder, "router.toml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


async def prefill_hit_rate(engines: dict[str, str]) -> float | None:
    """Prompt tokens the prefill engines found cached / looked up (their vLLM counters): a
    decode engine reports the transferred prompt as cached, which says nothing of hits."""
    hits = queries = 0.0
    async with httpx.AsyncClient(timeout=5.0) as client:
        for wid, url in engines.items():
            if not wid.startswith("prefill-"):
                continue
            for line in (await client.get(url + "/metrics")).text.splitlines():
                if line.startswith("vllm:prefix_cache_hits"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries"):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits / queries if queries else None


async def _compare(nats_url: str, args: argparse.Namespace) -> dict[str, object]:
    from sim.workload import run_workload

    results = []
    token = os.urandom(8).hex()
    for policy in args.policies.split(","):
        async with stack(nats_url, policy, args, admin_token=token) as s:
            report = await run_workload(
                s.router_url + "/v1",
                MODEL,
                sessions=args.sessions,
                turns=args.turns,
                concurrency=args.concurrency,
                seed=args.seed,
            )
            forecast = await _forecast(s.router_url, token)
            summary = report.summary()
            if args.pd:
                summary["client_cached_rate"] = summary["hit_rate"]
                summary["hit_rate"] = await prefill_hit_rate(s.engines) or 0.0
        results.append({"policy": policy, **summary, "forecast": forecast})
    return {
        "pd": args.pd,
        "engines": args.engines,
        "sessions": args.sessions,
        "turns": args.turns,
        "results": results,
    }


async def _forecast(router_url: str, token: str) -> dict[str, object] | None:
    """The router's capacity forecast for the demo model, once it analysed every request."""
    headers = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(timeout=5.0) as client:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = await client.get(router_url + "/admin/capacity", headers=headers)
                body = r.json()
                if r.status_code == 200 and body["queued"] == 0 and MODEL in body["models"]:
                    m = body["models"][MODEL]
                    return {
                        "pool_blocks": m["capacity"]["pool_blocks"],
                        "predicted_pool_hit_rate": m["pooled"]["predicted_hit_rate"],
                        "predicted_routed_hit_rate": _routed(m["workers"]),
                        "ceiling_hit_rate": m["ceiling_hit_rate"],
                        "saturation_blocks": m["pooled"]["saturation_blocks"],
                        "working_set_blocks": m["working_set_blocks"],
                        "warnings": m["warnings"],
                    }
            await asyncio.sleep(0.2)
    return None


def _routed(workers: dict[str, Any]) -> float | None:
    """The workers' predicted hit rates, weighted by their requests."""
    pairs = [
        (w["predicted_hit_rate"], w["requests"])
        for w in workers.values()
        if w.get("predicted_hit_rate") is not None
    ]
    n = sum(k for _, k in pairs)
    return sum(r * k for r, k in pairs) / n if n else None


def _forecast_line(r: dict[str, object]) -> str:
    f = r.get("forecast")
    if not isinstance(f, dict):
        return f"forecast ({r['policy']}): not available"
    routed = f["predicted_routed_hit_rate"]
    line = (
        f"forecast ({r['policy']}): predicted hit rate "
        f"{'-' if routed is None else f'{routed:.1%}'} on the engines as routed "
        f"(delivered {r['hit_rate']:.1%}), {f['predicted_pool_hit_rate']:.1%} as one pooled "
        f"cache of {f['pool_blocks']} blocks, ceiling {f['ceiling_hit_rate']:.1%}; "
        f"saturates at {f['saturation_blocks']} blocks, working set {f['working_set_blocks']}"
    )
    return line + "".join(f"\n  warning: {w}" for w in f["warnings"])


def _table(out: dict[str, object]) -> str:
    rows = [("policy", "requests", "errors", "hit rate", "TTFT p50 ms", "TTFT p90 ms")]
    for r in out["results"]:  # type: ignore[attr-defined]
        rows.append(
            (
                r["policy"],
                str(r["requests"]),
                str(r["errors"]),
                f"{r['hit_rate']:.1%}",
                f"{r['ttft_p50_ms']:.1f}",
                f"{r['ttft_p90_ms']:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines += [_forecast_line(r) for r in out["results"]]  # type: ignore[attr-defined]
    return "\n".join(lines)


def _emit(obj: dict[str, object]) -> None:
    sys.stdout.write(orjson.dumps(obj).decode() + "\n")
    sys.stdout.flush()


async def _serve(nats_url: str, args: argparse.Namespace) -> None:
    async with signalled() as stop, stack(nats_url, "cache_aware", args, port=args.port) as s:
        _emit({"router": s.router_url})
        for wid, url in s.engines.items():
            _emit({"engine": wid, "url": url})
        _emit({"ready": True})
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    with EmbeddedNats() as nats:
        try:
            if args.serve:
                asyncio.run(_serve(nats.url, args))
                return 0
            if not args.json:
                pool = f"{args.engines} mock engines"
                if args.pd:
                    pool += f" (disaggregated, {args.pd} protocol: half prefill, half decode)"
                print(
                    f"cache-router demo: NATS {nats.url}, {pool}, "
                    f"{args.sessions} sessions x {args.turns} turns per policy",
                    file=sys.stderr,
                )
            out = asyncio.run(_compare(nats.url, args))
        except KeyboardInterrupt:
            return 130
        except RuntimeError as exc:
            print(f"cache-router demo: {exc}", file=sys.stderr)
            return 1
    print(orjson.dumps(out).decode() if args.json else _table(out))
    return 0
