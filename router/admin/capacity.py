"""``GET /admin/capacity``: the online capacity forecast (router/observe/capacity.py), per
model or for ``?model=``: how much cache each tier needs for the traffic routed so far."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from router.admin.common import AdminDeps, json_response
from router.http.errors import ApiError


def mount(api: APIRouter, state: AdminDeps) -> None:
    @api.get("/capacity")
    async def capacity(model: str | None = None) -> Response:
        """The capacity forecast, per model or for ``?model=``."""
        watch = state.capacity
        if watch is None:
            raise ApiError(404, "the capacity forecast is off (forecast_tracked = 0)", "off")
        if model is None:
            return json_response(watch.reports())
        if not state.registry.for_model(model):
            raise ApiError(404, f"no worker serves model {model}", "model_not_found")
        return json_response(watch.report(model))
