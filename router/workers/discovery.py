"""Engines found by DNS: a name's A/AAAA or SRV records, re-resolved on an interval.

A Kubernetes headless service resolves to its ready pods, so the pool follows the
deployment without the admin API. Each resolution is compared with the last:

- a new address becomes a worker that starts *down* and is checked at once; it takes
  traffic after its first good health check, and coming up asks its agent for a replay,
  as any worker back from the dead does, so no request meets an engine not yet serving;
- an address that is gone is drained (no new requests) and removed once its in-flight
  requests are done, or after ``drain_timeout`` seconds; if it comes back meanwhile it is
  undrained, keeping its index;
- a failed resolution (timeout, SERVFAIL, no nameserver) changes nothing: a DNS blip
  must not empty the pool. Only an answer (NXDOMAIN or no records) removes engines.

Worker ids are NATS subject tokens (``kv.events.<id>``) that the engine's agent must
use too, so they are derived from what the agent's pod knows about itself: for SRV the
target's first label (a StatefulSet pod's name) and the port, ``vllm-0-8000``; for
A/AAAA the name's first label and the address, ``vllm-10-1-2-3-8000``; every character
other than a letter, digit, ``-`` or ``_`` becomes ``-`` (``::1`` gives ``--1``).

dnspython (the ``discovery`` extra) does the resolving; it is imported only when a
discovery source is configured.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from router.config import DiscoverySpec, WorkerSpec

if TYPE_CHECKING:
    import httpx

    from router.workers.registry import WorkerRegistry

log = logging.getLogger(__name__)

MAX_ENDPOINTS = 1024  # per name: a runaway record set must not flood the registry
TIMEOUT = 2.0  # seconds one resolution may take, all its queries together


def extra_missing() -> str | None:
    """Why discovery cannot run here (dnspython not installed), or None."""
    try:
        import dns.asyncresolver  # noqa: F401
    except ImportError:
        return "DNS discovery needs dnspython: pip install 'cache-router[discovery]'"
    return None


@dataclass(frozen=True, slots=True)
class Endpoint:
    worker_id: str
    url: str


def worker_token(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", text).strip("-")[:100] or "engine"


def endpoint_url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


def _label(name: str) -> str:
    return next((p for p in name.split(".") if p and not p.startswith("_")), name)


class DnsDiscovery:
    """Keeps the registry's workers from one DNS name in step with its records."""

    def __init__(self, spec: DiscoverySpec, registry: WorkerRegistry, drain_timeout: float) -> None:
        import dns.asyncresolver

        self.spec = spec
        self.registry = registry
        self.drain_timeout = drain_timeout
        self.resolver = dns.asyncresolver.Resolver(configure=spec.nameserver is None)
        if spec.nameserver is not None:
            host, port = _hostport(spec.nameserver)
            self.resolver.nameservers = [host]
            self.resolver.port = port
        self.resolver.lifetime = TIMEOUT
        self.owned: dict[str, Endpoint] = {}  # workers this source added
        self.gone_since: dict[str, float] = {}  # drained because their record went away
        self.resolutions = 0
        self.failures = 0

    # -- resolving ---------------------------------------------------------------
    async def resolve(self) -> set[Endpoint] | None:
        """The engines the name points at now; None when DNS did not answer."""
        spec = self.spec
        if spec.record == "srv":
            srv = await self._query(spec.name, "SRV")
            if srv is None:
                return None
            found: set[Endpoint] = set()
            for rr in srv[:MAX_ENDPOINTS]:
                target = rr.target.to_text().rstrip(".")
                addresses = await self._addresses(target)
                if addresses is None:
                    return None  # half an answer would drain the engines not looked up
                wid = worker_token(f"{_label(target)}-{rr.port}")
                url = endpoint_url(spec.scheme, addresses[0], rr.port) if addresses else None
                if url is not None:
                    found.add(Endpoint(wid, url))
            return found
        addresses = await self._addresses(spec.name)
        if addresses is None:
            return None
        label = _label(spec.name)
        port, scheme = spec.port, spec.scheme
        return {
            Endpoint(worker_token(f"{label}-{a}-{port}"), endpoint_url(scheme, a, port))
            for a in addresses[:MAX_ENDPOINTS]
        }

    async def _addresses(self, name: str) -> list[str] | None:
        try:
            return [str(ipaddress.ip_address(name))]  # an SRV target may be an address
        except ValueError:
            pass
        v4, v6 = await asyncio.gather(self._query(name, "A"), self._query(name, "AAAA"))
        if v4 is None and v6 is None:
            return None
        return sorted({rr.to_text() for rr in [*(v4 or []), *(v6 or [])]})

    async def _query(self, name: str, rdtype: str) -> list[Any] | None:
        """The records; [] for NXDOMAIN or none of this type; None when DNS failed."""
        import dns.exception
        import dns.resolver

        try:
            answer = await self.resolver.resolve(name, rdtype, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except (dns.exception.DNSException, OSError) as exc:
            log.debug("discovery %s %s: %s", name, rdtype, exc)
            return None
        return list(answer)

    # -- applying ----------------------------------------------------------------
    async def step(self, client: httpx.AsyncClient) -> None:
        """Resolve once and bring the registry in line."""
        found = await self.resolve()
        self.resolutions += 1
        if found is None:
            self.failures += 1
            log.warning("discovery %s: DNS did not answer; keeping %d workers",
                        self.spec.name, len(self.owned))  # fmt: skip
        else:
            await self._apply(found, client)
        self._reap(time.monotonic())

    async def _apply(self, found: set[Endpoint], client: httpx.AsyncClient) -> None:
        registry = self.registry
        by_id = {e.worker_id: e for e in found}
        for wid, ep in by_id.items():
            worker = registry.get(wid)
            if worker is not None and self.owned.get(wid) == ep:
                if wid in self.gone_since:  # back before it was removed
                    del self.gone_since[wid]
                    worker.draining = False
                    log.info("discovery %s: %s is back", self.spec.name, wid)
                continue
            if worker is not None:
                if wid not in self.owned:
                    log.warning("discovery %s: worker %s exists already; not replaced",
                                self.spec.name, wid)  # fmt: skip
                    continue
                registry.remove(wid)  # same id, new address: a new engine
            self._add(ep)
        for wid in list(self.owned):
            if wid not in by_id and wid not in self.gone_since:
                worker = registry.get(wid)
                if worker is None:
                    del self.owned[wid]
                    continue
                worker.draining = True
                self.gone_since[wid] = time.monotonic()
                log.info("discovery %s: %s is gone; draining", self.spec.name, wid)
        fresh = [w for wid in by_id if (w := registry.get(wid)) is not None and not w.healthy]
        await asyncio.gather(*(registry.check(client, w) for w in fresh))

    def _add(self, ep: Endpoint) -> None:
        spec = self.spec
        try:
            worker = self.registry.add(
                WorkerSpec(ep.worker_id, ep.url, spec.model, spec.pool, spec.block_size)
            )
        except ValueError as exc:
            log.warning("discovery %s: cannot add %s: %s", spec.name, ep.worker_id, exc)
            return
        # Down until its first good check: its engine may still be loading, and coming up
        # runs the registry's on_up hooks (the event replay) like any recovery.
        worker.healthy = False
        self.owned[ep.worker_id] = ep
        log.info("discovery %s: found %s at %s", spec.name, ep.worker_id, ep.url)

    def _reap(self, now: float) -> None:
        for wid in reap(self.registry, self.gone_since, self.owned, self.drain_timeout, now):
            log.info("discovery %s: removed %s", self.spec.name, wid)

    async def run(self, client: httpx.AsyncClient) -> None:
        """Resolve every ``interval`` seconds, forever."""
        while True:
            try:
                await self.step(client)
            except Exception:  # a bug here must not stop discovery for good
                log.exception("discovery %s failed", self.spec.name)
            await asyncio.sleep(self.spec.interval)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.spec.name,
            "record": self.spec.record,
            "workers": sorted(self.owned),
            "draining": sorted(self.gone_since),
            "resolutions": self.resolutions,
            "failures": self.failures,
        }


T = TypeVar("T")


def reap(
    registry: WorkerRegistry,
    gone_since: dict[str, float],
    owned: dict[str, T],
    drain_timeout: float,
    now: float,
) -> list[str]:
    """Remove the drained workers (``gone_since``: when each left) whose requests are done
    or who took longer than ``drain_timeout``; the ids removed from the registry. Every
    discovery backend drains a worker that left the same way."""
    removed = []
    for wid, since in list(gone_since.items()):
        worker = registry.get(wid)
        if worker is not None:
            if worker.load.inflight_requests and now - since <= drain_timeout:
                continue
            registry.remove(wid)
            removed.append(wid)
        del gone_since[wid]
        owned.pop(wid, None)
    return removed


def _hostport(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [v6]:port
        host, _, port = text[1:].partition("]:")
        return host, int(port or 53)
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, int(port)
    return text, 53
