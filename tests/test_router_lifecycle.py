"""The router's life: NATS going away and back, and a graceful shutdown (subprocess)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import httpx
from stack import EngineDouble, Served, until

from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp
from sim.mock.natsd import EmbeddedNats, free_port


async def test_nats_outage_routing_goes_on_and_the_index_catches_up():
    server = EmbeddedNats().start()
    engines = []
    served = None
    try:
        for i in range(2):
            engines.append(await EngineDouble(f"w{i}", nats_url=server.url).start())
        cfg = RouterConfig(
            nats_url=server.url,
            block_size=4,
            health_interval=0.2,
            workers=[WorkerSpec(e.worker_id, e.url, model="m") for e in engines],
        )
        app = RouterApp(cfg)
        served = await Served(app).start()
        bus, pool = app.state.bus, app.state.registry.pools["default"]
        await until(lambda: bus.connected, what="connected")

        def synced() -> bool:
            return all(pool.ingest.last_seq(e.worker_id) == e.seq for e in engines if e.seq >= 0)

        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            body = {"model": "m", "prompt": "before the outage " * 4}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            await until(synced, what="first events")

            server.stop()
            await until(lambda: not bus.connected, what="disconnected")
            for i in range(4):
                body = {"model": "m", "prompt": f"during the outage {i} " * 4}
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200  # routing never stops for NATS

            server = EmbeddedNats(port=server.port).start()
            await until(lambda: bus.connected and bus.reconnects >= 1, timeout=15, what="back")
            # whatever was published while it was down is fetched by replay
            await until(synced, timeout=15, what="index caught up")
            body = {"model": "m", "prompt": "after the outage " * 4}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            await until(synced, what="live events again")
        for e in engines:
            assert pool.ingest.in_sync(e.worker_id)
            assert pool.index.stats().workers[e.worker_id]["gpu"] == len(e.cache)
    finally:
        if served is not None:
            await served.stop()
        for e in engines:
            await e.stop()
        server.stop()


async def test_sigterm_lets_an_inflight_stream_finish():
    engine = await EngineDouble("w0").start()
    engine.token_delay = 0.03
    port = free_port()
    env = {**os.environ, "CACHE_ROUTER_DRAIN_TIMEOUT": "20"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.cli", "serve", "--port", str(port),
        "--worker", f"w0={engine.url}", "--log-level", "warning",
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            deadline = time.monotonic() + 20
            while True:
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)
            body = {"model": "m", "prompt": "a long answer", "max_tokens": 40, "stream": True}
            lines = []
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line and not lines:
                        proc.send_signal(signal.SIGTERM)  # mid-stream
                    if line:
                        lines.append(line)
        assert lines[-1] == "data: [DONE]"
        assert len(lines) == 41  # every token arrived
        # uvicorn re-raises the signal after its graceful shutdown: exit by SIGTERM, no error
        assert await asyncio.wait_for(proc.wait(), 20) in (0, -signal.SIGTERM)
        assert b"Traceback" not in await proc.stderr.read()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await engine.stop()
