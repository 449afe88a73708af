"""The router's CPU per request as the proxy against its CPU per decision as the EPP.

One ``cache-router serve --epp-port`` process in front of bench/proxy.py's canned engine
answers the same chat requests two ways, in turn: over HTTP as the proxy (it reads the
body, decides, forwards, relays the answer) and over gRPC as a gateway's Endpoint
Picker (``router/epp``: the gateway's side is played here with the picker's own message
classes, router/epp/messages.py, cheap enough not to crowd the router's cores; the tests
play it with Envoy's packaged protos): the request headers and body in
``FULL_DUPLEX_STREAMED`` mode, the picker's answer read back, then the response phase
with the engine's canned answer, as Envoy sends it; the bytes never go to the engine,
which is the gateway's work). CPU is the router process tree's, from /proc, over each
phase.

    python bench/epp.py [--requests 3000] [--concurrency 16] [--rounds 3]

``grpc_floor`` is the same conversation with a grpc.aio server (uvloop, as the router
runs) that decides nothing and answers each message with bytes serialized in advance:
what gRPC itself costs a stream in Python, the part of the EPP's CPU no code of the
router's can save.

Prints one JSON object; never asserts (issue 34: behind Envoy only the decision remains).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from proxy import (  # noqa: E402
    _COMPLETION,
    _drive,
    _requests,
    load_summary,
    median_of,
    process,
    run_engine,
    tree_cpu_seconds,
    wait_http,
)

from sim.mock.natsd import free_ports  # noqa: E402


async def _drive_epp(
    port: int, bodies: list[bytes], concurrency: int, response: bool = True
) -> dict[str, float]:
    """Whole ext_proc conversations, ``concurrency`` at a time on one channel;
    ``response``: the response phase too (a gateway whose response modes are SKIP/NONE
    sends none: the stream ends with the request)."""
    import grpc

    from router.epp import messages as ep

    duplex = ep.BODY_SEND_MODE["FULL_DUPLEX_STREAMED"]

    def headers(pairs: dict[str, str], end: bool = False) -> object:
        values = [ep.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
        return ep.HttpHeaders(headers=ep.HeaderMap(headers=values), end_of_stream=end)

    answer_head = headers({":status": "200", "content-type": "application/json"})
    latencies: list[float] = []
    errors = 0
    queue = iter(bodies)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        process = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=ep.ProcessingRequest.SerializeToString,
            response_deserializer=ep.ProcessingResponse.FromString,
        )

        async def worker() -> None:
            nonlocal errors
            for body in queue:
                t0 = time.perf_counter()
                call = process()
                first = ep.ProcessingRequest(request_headers=headers(
                    {":method": "POST", ":path": "/v1/chat/completions",
                     "content-type": "application/json"}))  # fmt: skip
                first.protocol_config.request_body_mode = duplex
                first.protocol_config.response_body_mode = duplex
                await call.write(first)
                await call.write(ep.ProcessingRequest(
                    request_body=ep.HttpBody(body=body, end_of_stream=True)))  # fmt: skip
                routed = await call.read()
                if routed.HasField("immediate_response"):
                    errors += 1
                    call.cancel()
                    continue
                while True:  # the body, sent back
                    out = await call.read()
                    if out.request_body.response.body_mutation.streamed_response.end_of_stream:
                        break
                if response:
                    await call.write(ep.ProcessingRequest(response_headers=answer_head))
                    await call.read()
                    await call.write(ep.ProcessingRequest(
                        response_body=ep.HttpBody(body=_COMPLETION, end_of_stream=True)
                    ))  # fmt: skip
                    await call.read()
                await call.done_writing()
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return load_summary(latencies, errors, wall)


def run_floor(port: int) -> None:
    """The ext_proc service answering as the picker does, from canned bytes, deciding nothing."""
    import grpc
    import uvloop

    from router.epp import protocol as pr

    routed = pr.routed("127.0.0.1:1", [("content-length", "1")], phase="request_headers")
    first = [routed.SerializeToString()]  # then the body, sent back
    head = pr.passed("response_headers", [("x-cache-router-worker", "w0")]).SerializeToString()

    def chunks(body: bytes, phase: str) -> list[bytes]:
        return [m.SerializeToString() for m in pr.body_chunks(body, phase)]

    async def process(_requests: object, context: grpc.aio.ServicerContext) -> None:
        while (msg := await context.read()) is not grpc.aio.EOF:
            which = msg.WhichOneof("request")
            if which == "request_body" and msg.request_body.end_of_stream:
                for out in first + chunks(msg.request_body.body, "request_body"):
                    await context.write(out)
            elif which == "response_headers":
                await context.write(head)
            elif which == "response_body":
                for out in chunks(msg.response_body.body, "response_body"):
                    await context.write(out)

    async def serve() -> None:
        from router.epp import messages

        handler = grpc.stream_stream_rpc_method_handler(
            process, request_deserializer=messages.ProcessingRequest.FromString
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(pr.SERVICE, {"Process": handler}),)
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(serve())


def _wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _bodies(raw_requests: list[bytes]) -> list[bytes]:
    return [r.partition(b"\r\n\r\n")[2] for r in raw_requests]


def measure(
    pid: int, http_port: int, epp_port: int, floor: tuple[int, int], args: argparse.Namespace
) -> dict[str, object]:
    out: dict[str, object] = {}
    warm = _requests(http_port, 300)
    asyncio.run(_drive(http_port, warm, 8))
    asyncio.run(_drive_epp(epp_port, _bodies(warm), 8))
    asyncio.run(_drive_epp(floor[1], _bodies(warm), 8))
    for name in ("proxy", "epp", "epp_request_only", "grpc_floor"):
        requests = _requests(http_port, args.requests)
        cpu0 = tree_cpu_seconds(floor[0] if name == "grpc_floor" else pid)
        if name == "grpc_floor":
            load = asyncio.run(_drive_epp(floor[1], _bodies(requests), args.concurrency))
            cpu = tree_cpu_seconds(floor[0]) - cpu0
            out[name] = {**load, "cpu_us_per_request": cpu / max(1, load["requests"]) * 1e6}
            continue
        if name == "proxy":
            load = asyncio.run(_drive(http_port, requests, args.concurrency))
        else:
            full = name == "epp"
            bodies = _bodies(requests)
            load = asyncio.run(_drive_epp(epp_port, bodies, args.concurrency, full))
        cpu = tree_cpu_seconds(pid) - cpu0
        out[name] = {**load, "cpu_us_per_request": cpu / max(1, load["requests"]) * 1e6}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="medians over rounds")
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--engine", type=int, help=argparse.SUPPRESS)  # internal: run the engine
    ap.add_argument("--floor", type=int, help=argparse.SUPPRESS)  # internal: the bare service
    args = ap.parse_args()
    if args.engine:
        run_engine(args.engine)
        return
    if args.floor:
        run_floor(args.floor)
        return
    engine_port, http_port, epp_port, floor_port = free_ports(4)
    names = ("proxy", "epp", "epp_request_only", "grpc_floor")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    floor_cmd = [sys.executable, str(ROOT / "bench" / "epp.py"), "--floor", str(floor_port)]
    with (
        process([sys.executable, str(ROOT / "bench" / "proxy.py"), "--engine", str(engine_port)]),
        process(floor_cmd) as floor,
    ):
        wait_http(engine_port, "/health")
        _wait_port(floor_port)
        cmd = [
            sys.executable, "-m", "router.cli", "serve", "--port", str(http_port),
            "--epp-port", str(epp_port), "--worker", f"w0=http://127.0.0.1:{engine_port}",
            "--policy", args.policy, "--log-level", "error",
        ]  # fmt: skip
        with process(cmd) as router:
            wait_http(http_port, "/health")
            for _ in range(args.rounds):
                result = measure(router.pid, http_port, epp_port, (floor.pid, floor_port), args)
                for name in runs:
                    runs[name].append(result[name])  # type: ignore[arg-type]
    proxy, epp = median_of(runs["proxy"]), median_of(runs["epp"])
    bare = median_of(runs["epp_request_only"])
    grpc_floor = median_of(runs["grpc_floor"])
    print(json.dumps({
        "requests": args.requests,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "policy": args.policy,
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "proxy": proxy,
        "epp": epp,
        "epp_request_only": bare,
        "grpc_floor": grpc_floor,
        "epp_cpu_over_proxy": epp["cpu_us_per_request"] / proxy["cpu_us_per_request"],
        "epp_request_only_cpu_over_proxy": bare["cpu_us_per_request"]
        / proxy["cpu_us_per_request"],
        "epp_cpu_over_grpc_floor": epp["cpu_us_per_request"] / grpc_floor["cpu_us_per_request"],
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
