"""``/admin/workers``: list, add, drain and remove workers.

An added worker is health-checked at once and its events resynced; a drained one takes no
new requests and finishes its own; a removed one leaves the index with its blocks.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.admin.common import AdminDeps, describe, json_body, json_response
from router.config import worker_spec
from router.http.errors import ApiError
from router.workers.registry import Worker


def mount(api: APIRouter, state: AdminDeps) -> None:
    registry = state.registry

    @api.get("/workers")
    async def list_workers() -> Response:
        now = time.monotonic()
        return json_response({"workers": [describe(state, w, now) for w in registry]})

    @api.post("/workers")
    async def add_worker(request: Request) -> Response:
        single_process(state, "adding a worker")
        try:
            spec = worker_spec(await json_body(state, request), "worker")
            worker = registry.add(spec)
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_worker") from exc
        await registry.check(state.client, worker)
        state.events.resync(worker.id)
        return json_response(describe(state, worker, time.monotonic()), 201)

    @api.post("/workers/{worker_id}/drain")
    async def drain_worker(worker_id: str) -> Response:
        single_process(state, "draining a worker")
        worker_or_404(state, worker_id)
        return json_response(describe(state, registry.drain(worker_id), time.monotonic()))

    @api.delete("/workers/{worker_id}")
    async def remove_worker(worker_id: str) -> Response:
        single_process(state, "removing a worker")
        worker_or_404(state, worker_id)
        worker = registry.remove(worker_id)
        return json_response(
            {"removed": worker_id, "inflight_requests": worker.load.inflight_requests}
        )


def single_process(state: AdminDeps, what: str) -> None:
    """Refuse a change to the worker set when other processes would not see it."""
    n = state.cfg.processes
    if n > 1:
        raise ApiError(
            409,
            f"{what} is refused: this router runs {n} processes (processes = {n}) and the "
            "change would reach only the one that answered; change the workers in the "
            "config (or --worker) and restart, or run one process",
            "multiple_processes",
        )


def worker_or_404(state: AdminDeps, worker_id: str) -> Worker:
    worker = state.registry.get(worker_id)
    if worker is None:
        raise ApiError(404, f"no worker {worker_id}", "worker_not_found")
    return worker
