"""A real DNS server for the discovery tests: dnsmasq on a free loopback UDP port (not a
test module).

A/AAAA records come from a hosts file that dnsmasq re-reads on SIGHUP; SRV records are
command-line options, so changing them restarts the server on the same port (a DNS
outage of a few milliseconds the router must ride out). Everything under ``.test`` that
is not listed answers NXDOMAIN, as an authoritative server would.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Dnsmasq:
    def __init__(self) -> None:
        binary = shutil.which("dnsmasq")
        if binary is None:
            pytest.fail("dnsmasq is not installed: apt-get install dnsmasq (.ci/run does)")
        self.binary = binary
        self.port = free_udp_port()
        self.dir = Path(tempfile.mkdtemp(prefix="dnsmasq-"))
        self.hosts_file = self.dir / "hosts"
        self.hosts: dict[str, list[str]] = {}
        self.srv: list[tuple[str, str, int]] = []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _write_hosts(self) -> None:
        lines = [f"{addr} {name}" for name, addrs in self.hosts.items() for addr in addrs]
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.chmod(0o644)
        tmp.replace(self.hosts_file)  # dnsmasq never reads half a file

    def start(self) -> Dnsmasq:
        """Start on a free port; a port taken meanwhile by another process means another."""
        for attempt in range(5):
            try:
                return self._start()
            except RuntimeError:
                if attempt == 4:
                    raise
                self.port = free_udp_port()
        raise AssertionError("unreachable")

    def _start(self) -> Dnsmasq:
        self._write_hosts()
        args = [
            self.binary,
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            f"--port={self.port}",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            f"--addn-hosts={self.hosts_file}",
            "--local=/test/",
            "--local-ttl=0",
            "--no-negcache",
            "--cache-size=0",
            "--pid-file=",
            "--user=root",
            "--log-facility=-",
            *(f"--srv-host={name},{target},{port}" for name, target, port in self.srv),
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_answering()
        return self

    def _wait_answering(self) -> None:
        """Until the server answers a query (bounded)."""
        query = bytes.fromhex("abcd01000001000000000000") + b"\x04ping\x04test\x00\x00\x01\x00\x01"
        deadline = time.monotonic() + 10
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.1)
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    raise RuntimeError(f"dnsmasq exited: {err}")
                s.sendto(query, ("127.0.0.1", self.port))
                try:
                    if s.recv(512)[:2] == b"\xab\xcd":
                        return
                except TimeoutError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("dnsmasq did not answer")

    def set_hosts(self, hosts: dict[str, list[str]]) -> None:
        """Replace the A/AAAA records; dnsmasq re-reads them on SIGHUP."""
        self.hosts = {k: list(v) for k, v in hosts.items()}
        self._write_hosts()
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def set_srv(self, srv: list[tuple[str, str, int]]) -> None:
        """Replace the SRV records: a restart on the same port."""
        self.srv = list(srv)
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            if self.proc.stderr is not None:
                self.proc.stderr.close()
            self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
