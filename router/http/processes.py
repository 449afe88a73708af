"""``cache-router serve --processes N``: N router processes on one port, one supervisor.

One Python event loop is one core; the Rust routers it is compared with use every core.
The supervisor starts N children, each a full router (``router.http.serve``) listening on the
same host:port with ``SO_REUSEPORT``, so the kernel spreads connections over them. They
are replicas of one another (``router.events.replicas``): each reads the KV events from NATS
itself and shares its in-flight load and predict-on-route marks with the others, which is
why more than one process needs ``nats_url`` (``router.config`` refuses it otherwise).

- Every child gets the supervisor's resolved config (a pickle in a private 0700
  directory, removed when the supervisor stops, or by the last child if it was killed),
  so a child restarted after the TOML file changed does not diverge from the
  others; its replica id is ``<base>-p<index>``, kept across restarts so peers replace its
  rows instead of counting a dead one's load until ``peer_ttl``.
- A child that dies is restarted after a back-off (0.5 s doubling to 30 s, reset once it
  has run 30 s) and logged; one that exits with code 2 (its config cannot be served) stops
  them all. SIGTERM/SIGINT stop every child (each drains for ``drain_timeout``), then
  SIGKILL what is left; on Linux a child also gets SIGTERM if the supervisor is killed.
- Each child also answers on a unix socket in the private directory. ``GET /metrics`` on
  the public port gathers every child's metrics over them and labels each sample with
  ``process``, so a scrape is all processes, not the one the kernel picked
  (``cache_router_process_up{process}`` says which answered).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from router.config import RouterConfig
from router.events.replicas import default_replica_id
from router.http.asgi import App, Receive, Scope, Send

log = logging.getLogger(__name__)

ENV = "_CACHE_ROUTER_PROCESS"  # set by the supervisor in its children only
CONFIG_FILE = "config.pickle"
BACKOFF_FIRST = 0.5  # seconds before the first restart of a child
BACKOFF_MAX = 30.0
STABLE_AFTER = 30.0  # a child that ran this long starts its back-off afresh
STOP_GRACE = 10.0  # beyond drain_timeout, before SIGKILL
KILL_WAIT = 5.0
POLL = 0.1
SCRAPE_TIMEOUT = 5.0
CONFIG_EXIT = 2  # what ``cache-router serve`` returns for a config it cannot serve
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class Child:
    """What a child process is told by its supervisor (``ENV``, JSON)."""

    index: int
    count: int
    dir: str
    replica_id: str
    supervisor: int  # its pid

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Child | None:
        raw = (os.environ if env is None else env).get(ENV)
        return None if raw is None else cls(**orjson.loads(raw))

    def config(self) -> RouterConfig:
        """The supervisor's config, with this child's replica id."""
        cfg = pickle.loads(Path(self.dir, CONFIG_FILE).read_bytes())
        if not isinstance(cfg, RouterConfig):
            raise TypeError(f"{self.dir}/{CONFIG_FILE} holds no RouterConfig")
        return dataclasses.replace(cfg, replica_id=self.replica_id)

    def control_path(self, index: int | None = None) -> str:
        return str(Path(self.dir, f"{self.index if index is None else index}.sock"))

    def exited(self) -> None:
        """After serving: a child whose supervisor was killed removes the private
        directory (the config in it holds the tokens) that the supervisor would have."""
        if os.getppid() != self.supervisor:
            shutil.rmtree(self.dir, ignore_errors=True)


def reuseport_socket(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A TCP socket bound to host:port with ``SO_REUSEPORT`` (and listening, by default)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        if listen:
            sock.listen(4096)
        sock.set_inheritable(False)
    except OSError:
        sock.close()
        raise
    return sock


def control_socket(path: str) -> socket.socket:
    """The child's private unix socket (the supervisor's 0700 directory holds it)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a socket left by the previous run of this child
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(64)
    return sock


# -- the children's /metrics, gathered --------------------------------------------------------


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge_metrics(texts: dict[int, str | None]) -> bytes:
    """One exposition of every child's metrics, each sample labelled ``process``; a child
    that did not answer (``None``) has ``cache_router_process_up`` 0."""
    families: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text or ""):
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            label = {"process": str(index)}
            out.samples.extend(s._replace(labels={**s.labels, **label}) for s in fam.samples)
    up = GaugeMetricFamily(
        "cache_router_process_up",
        "1 if this router process answered the scrape (router/http/processes.py)",
        labels=["process"],
    )
    for index, text in sorted(texts.items()):
        up.add_metric([str(index)], 0.0 if text is None else 1.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), up]))
    return generate_latest(registry)


