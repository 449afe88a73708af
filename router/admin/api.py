"""The admin API under ``/admin/``, behind a bearer token: one module per path.

Operators add, drain and remove workers (``workers``), read the index and event counters
(``index``), ask why a request would go where it goes (``explain``, which decides without
sending), hold the router's tokens against an engine's (``tokenize``), read the capacity
forecast (``capacity``) and watch the experiment arms (``experiments``). What they share
(the dependencies, the body limits, the bearer check) is ``router.admin.common``.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from router.admin import capacity, experiments, explain, index, tokenize, workers
from router.admin.common import AdminDeps, authorizer

HANDLERS = (workers, index, explain, tokenize, capacity, experiments)


def admin_router(state: AdminDeps) -> APIRouter:
    """Every admin route, each behind the bearer token (403 while none is configured)."""
    api = APIRouter(prefix="/admin", dependencies=[Depends(authorizer(state))])
    for handler in HANDLERS:
        handler.mount(api, state)
    return api
