"""``POST /admin/explain``: where a request body would go and why, with every worker's
numbers (its match per tier, its load as the policy saw it, the policy's scores); for a
disaggregated pool both sides' choices. Nothing is sent."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from policies.base import NO_MATCH, Decision
from router.admin.common import AdminDeps, describe, json_response, raw_body

if TYPE_CHECKING:
    from policies.base import WorkerView
    from router.routing.decide import Kind, Prepared


def mount(api: APIRouter, state: AdminDeps) -> None:
    @api.post("/explain")
    async def explain(request: Request) -> Response:
        """The decision for a request body and every worker's numbers; nothing is sent."""
        raw = await raw_body(state, request)
        kind: Kind = "chat" if b'"messages"' in raw else "completion"
        headers = {
            k: v for k, v in request.headers.items() if k in ("x-session-id", "x-request-id")
        }
        router = state.router
        prep = await router.prepare(router.parse(kind, raw, headers), len(raw))
        disaggregated = state.pd is not None and state.pd.disaggregated(prep)
        pd = state.pd.explain(prep) if state.pd is not None and disaggregated else None
        if pd is None:
            decision, views = router.decide(prep)
            # nothing is sent: the policy must not count it in flight (cache_aware's credit)
            state.experiment.policy_for(prep.arm).on_finish(prep.request, decision.worker_id)
        else:  # "decision" is the engine that answers: the decode side's choice
            views = router.views(prep)
            decision = Decision(pd["decode"]["worker_id"], pd["decode"]["prefetch"],
                                pd["decode"]["scores"], pd["decode"]["reason"])  # fmt: skip
        chosen = state.registry.target(decision.worker_id)
        admission = None
        if state.gate is not None and prep.pinned is None:
            admission = state.gate.explain(
                prep, request.headers.raw, None if pd is None else state.pd
            )
        return json_response(
            {
                "request_id": prep.request.request_id,
                "model": prep.request.model,
                "pool": prep.pool.name,
                "arm": prep.arm,
                "policy": state.experiment.policy_for(prep.arm).name,
                "num_tokens": prep.request.num_tokens,
                "blocks": len(prep.request.block_hashes),
                "decision": {
                    "worker_id": decision.worker_id,
                    "worker": chosen[0].id if chosen is not None else decision.worker_id,
                    "dp_rank": chosen[1] if chosen is not None else None,
                    "reason": decision.reason,
                    "prefetch": decision.prefetch,
                },
                "workers": rows(state, prep, decision, views),
                **({} if pd is None else {"pd": pd}),
                # where the request would wait, and why (router.admission.gate)
                **({} if admission is None else {"admission": admission}),
            }
        )


def rows(
    state: AdminDeps, prep: Prepared, decision: Decision, views: list[WorkerView]
) -> list[dict[str, Any]]:
    """One row per candidate target (a DP worker's ranks each their own, router/workers/dp.py)."""
    by_id = {v.worker_id: v for v in views}
    matches = prep.pool.index.match_tiers(prep.request.block_hashes)
    now = time.monotonic()
    out = []
    for w in prep.workers:
        for rank, tid in enumerate(w.targets):
            view = by_id.get(tid)
            out.append(
                {
                    "worker_id": tid,
                    "worker": w.id,
                    "dp_rank": rank if w.dp_size > 1 else None,
                    "usable": w.usable(now),
                    # the policy saw it (a wide pool's decision sees the few that can win)
                    "considered": view is not None,
                    "in_sync": state.in_sync(tid, prep.pool),
                    "match": matches.get(tid, NO_MATCH),
                    "view": view,
                    "scores": decision.scores.get(tid, {}),
                    "state": describe(state, w, now),
                }
            )
    return out