class ProcessesApp:
    """A child's ASGI app: ``GET /metrics`` on the public port gathers every child's."""

    def __init__(self, app: App, child: Child) -> None:
        self.app = app
        self.child = child

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # uvicorn re-raises SIGTERM after it: no later hook
            try:
                await self.app(scope, receive, send)
            finally:
                self.child.exited()
            return
        # uvicorn's server address on the unix socket is (path, None): a sibling asking
        server = scope.get("server")
        public = scope["type"] == "http" and server is not None and server[1] is not None
        if public and scope["path"] == "/metrics" and scope["method"] == "GET":
            await self._gathered(scope, send)
            return
        await self.app(scope, receive, send)

    async def _gathered(self, scope: Scope, send: Send) -> None:
        auth = [(k, v) for k, v in scope["headers"] if k == b"authorization"]
        # all at once: one child restarting costs the scrape one SCRAPE_TIMEOUT, not one each
        indexes = range(self.child.count)
        answers = await asyncio.gather(
            *(_scrape(self.child.control_path(i), auth) for i in indexes)
        )
        status, body = answers[self.child.index]
        if status != 200:  # a refusal (401) is ours to pass
            await _answer(send, status, body, b"application/json")
            return
        texts = {
            i: b.decode() if s == 200 else None for i, (s, b) in zip(indexes, answers, strict=True)
        }
        await _answer(send, 200, merge_metrics(texts), CONTENT_TYPE_LATEST.encode())


async def _scrape(path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    transport = httpx.AsyncHTTPTransport(uds=path)
    try:
        async with httpx.AsyncClient(transport=transport, timeout=SCRAPE_TIMEOUT) as client:
            r = await client.get("http://process/metrics", headers=headers)
            return r.status_code, r.content
    except httpx.HTTPError as exc:  # restarting, or not up yet
        log.debug("metrics of %s: %s", path, exc)
        return 0, b""


async def _answer(send: Send, status: int, body: bytes, kind: bytes) -> None:
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# -- the supervisor ---------------------------------------------------------------------------


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class _Slot:
    __slots__ = ("failures", "index", "proc", "restart_at", "started")

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.failures = 0
        self.restart_at = 0.0


class Supervisor:
    """Starts ``cfg.processes`` children, restarts the ones that die, stops them all."""

    def __init__(self, cfg: RouterConfig, log_level: str = "info") -> None:
        self.cfg = cfg
        self.log_level = log_level
        self.base_id = cfg.replica_id or default_replica_id()
        self.slots = [_Slot(i) for i in range(cfg.processes)]
        self.stopping: int | None = None  # the signal that asked us to stop
        self.dir = ""

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; the exit code (2: a child could not start)."""
        try:  # holding the port (bound, not listening) keeps others without SO_REUSEPORT off
            hold = reuseport_socket(self.cfg.host, self.cfg.port, listen=False)
        except OSError as exc:
            log.error("cannot listen on %s:%s: %s", self.cfg.host, self.cfg.port, exc)
            return CONFIG_EXIT
        self.dir = tempfile.mkdtemp(prefix="cache-router-")  # 0700
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            Path(self.dir, CONFIG_FILE).write_bytes(pickle.dumps(self.cfg))
            log.info(
                "supervisor %d: %d router processes on %s:%d, private directory %s",
                os.getpid(), len(self.slots), self.cfg.host, self.cfg.port, self.dir,
            )  # fmt: skip
            code = self._loop()
            self._stop_all()
            return code
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            hold.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping = signum

    def _loop(self) -> int:
        while self.stopping is None:
            now = time.monotonic()
            for slot in self.slots:
                if slot.proc is None:
                    if now >= slot.restart_at:
                        self._start(slot, now)
                    continue
                code = slot.proc.poll()
                if code is None:
                    if slot.failures and now - slot.started >= STABLE_AFTER:
                        slot.failures = 0
                    continue
                if self.stopping is not None:
                    break
                if code == CONFIG_EXIT:
                    log.error(
                        "process %d (pid %d) cannot serve this config (exit %d): stopping",
                        slot.index, slot.proc.pid, code,
                    )  # fmt: skip
                    return CONFIG_EXIT
                delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2**slot.failures)
                slot.failures += 1
                slot.restart_at = now + delay
                log.warning(
                    "process %d (pid %d) exited with %s after %.1f s; restarting in %.1f s",
                    slot.index, slot.proc.pid, _exit(code), now - slot.started, delay,
                )  # fmt: skip
                slot.proc = None
            time.sleep(POLL)
        return 0

    def _start(self, slot: _Slot, now: float) -> None:
        replica_id = f"{self.base_id}-p{slot.index}"
        child = Child(slot.index, len(self.slots), self.dir, replica_id, os.getpid())
        env = {**os.environ, ENV: orjson.dumps(dataclasses.asdict(child)).decode()}
        slot.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--log-level", self.log_level],
            env=env,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        slot.started = now
        log.info("process %d started (pid %d)", slot.index, slot.proc.pid)

    def _stop_all(self) -> None:
        live = [s.proc for s in self.slots if s.proc is not None and s.proc.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.drain_timeout + STOP_GRACE
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("process pid %d did not stop in time: killed", proc.pid)
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(KILL_WAIT)
        log.info("supervisor %d: all router processes stopped", os.getpid())


def _exit(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
