"""Gateway mode: the same router with cluster routers as its workers.

A region gateway sends each session to one cluster (``session_affinity``: bounded-load
consistent hashing on the session key) and lets the cluster's own router pick the
engine. It needs no tokenizer, index or NATS: the policies it may run
(``config.GATEWAY_POLICIES``) read only sessions and in-flight counts, so ``prepare``
skips tokenizing and hashing and the request costs one dict lookup more than a parse.
Cluster health is the cluster router's ``/health`` (503 when it has no usable engine).

Admission (router.admission) runs on the proxy's path here as on a cluster's router,
with clusters for engines; a held session's cluster is its ``home`` (where its cache
is), which late binding waits for as it waits for a prompt's prefix holder.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from policies.base import RouteRequest
from policies.session_affinity import SessionAffinity
from router.routing.decide import Parsed, Prepared, Router, max_tokens

if TYPE_CHECKING:
    from router.observe.tracing import Trace

# Rough bytes per prompt token: the in-flight size a load-only policy may weigh.
_BYTES_PER_TOKEN = 4


class GatewayRouter(Router):
    """A ``Router`` whose requests carry no tokens or block hashes."""

    async def prepare(self, parsed: Parsed, size_hint: int, trace: Trace | None = None) -> Prepared:
        workers = self.workers_for(parsed.model)
        request = RouteRequest(
            request_id=parsed.request_id,
            model=parsed.model,
            num_tokens=size_hint // _BYTES_PER_TOKEN,
            block_hashes=[],
            block_size=workers[0].pool.block_size,
            session_key=parsed.session_key,
            max_tokens=max_tokens(parsed.body),
        )
        return self.prepared(parsed, workers, request)

    def home(self, prep: Prepared) -> str | None:
        """The cluster a request's session belongs to, load aside (the first usable
        owner on ``session_affinity``'s ring): the one holding its conversation's cache.
        None without a session key, or for a policy that keeps no sessions."""
        policy = self.experiment.policy_for(prep.arm)
        if prep.request.session_key is None or not isinstance(policy, SessionAffinity):
            return None
        views = [replace(v, inflight_requests=0) for v in self.views(prep)]
        return policy.select(prep.request, views).worker_id if views else None
