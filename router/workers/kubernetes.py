"""Engines found from the Kubernetes API: pods by label selector, watched.

Beside DNS discovery (``router.workers.discovery``), for clusters where the router may read
pods (RBAC: ``list`` and ``watch`` on ``pods`` in the namespace; ``deploy/kubernetes``):
each selector (one for mixed engines, or one per role of a disaggregated pool) is kept
in step with the API's list/watch protocol, as client-go's reflector does:

- LIST ``/api/v1/namespaces/NS/pods?labelSelector=S`` (pages of ``limit``, followed by
  ``continue``) gives every matching pod and the list's ``resourceVersion``;
- WATCH from that version (``watch=1``, ``allowWatchBookmarks=true``,
  ``timeoutSeconds``) streams ``ADDED``/``MODIFIED``/``DELETED`` events, one JSON object
  a line, and ``BOOKMARK``s that only move the version on; a pod relabelled out of the
  selector arrives as ``DELETED``, into it as ``ADDED``. A watch that ends is resumed
  from the last version seen;
- a version the server no longer keeps (``410 Gone``: the HTTP status, or an ``ERROR``
  event whose ``Status`` has code 410) means events were lost: list again, and what the
  new list lacks is gone.

A pod is an engine while it matches, has an IP, is not being deleted, and its
``Ready`` condition is ``True``. Going unready drains it (no new requests; its index
kept), ready again undrains it; deleted, relabelled away or terminating, it is drained
and removed once its requests are done or after ``drain_timeout``, as DNS discovery
does. A new engine starts down and is health-checked at once, so its first request
follows a good check and its agent's event replay.

What a pod says about itself, from its annotations (or labels): ``cache-router.io/
worker-id`` (default: the pod's name: the agent sidecar takes the same from the
downward API), ``cache-router.io/port`` (default: the source's ``port``),
``cache-router.io/dp-size`` (data-parallel ranks, router/dp.py), ``cache-router.io/
model``, ``cache-router.io/bootstrap-port`` (SGLang prefill engines).

In a pod, the API server, the token and the CA come from the service account
(``KUBERNETES_SERVICE_HOST``/``_PORT``, ``/var/run/secrets/kubernetes.io/
serviceaccount``); the token is read again at every (re)connect, since bound tokens
rotate. httpx only: no Kubernetes client library is needed at run time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from router.config import ConfigError, KubernetesSpec, Role, WorkerSpec
from router.workers.discovery import endpoint_url, reap, worker_token

if TYPE_CHECKING:
    from router.workers.registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ANNOTATION = "cache-router.io/"
PAGE = 500  # pods a list page holds
MAX_PODS = 4096  # per source: a runaway selector must not flood the registry


@dataclass(frozen=True, slots=True)
class Engine:
    """What a pod makes of itself: its worker, and whether it takes requests now."""

    worker_id: str
    spec: WorkerSpec | None  # None: no IP yet
    ready: bool


def pod_engine(pod: dict[str, Any], role: Role, k8s: KubernetesSpec) -> Engine | None:
    """The engine a pod is; None when it is on its way out (``deletionTimestamp``)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None
    said = {**(meta.get("labels") or {}), **(meta.get("annotations") or {})}

    def number(key: str, default: int | None) -> int | None:
        text = said.get(ANNOTATION + key)
        return int(text) if isinstance(text, str) and text.isdigit() else default

    worker_id = worker_token(str(said.get(ANNOTATION + "worker-id") or meta.get("name", "")))
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    ip = status.get("podIP")
    if not ip:
        return Engine(worker_id, None, False)
    port = number("port", k8s.port) or k8s.port
    spec = WorkerSpec(
        worker_id,
        endpoint_url(k8s.scheme, ip, port),
        said.get(ANNOTATION + "model") or k8s.model,
        k8s.pool,
        k8s.block_size,
        role=role,
        bootstrap_port=number("bootstrap-port", None),
        dp_size=number("dp-size", 1) or 1,
    )
    return Engine(worker_id, spec, ready)


class Gone(Exception):
    """The resource version is too old (410): list again."""


@dataclass
class Source:
    """One selector's pods, as last listed and watched."""

    role: Role
    selector: str
    pods: dict[str, Engine | None] = field(default_factory=dict)  # pod name -> engine
    version: str = ""
    synced: bool = False
    lists: int = 0
    watches: int = 0
    expired: int = 0


