"""A stand-in for the Kubernetes API server's pods endpoint, for the discovery tests.

The real API server cannot run on these machines, so this serves the part of its
protocol that ``router.kubernetes`` reads, as the API documents it ("Efficient
detection of changes", API concepts), over HTTPS (a trustme CA) with a bearer token:

- ``GET /api/v1/namespaces/NS/pods?labelSelector=S[&limit=N&continue=T]``: a
  ``PodList`` of the matching pods, its ``metadata.resourceVersion`` the store's, pages
  of ``limit`` followed by ``continue``;
- ``...&watch=1&resourceVersion=RV[&allowWatchBookmarks=true&timeoutSeconds=T]``: the
  events after ``RV`` as newline-delimited JSON in a chunked body: ``ADDED``,
  ``MODIFIED``, ``DELETED`` filtered by the selector on the old and the new object (a
  pod relabelled out of the selector is ``DELETED`` to that watch, into it ``ADDED``),
  ``BOOKMARK``s carrying only a newer version, and the end after ``timeoutSeconds``;
- a version older than the last compaction: ``ERROR`` with a ``Status`` of code 410
  (reason ``Expired``) as the watch's one event, or (``gone_status``) an HTTP 410.

Label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, comma-joined (equality-based;
no set-based ``in``). Only what the discovery uses is here; it is no API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import trustme
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


def matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def pod(
    name: str,
    labels: dict[str, str],
    *,
    ip: str | None = "127.0.0.1",
    ready: bool = True,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod object as the API serves it (the fields discovery reads, and a few more)."""
    status: dict[str, Any] = {
        "phase": "Running" if ip else "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": "",
            "uid": f"uid-{name}",
            "labels": labels,
            "annotations": annotations or {},
        },
        "spec": {"containers": [{"name": "engine", "image": "vllm"}]},
        "status": status,
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class StandInApiServer:
    """Pods of one namespace, their change history, and the list/watch endpoint."""

    def __init__(self, namespace: str, token: str, *, bookmark_every: float = 0.2) -> None:
        self.namespace = namespace
        self.token = token
        self.bookmark_every = bookmark_every
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 1000
        self.compacted = 0  # versions at or below this are gone
        self.history: list[tuple[int, str, dict[str, Any] | None, dict[str, Any]]] = []
        self.wakeup = asyncio.Event()
        self.closing = 0  # watches opened before this generation end at once
        self.gone_status = False  # answer an expired version with HTTP 410, not an event
        self.requests: list[dict[str, str]] = []
        self.watches_open = 0
        self.ca = trustme.CA()
        self.cert = self.ca.issue_cert("127.0.0.1")
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task[None] | None = None
        self.port = 0

    # -- the store ---------------------------------------------------------------
    def _record(self, kind: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        self.version += 1
        new["metadata"]["resourceVersion"] = str(self.version)
        new["metadata"]["namespace"] = self.namespace
        self.history.append((self.version, kind, old, copy.deepcopy(new)))
        self.wakeup.set()
        self.wakeup = asyncio.Event()

    def create(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        assert name not in self.pods
        self.pods[name] = obj
        self._record("ADDED", None, obj)

    def update(self, name: str, **changes: Any) -> None:
        """Change a pod: ``labels``, ``annotations``, ``ready``, ``ip``, ``deleting``."""
        old = copy.deepcopy(self.pods[name])
        obj = self.pods[name]
        if "labels" in changes:
            obj["metadata"]["labels"] = changes["labels"]
        if "annotations" in changes:
            obj["metadata"]["annotations"] = changes["annotations"]
        if "ready" in changes:
            obj["status"]["conditions"][1]["status"] = "True" if changes["ready"] else "False"
        if "ip" in changes:
            obj["status"]["podIP"] = changes["ip"]
        if changes.get("deleting"):
            obj["metadata"]["deletionTimestamp"] = "2026-12-07T00:00:00Z"
        self._record("MODIFIED", old, obj)

    def delete(self, name: str) -> None:
        obj = self.pods.pop(name)
        self._record("DELETED", copy.deepcopy(obj), obj)

    def compact(self) -> None:
        """Forget the history up to now and end every watch: a client resuming from a
        version it saw gets 410 and must list again."""
        self.compacted = self.version
        self.history.clear()
        self.closing += 1
        self.wakeup.set()
        self.wakeup = asyncio.Event()

    # -- the API -----------------------------------------------------------------
    async def pods_endpoint(self, request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return _json(_status(401, "Unauthorized", "Unauthorized"), 401)
        if request.path_params["ns"] != self.namespace:
            return _json({"kind": "PodList", "metadata": {"resourceVersion": str(self.version)},
                          "items": []})  # fmt: skip
        q = dict(request.query_params)
        self.requests.append(q)
        selector = q.get("labelSelector", "")
        if q.get("watch") in ("1", "true"):
            rv = int(q.get("resourceVersion") or self.version)
            if rv < self.compacted:
                if self.gone_status:
                    return _json(_status(410, "Expired", "too old resource version"), 410)
                return StreamingResponse(self._expired(rv), media_type="application/json")
            timeout = float(q.get("timeoutSeconds", "1800"))
            bookmarks = q.get("allowWatchBookmarks") == "true"
            return StreamingResponse(
                self._watch(selector, rv, timeout, bookmarks), media_type="application/json"
            )
        items = [p for _, p in sorted(self.pods.items()) if matches(selector, _labels(p))]
        start = int(q.get("continue") or 0)
        limit = int(q.get("limit") or 0) or len(items) or 1
        page = items[start : start + limit]
        meta: dict[str, Any] = {"resourceVersion": str(self.version)}
        if start + limit < len(items):
            meta["continue"] = str(start + limit)
        return _json({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": page})

    async def _expired(self, rv: int) -> AsyncIterator[bytes]:
        message = f"too old resource version: {rv} ({self.compacted})"
        yield _line({"type": "ERROR", "object": _status(410, "Expired", message)})

    async def _watch(
        self, selector: str, rv: int, timeout: float, bookmarks: bool
    ) -> AsyncIterator[bytes]:
        generation = self.closing
        deadline = time.monotonic() + timeout
        last_bookmark = time.monotonic()
        self.watches_open += 1
        try:
            while time.monotonic() < deadline and generation == self.closing:
                for version, kind, old, new in list(self.history):
                    if version <= rv:
                        continue
                    rv = version
                    event = _filtered(selector, kind, old, new)
                    if event is not None:
                        yield _line({"type": event, "object": new})
                if bookmarks and time.monotonic() - last_bookmark >= self.bookmark_every:
                    last_bookmark = time.monotonic()
                    # everything up to rv was sent (events of other pods too, filtered out)
                    mark = {"kind": "Pod", "apiVersion": "v1",
                            "metadata": {"resourceVersion": str(rv)}}  # fmt: skip
                    yield _line({"type": "BOOKMARK", "object": mark})
                wait = min(self.bookmark_every, max(0.0, deadline - time.monotonic()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wakeup.wait(), wait)
        finally:
            self.watches_open -= 1

    # -- serving -----------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def write_credentials(self, directory: Any) -> tuple[str, str]:
        """The token and CA files a pod's service account would hold."""
        token = directory / "token"
        token.write_text(self.token)
        ca = directory / "ca.crt"
        self.ca.cert_pem.write_to_path(str(ca))
        return str(token), str(ca)

    async def start(self, directory: Any) -> StandInApiServer:
        key = directory / "apiserver.key"
        crt = directory / "apiserver.crt"
        self.cert.private_key_pem.write_to_path(str(key))
        self.cert.cert_chain_pems[0].write_to_path(str(crt))
        app = Starlette(routes=[Route("/api/v1/namespaces/{ns}/pods", self.pods_endpoint)])
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", ssl_keyfile=str(key),
                                ssl_certfile=str(crt), timeout_graceful_shutdown=1)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.server.config.setup_event_loop = lambda: None  # type: ignore[method-assign]
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        self.compact()  # ends the watches, so the server can stop
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            await asyncio.wait_for(self.task, 10)


def _labels(obj: dict[str, Any] | None) -> dict[str, str]:
    return ((obj or {}).get("metadata") or {}).get("labels") or {}


def _filtered(
    selector: str, kind: str, old: dict[str, Any] | None, new: dict[str, Any]
) -> str | None:
    """The event a watch with ``selector`` sees for a change (None: none)."""
    was = old is not None and matches(selector, _labels(old))
    now = kind != "DELETED" and matches(selector, _labels(new))
    if kind == "DELETED":
        return "DELETED" if was else None
    if was and now:
        return "MODIFIED"
    if now:
        return "ADDED"
    return "DELETED" if was else None


def _line(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj) + b"\n"


def _json(obj: dict[str, Any], status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status, media_type="application/json")
