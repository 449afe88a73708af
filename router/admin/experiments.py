"""``GET /admin/experiments``: the experiment's arms (policy, weight, parameters) with each
arm's live totals: requests, prompt and hit tokens, errors, TTFT, hit rate."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from router.admin.common import AdminDeps, json_response


def mount(api: APIRouter, state: AdminDeps) -> None:
    @api.get("/experiments")
    async def experiments() -> Response:
        live = state.metrics.by_arm()
        arms = [
            {
                "name": a.name,
                "policy": a.policy,
                "weight": a.weight,
                "params": dict(a.params),
                "decode_policy": a.decode_policy,  # disaggregated pools; None: the router's
                "decode_params": dict(a.decode_params),
                "prefill_params": dict(a.prefill_params),  # over params, on prefill engines
                "metrics": live.get(a.name, {}),
            }
            for a in state.experiment.arms
        ]
        return json_response({"experiment": state.cfg.experiment, "arms": arms})
