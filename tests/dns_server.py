"""A real DNS server for the discovery tests: dnslib's UDP server on a free loopback
port, in a thread (not a test module).

It answers like the authoritative server of a Kubernetes headless service: A/AAAA
records for the names in ``hosts``, SRV records for the names in ``srv``, NODATA for a
known name asked for a type it lacks, NXDOMAIN for every other name; TTL 0, so the
router sees a change at its next resolution. ``stop`` closes the socket (an outage the
router must ride out); ``start`` serves again on the same port.

Why not dnsmasq (what these tests used): a Debian package the set-up had to install
beside pip; dnslib is a pure-Python wheel in the ``dev`` extra, and speaks the same wire.
"""

from __future__ import annotations

import ipaddress
import socket

from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A, DNSLabel, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSServer


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Records(BaseResolver):  # type: ignore[misc]
    def __init__(self, server: DnsServer) -> None:
        self.server = server

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()  # aa=1: the answer of the zone's own server
        qname = request.q.qname
        name = str(qname).rstrip(".")
        qtype = QTYPE[request.q.qtype]
        hosts, srv = self.server.hosts, self.server.srv
        if name not in hosts and not any(n == name for n, _, _ in srv):
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        if qtype in ("A", "AAAA"):
            for addr in hosts.get(name, []):
                six = ipaddress.ip_address(addr).version == 6
                if six == (qtype == "AAAA"):
                    rdata = AAAA(addr) if six else A(addr)
                    reply.add_answer(RR(qname, getattr(QTYPE, qtype), rdata=rdata, ttl=0))
        elif qtype == "SRV":
            for n, target, port in srv:
                if n == name:
                    rdata = SRV(priority=0, weight=0, port=port, target=DNSLabel(target))
                    reply.add_answer(RR(qname, QTYPE.SRV, rdata=rdata, ttl=0))
        return reply


class _Quiet:
    """dnslib logs every query to stdout by default."""

    def log_recv(self, *_a: object) -> None: ...
    def log_send(self, *_a: object) -> None: ...
    def log_request(self, *_a: object) -> None: ...
    def log_reply(self, *_a: object) -> None: ...
    def log_truncated(self, *_a: object) -> None: ...
    def log_error(self, *_a: object) -> None: ...
    def log_data(self, *_a: object) -> None: ...


class DnsServer:
    def __init__(self) -> None:
        self.port = free_udp_port()
        self.hosts: dict[str, list[str]] = {}
        self.srv: list[tuple[str, str, int]] = []
        self._server: DNSServer | None = None

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> DnsServer:
        """Serve on ``port`` (a port taken meanwhile by another process means another)."""
        for attempt in range(5):
            try:
                server = DNSServer(
                    _Records(self), port=self.port, address="127.0.0.1", logger=_Quiet()
                )
                break
            except OSError:
                if attempt == 4:
                    raise
                self.port = free_udp_port()
        server.start_thread()
        self._server = server
        return self

    def set_hosts(self, hosts: dict[str, list[str]]) -> None:
        """Replace the A/AAAA records (the next query sees them)."""
        self.hosts = {k: list(v) for k, v in hosts.items()}

    def set_srv(self, srv: list[tuple[str, str, int]]) -> None:
        """Replace the SRV records (the next query sees them)."""
        self.srv = list(srv)

    def stop(self) -> None:
        """Close the socket: queries go unanswered until ``start``."""
        if self._server is not None:
            self._server.stop()
            self._server.server.server_close()
            self._server = None

    def close(self) -> None:
        self.stop()
