"""Prefetch hints: ask the chosen worker to pull a prefix it lacks while the request queues.

The hint names blocks in the *source engine's* hashes (the target engine asks the
source, or the shared pool, for them by those names); the router's own hashes mean
nothing to an engine. The router->engine map comes from the source's KV events. Bytes
hashes (vLLM's sha256) travel as hex strings (``index.codec.hash_to_json``).
"""

from __future__ import annotations

import orjson

from index.codec import hash_to_json
from index.wire import DEFAULT_PREFIX, PrefetchHintMessage, Subjects
from policies.base import PrefetchHint, RouteRequest
from router.events.bus import Bus
from router.workers.pools import Pool


def hint_message(
    hint: PrefetchHint, request: RouteRequest, pool: Pool
) -> PrefetchHintMessage | None:
    """The ``kv.prefetch.<target>`` JSON object, or None when no engine hashes are known."""
    wanted = request.block_hashes[: hint.blocks]
    if hint.source_worker is not None:
        engine = pool.ingest.engine_hashes(hint.source_worker, wanted)
    else:  # the shared pool: whichever worker reported the blocks named them
        engine = max(
            (pool.ingest.engine_hashes(w, wanted) for w in pool.index.workers),
            key=len,
            default=[],
        )
    if not engine:
        return None
    return {
        "request_id": request.request_id,
        "model": request.model,
        "source_worker": hint.source_worker,
        "target_worker": hint.target_worker,
        "block_hashes": [hash_to_json(h) for h in engine],
        "num_tokens": len(engine) * request.block_size,
        "tier": hint.tier,
        "deadline_ms": hint.deadline_ms,
    }


class HintPublisher:
    def __init__(self, bus: Bus | None, prefix: str = DEFAULT_PREFIX) -> None:
        self.bus = bus
        self.subjects = Subjects(prefix)
        self.published = 0
        self.skipped = 0  # no engine hashes known, or no NATS

    async def publish(self, hint: PrefetchHint, request: RouteRequest, pool: Pool) -> bool:
        message = hint_message(hint, request, pool) if self.bus is not None else None
        if message is None or self.bus is None:
            self.skipped += 1
            return False
        subject = self.subjects.prefetch(hint.target_worker)
        if await self.bus.publish(subject, orjson.dumps(message)):
            self.published += 1
            return True
        self.skipped += 1
        return False
