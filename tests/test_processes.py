"""``cache-router serve --processes N`` (router/http/processes.py): N routers on one port,
replicas over a real nats-server; restarts, shutdown, /metrics, refused admin changes."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from stack import EngineDouble, until

from router.config import ConfigError, load_config
from router.http import processes, serve
from router.http.processes import Child, ProcessesApp, merge_metrics
from sim.mock.natsd import free_port

# slow: their own CI step (`pytest -m slow`), kept out of the main suite's ~10 minutes
pytestmark = pytest.mark.slow

ADMIN = {"authorization": "Bearer admin-secret"}


class Supervised:
    """The supervisor as a subprocess; its log lines collected as they come."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        assert proc.stderr is not None
        self.reader = asyncio.create_task(self._read(proc.stderr))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            self.lines.append(line.decode(errors="replace"))

    def pids(self) -> dict[int, int]:
        """Process index -> the pid of its latest start, from the log."""
        out = {}
        for line in self.lines:
            if m := re.search(r"process (\d+) started \(pid (\d+)\)", line):
                out[int(m[1])] = int(m[2])
        return out


async def start(port: int, *args: str) -> Supervised:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.cli", "serve", "--port", str(port), *args,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    return Supervised(proc, port)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def samples(text: str, name: str) -> dict[str, float]:
    """``name``'s values per ``process`` label, summed over its other labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            process = re.search(r'process="(\d+)"', line)
            assert process is not None, line
            out[process[1]] = out.get(process[1], 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def both_up(http: httpx.AsyncClient) -> str:
    async def check() -> str | None:
        try:
            r = await http.get("/metrics")
        except httpx.TransportError:
            return None
        up = samples(r.text, "cache_router_process_up") if r.status_code == 200 else {}
        return r.text if up == {"0": 1.0, "1": 1.0} else None

    return await until(check, 60, "both router processes answering /metrics")


@pytest.fixture
async def engine() -> AsyncIterator[EngineDouble]:
    eng = await EngineDouble("w0").start()
    yield eng
    await eng.stop()


async def test_two_processes_share_the_port_restart_and_stop(
    engine: EngineDouble, nats_url: str
) -> None:
    port = free_port()
    sup = await start(
        port, "--processes", "2", "--worker", f"w0={engine.url}", "--nats-url", nats_url,
        "--admin-token", "admin-secret", "--replica-id", "shared", "--log-level", "info",
    )  # fmt: skip
    seen: set[int] = set()
    try:
        async with httpx.AsyncClient(base_url=sup.url, timeout=10) as http:
            await both_up(http)
            first = sup.pids()
            assert set(first) == {0, 1}
            seen.update(first.values())
            # one connection per request: the kernel spreads connections over the processes
            body = {"model": "m", "prompt": "hello there", "max_tokens": 2}
            for _ in range(40):
                r = await http.post("/v1/completions", json=body, headers={"connection": "close"})
                assert r.status_code == 200, r.text
            text = await both_up(http)
            requests = samples(text, "cache_router_requests_total")
            assert sum(requests.values()) == 40
            assert set(requests) == {"0", "1"}  # P(all 40 on one) = 2**-39
            # each hears the other's load over NATS (its own messages are not counted)
            heard = await until(
                lambda: _heard(http), 20, "both processes receiving the other's route messages"
            )
            assert set(heard) == {"0", "1"}

            # a change to the worker set would reach one process: refused, with the reason
            spec = {"id": "w9", "url": engine.url}
            for method, path, kw in (
                ("POST", "/admin/workers", {"json": spec}),
                ("POST", "/admin/workers/w0/drain", {}),
                ("DELETE", "/admin/workers/w0", {}),
            ):
                r = await http.request(method, path, headers=ADMIN, **kw)
                assert r.status_code == 409, (path, r.text)
                assert r.json()["error"]["code"] == "multiple_processes"
                assert "2 processes" in r.json()["error"]["message"]
            r = await http.get("/admin/workers", headers=ADMIN)
            assert [w["id"] for w in r.json()["workers"]] == ["w0"]

            # a child killed outright is restarted, and the restart is logged
            victim = first[0]
            os.kill(victim, signal.SIGKILL)
            await until(lambda: sup.pids().get(0) not in (None, victim), 30, "process 0 back")
            assert any(
                f"process 0 (pid {victim}) exited with signal SIGKILL" in line for line in sup.lines
            ), sup.lines
            seen.update(sup.pids().values())
            await both_up(http)
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200

        # SIGTERM stops the supervisor and every child: none is left behind
        sup.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(sup.proc.wait(), 60) == 0
        await asyncio.wait_for(sup.reader, 10)
        assert not [pid for pid in seen if alive(pid)]
        assert not any("Traceback" in line for line in sup.lines), "".join(sup.lines)
    finally:
        if sup.proc.returncode is None:
            sup.proc.kill()
            await sup.proc.wait()
        for pid in seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


async def _heard(http: httpx.AsyncClient) -> dict[str, float] | None:
    r = await http.get("/metrics")
    if r.status_code != 200:
        return None
    heard = {
        p: n
        for p, n in samples(
            "\n".join(ln for ln in r.text.splitlines() if 'kind="route_received"' in ln),
            "cache_router_nats_total",
        ).items()
        if n > 0
    }
    return heard if len(heard) == 2 else None


async def test_metrics_token_on_every_process_and_no_orphans_of_a_killed_supervisor(
    engine: EngineDouble, nats_url: str
) -> None:
    port = free_port()
    sup = await start(
        port, "--processes", "2", "--worker", f"w0={engine.url}", "--nats-url", nats_url,
        "--metrics-token", "m-secret", "--log-level", "info",
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=sup.url, timeout=10) as http:
            good = {"authorization": "Bearer m-secret"}

            async def up() -> bool:
                try:
                    r = await http.get("/metrics", headers=good)
                except httpx.TransportError:
                    return False
                return samples(r.text, "cache_router_process_up") == {"0": 1.0, "1": 1.0}

            await until(up, 60, "both processes up")
            for _ in range(6):  # whichever process answers
                r = await http.get("/metrics", headers={"connection": "close"})
                assert r.status_code == 401
        children = list(sup.pids().values())
        assert len(children) == 2
        # a supervisor killed outright takes its children with it (PDEATHSIG): no orphans
        sup.proc.kill()
        await asyncio.wait_for(sup.proc.wait(), 10)
        await until(lambda: not any(alive(p) for p in children), 60, "the children gone")
        # and the last of them removed the private directory, with the config in it
        private = re.search(r"private directory (\S+)", "".join(sup.lines))
        assert private is not None
        await until(lambda: not os.path.exists(private[1]), 10, "the private dir removed")
    finally:
        if sup.proc.returncode is None:
            sup.proc.kill()
            await sup.proc.wait()
        for pid in sup.pids().values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


async def test_a_taken_port_stops_the_supervisor_with_a_reason(nats_url: str) -> None:
    taken = socket.socket()  # a listener without SO_REUSEPORT: nobody may share it
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        sup = await start(
            taken.getsockname()[1], "--processes", "2", "--worker", "w0=http://127.0.0.1:9",
            "--nats-url", nats_url,
        )  # fmt: skip
        assert await asyncio.wait_for(sup.proc.wait(), 30) == 2
        await asyncio.wait_for(sup.reader, 10)
        assert any("cannot listen on 127.0.0.1" in line for line in sup.lines), sup.lines
        assert not any("started (pid" in line for line in sup.lines)
    finally:
        taken.close()


async def test_processes_without_nats_are_refused() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.cli", "serve", "--processes", "2",
        "--worker", "w0=http://127.0.0.1:9",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"processes = 2 needs nats_url" in err


def test_processes_setting_is_bounded_and_layered(tmp_path: Path) -> None:
    assert load_config(env={}).processes == 1
    toml = tmp_path / "router.toml"
    toml.write_text('processes = 2\nnats_url = "nats://127.0.0.1:4222"\n')
    assert load_config(toml, env={}).processes == 2
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--processes", "5", "--nats-url", "nats://127.0.0.1:4222"])
    assert serve.config_from_args(args, env={}).processes == 5
    nats = {"CACHE_ROUTER_NATS_URL": "nats://127.0.0.1:4222"}
    assert load_config(env={**nats, "CACHE_ROUTER_PROCESSES": "3"}).processes == 3
    flag = load_config(env={**nats, "CACHE_ROUTER_PROCESSES": "3"}, overrides={"processes": 4})
    assert flag.processes == 4
    for bad in ("0", "65"):
        with pytest.raises(ConfigError, match="processes must be"):
            load_config(env={**nats, "CACHE_ROUTER_PROCESSES": bad})
    with pytest.raises(ConfigError, match="needs share_interval"):
        load_config(env={**nats, "CACHE_ROUTER_PROCESSES": "2", "CACHE_ROUTER_SHARE_INTERVAL": "0"})
    with pytest.raises(ConfigError, match="needs nats_url"):
        load_config(env={"CACHE_ROUTER_PROCESSES": "2"})


def test_merged_metrics_label_every_sample_with_its_process() -> None:
    one = (
        "# HELP cache_router_requests_total Requests\n# TYPE cache_router_requests_total counter\n"
        'cache_router_requests_total{arm="a",worker="w0"} 3.0\n'
        "# HELP cache_router_ttft_seconds T\n# TYPE cache_router_ttft_seconds histogram\n"
        'cache_router_ttft_seconds_bucket{le="+Inf"} 3.0\ncache_router_ttft_seconds_count 3.0\n'
        "cache_router_ttft_seconds_sum 0.5\n"
    )
    two = one.replace(" 3.0\n", " 5.0\n", 1)
    text = merge_metrics({0: one, 1: two, 2: None}).decode()
    assert samples(text, "cache_router_requests_total") == {"0": 3.0, "1": 5.0}
    assert samples(text, "cache_router_ttft_seconds_count") == {"0": 3.0, "1": 3.0}
    assert samples(text, "cache_router_process_up") == {"0": 1.0, "1": 1.0, "2": 0.0}
    assert text.count("# TYPE cache_router_requests_total counter") == 1  # one family


async def test_merged_metrics_scrape_the_children_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two children that never answer (restarting, hung) are waited for together: one
    SCRAPE_TIMEOUT for the whole scrape, not one each. Seen by the hung sockets: both are
    open at the same moment."""
    monkeypatch.setattr(processes, "SCRAPE_TIMEOUT", 2.0)
    child = Child(index=0, count=3, dir=str(tmp_path), replica_id="r0", supervisor=os.getppid())
    own = "# TYPE cache_router_up gauge\ncache_router_up 1.0\n"
    hung_open = 0
    most_open = 0

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(own), own.encode()))
        await writer.drain()
        writer.close()

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal hung_open, most_open
        hung_open += 1
        most_open = max(most_open, hung_open)
        await reader.read()  # until the scraper gives up and closes
        hung_open -= 1
        writer.close()

    servers = [await asyncio.start_unix_server(answer, child.control_path(0))]
    servers += [await asyncio.start_unix_server(hang, child.control_path(i)) for i in (1, 2)]
    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    async def unused() -> dict[str, object]:
        raise AssertionError("the merged scrape reads no request body")

    scope = {
        "type": "http",
        "path": "/metrics",
        "method": "GET",
        "headers": [],
        "server": ("127.0.0.1", 8000),
    }
    try:
        await ProcessesApp(app=None, child=child)(scope, unused, send)  # type: ignore[arg-type]
    finally:
        for server in servers:
            server.close()
    assert sent[0]["status"] == 200
    body = sent[1]["body"]
    assert isinstance(body, bytes)
    assert samples(body.decode(), "cache_router_process_up") == {"0": 1.0, "1": 0.0, "2": 0.0}
    assert most_open == 2