class KubernetesDiscovery:
    """Keeps the registry's workers from pods in step with the API server."""

    def __init__(
        self, spec: KubernetesSpec, registry: WorkerRegistry, drain_timeout: float
    ) -> None:
        self.spec = spec
        self.registry = registry
        self.drain_timeout = drain_timeout
        self.namespace = spec.namespace or _read(SERVICE_ACCOUNT / "namespace") or "default"
        self.api = (spec.api_server or _in_cluster()).rstrip("/")
        self.token_file = Path(spec.token_file) if spec.token_file else SERVICE_ACCOUNT / "token"
        ca = spec.ca_file or (str(SERVICE_ACCOUNT / "ca.crt") if spec.api_server is None else None)
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca) if ca else True
        roles: list[tuple[Role, str]] = [
            ("mixed", spec.selector),
            ("prefill", spec.prefill_selector),
            ("decode", spec.decode_selector),
        ]
        self.sources = [Source(role, sel) for role, sel in roles if sel or role == "mixed"]
        if spec.prefill_selector or spec.decode_selector:
            self.sources = [s for s in self.sources if s.selector]
        self.owned: dict[str, WorkerSpec] = {}  # workers this discovery added
        self.unready: set[str] = set()  # drained because their pod is not ready
        self.gone_since: dict[str, float] = {}  # drained because their pod left
        self.failures = 0
        self.checks: set[asyncio.Task[None]] = set()

    @property
    def synced(self) -> bool:
        """Every selector listed at least once: the pool is what the cluster has."""
        return all(s.synced for s in self.sources)

    # -- the API -----------------------------------------------------------------
    def _client(self) -> httpx.AsyncClient:
        token = _read(self.token_file)
        headers = {"accept": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        timeout = httpx.Timeout(10.0, read=self.spec.watch_timeout + 30.0)
        return httpx.AsyncClient(headers=headers, verify=self.verify, timeout=timeout)

    def _path(self) -> str:
        return f"{self.api}/api/v1/namespaces/{self.namespace}/pods"

    async def list(self, http: httpx.AsyncClient, source: Source) -> dict[str, Any]:
        """Every pod the selector matches (all pages) and the list's version."""
        items: list[Any] = []
        params: dict[str, Any] = {"labelSelector": source.selector, "limit": PAGE}
        while True:
            r = await http.get(self._path(), params=params)
            if r.status_code == 410:  # a page's continue token expired: start over
                raise Gone
            r.raise_for_status()
            page = orjson.loads(r.content)
            items += page.get("items") or []
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                return {"items": items[:MAX_PODS], "resourceVersion": meta["resourceVersion"]}
            params["continue"] = meta["continue"]

    async def watch(self, http: httpx.AsyncClient, source: Source) -> AsyncIterator[dict[str, Any]]:
        """The events after ``source.version`` until the server ends the watch."""
        params = {
            "labelSelector": source.selector,
            "watch": "1",
            "resourceVersion": source.version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(int(self.spec.watch_timeout)),
        }
        async with http.stream("GET", self._path(), params=params) as r:
            if r.status_code == 410:
                raise Gone
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.strip():
                    yield orjson.loads(line)

    # -- following ---------------------------------------------------------------
    async def follow(self, source: Source, client: httpx.AsyncClient) -> None:
        """List, then watch from the list's version, for ever; list again on 410."""
        while True:
            try:
                async with self._client() as http:
                    listed = await self.list(http, source)
                    source.lists += 1
                    source.pods = {
                        str(p["metadata"]["name"]): pod_engine(p, source.role, self.spec)
                        for p in listed["items"]
                    }
                    source.version = listed["resourceVersion"]
                    source.synced = True
                    await self._apply(client)
                    while True:
                        source.watches += 1
                        async for event in self.watch(http, source):
                            await self._event(source, event, client)
            except Gone:
                source.expired += 1
                log.info("kubernetes %s: version %s expired; listing again",
                         source.selector, source.version)  # fmt: skip
            except (httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
                self.failures += 1
                why = str(exc) or type(exc).__name__
                log.warning("kubernetes %s: %s; keeping %d workers",
                            source.selector, why, len(self.owned))  # fmt: skip
                await asyncio.sleep(self.spec.interval)

    async def _event(
        self, source: Source, event: dict[str, Any], client: httpx.AsyncClient
    ) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone
            raise ValueError(f"watch error {obj.get('code')}: {obj.get('message')}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind == "BOOKMARK":
            if version:
                source.version = version
            return
        name = str(obj["metadata"]["name"])
        if kind == "DELETED":
            source.pods.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            source.pods[name] = pod_engine(obj, source.role, self.spec)
        else:
            raise ValueError(f"watch event of type {kind!r}")
        if version:
            source.version = version
        await self._apply(client)

    # -- applying ----------------------------------------------------------------
    def wanted(self) -> tuple[dict[str, WorkerSpec], set[str]]:
        """Engines of ready pods by worker id, and the ids of pods present but unready
        (kept, drained: the engine's index survives a readiness blip)."""
        ready: dict[str, WorkerSpec] = {}
        present: set[str] = set()
        for source in self.sources:
            for engine in source.pods.values():
                if engine is None:
                    continue
                present.add(engine.worker_id)
                if engine.ready and engine.spec is not None:
                    ready.setdefault(engine.worker_id, engine.spec)
        return ready, {wid for wid in self.owned if wid in present and wid not in ready}

    async def _apply(self, client: httpx.AsyncClient) -> None:
        registry = self.registry
        ready, unready = self.wanted()
        fresh: list[Worker] = []
        for wid, spec in ready.items():
            worker = registry.get(wid)
            if worker is not None and self.owned.get(wid) == spec:
                if wid in self.gone_since or wid in self.unready:
                    self.gone_since.pop(wid, None)
                    self.unready.discard(wid)
                    worker.draining = False
                    log.info("kubernetes: %s is ready", wid)
                continue
            if worker is not None:
                if wid not in self.owned:
                    log.warning("kubernetes: worker %s exists already; not replaced", wid)
                    continue
                registry.remove(wid)  # same id, new address or shape: a new engine
                self.gone_since.pop(wid, None)
                self.unready.discard(wid)
            added = self._add(spec)
            if added is not None:
                fresh.append(added)
        now = time.monotonic()
        for wid in list(self.owned):
            worker = registry.get(wid)
            if worker is None:
                del self.owned[wid]
                continue
            if wid in ready:
                continue
            if wid in unready:
                if wid not in self.unready and wid not in self.gone_since:
                    self.unready.add(wid)
                    worker.draining = True
                    log.info("kubernetes: %s is not ready; draining", wid)
            elif wid not in self.gone_since:
                self.unready.discard(wid)
                worker.draining = True
                self.gone_since[wid] = now
                log.info("kubernetes: %s is gone; draining", wid)
        for worker in fresh:  # checked now, not at the next health round
            task = asyncio.create_task(registry.check(client, worker))
            self.checks.add(task)
            task.add_done_callback(self.checks.discard)
        self._reap(now)

    def _add(self, spec: WorkerSpec) -> Worker | None:
        try:
            worker = self.registry.add(spec)
        except ValueError as exc:
            log.warning("kubernetes: cannot add %s: %s", spec.id, exc)
            return None
        worker.healthy = False  # down until its first good check (router.workers.discovery)
        self.owned[spec.id] = spec
        log.info("kubernetes: found %s at %s (%s)", spec.id, spec.url, spec.role)
        return worker

    def _reap(self, now: float) -> None:
        for wid in reap(self.registry, self.gone_since, self.owned, self.drain_timeout, now):
            log.info("kubernetes: removed %s", wid)

    async def run(self, client: httpx.AsyncClient) -> None:
        """Follow every selector, and reap drained workers every ``interval``, for ever."""
        tasks = [asyncio.create_task(self.follow(s, client)) for s in self.sources]
        try:
            while True:
                await asyncio.sleep(self.spec.interval)
                self._reap(time.monotonic())
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, *self.checks, return_exceptions=True)

    def describe(self) -> dict[str, object]:
        return {
            "namespace": self.namespace,
            "selectors": {
                s.role: {
                    "selector": s.selector,
                    "resource_version": s.version,
                    "synced": s.synced,
                    "pods": len(s.pods),
                    "lists": s.lists,
                    "watches": s.watches,
                    "expired": s.expired,
                }
                for s in self.sources
            },
            "workers": sorted(self.owned),
            "unready": sorted(self.unready),
            "draining": sorted(self.gone_since),
            "failures": self.failures,
        }


def kubernetes_sources(
    specs: list[KubernetesSpec], registry: WorkerRegistry, drain_timeout: float
) -> list[KubernetesDiscovery]:
    """The configured ``[[kubernetes]]`` sources (``ConfigError`` outside a pod without
    ``api_server``)."""
    try:
        return [KubernetesDiscovery(spec, registry, drain_timeout) for spec in specs]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _in_cluster() -> str:
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ValueError("kubernetes discovery: no api_server and not in a pod")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
