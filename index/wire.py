"""The NATS wire between engines' agents and routers: subjects, headers, stream, schemas.

Every name here is a contract that deployments script against (ACLs on subjects,
stream configs, other agents speaking the format), so it is spelled out once, as
Dynamo keeps its subjects in ``protocols.rs``; router and agent import it from here.

Subjects, under a prefix (``kv`` unless configured):

==============================  ==========  ======================================
``<prefix>.events.<worker>``    agent ->    KV-event batches (msgpack ``EventBatch``),
                                            headers ``Kv-Seq``, ``Kv-Epoch``,
                                            ``Kv-Dp-Rank``; kept by the stream
``<prefix>.replay.<worker>``    router ->   gap fill: ``index.gapfill`` request/answer
``<prefix>.load.<worker>``      agent ->    ``LoadReport`` JSON
``<prefix>.prefetch.<worker>``  router ->   ``PrefetchHintMessage`` JSON
``<prefix>.blocks.<worker>``    agent ->    ``{"block_hashes": [...]}`` request,
                                            ``{"token_ids": [...]}`` answer
``<prefix>.route.<replica>``    router ->   replica load and marks (``router.events.replicas``,
                                            msgpack ``[ROUTE_VERSION, ...]``)
==============================  ==========  ======================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NotRequired, TypedDict

DEFAULT_PREFIX = "kv"

# A worker id is one subject token (``kv.events.<id>``): no ``.``, ``*``, ``>`` or space,
# which would subscribe on (or publish as) other workers' subjects, and short, since the
# server closes a client whose control line exceeds 4 KiB. Router and agent both check it.
WORKER_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def worker_id_error(worker_id: str) -> str | None:
    """Why ``worker_id`` cannot name a worker on the wire, or None if it can."""
    if WORKER_ID.fullmatch(worker_id):
        return None
    shown = worker_id if len(worker_id) <= 40 else worker_id[:40] + "..."
    return (
        f"worker id {shown!r} must be 1 to 128 letters, digits, - or _ "
        "(it is a NATS subject token)"
    )

# Headers of each ``events`` batch: the agent's per-worker sequence number (gaps are
# detected on it), the engine life it belongs to, and the data-parallel rank if any.
SEQ_HEADER = "Kv-Seq"
EPOCH_HEADER = "Kv-Epoch"
DP_RANK_HEADER = "Kv-Dp-Rank"
# ``Kv-Seq`` of the batch (one ``AllBlocksCleared``) an agent publishes the moment it finds
# its engine restarted, before the new life sent anything: routers clear the worker
# now instead of at the engine's next batch, which expects seq 0.
EPOCH_START_SEQ = -1

# The JetStream stream on ``<prefix>.events.>`` that lets a late router catch up.
DEFAULT_STREAM = "KV_EVENTS"
DEFAULT_MAX_AGE = 900.0  # seconds: bridges restarts; older state comes cheaper as agent dumps
DEFAULT_MAX_BYTES = 256 << 20

ROUTE_VERSION = 1  # first element of every ``route`` message


@dataclass(frozen=True, slots=True)
class Subjects:
    """The subjects under one prefix."""

    prefix: str = DEFAULT_PREFIX

    def events(self, worker: str) -> str:
        return f"{self.prefix}.events.{worker}"

    @property
    def all_events(self) -> str:
        """What the stream captures and a core-NATS router subscribes to."""
        return f"{self.prefix}.events.>"

    def gap_fill(self, worker: str) -> str:
        return f"{self.prefix}.replay.{worker}"

    def load(self, worker: str) -> str:
        return f"{self.prefix}.load.{worker}"

    @property
    def all_loads(self) -> str:
        return f"{self.prefix}.load.*"

    def prefetch(self, worker: str) -> str:
        return f"{self.prefix}.prefetch.{worker}"

    def blocks(self, worker: str) -> str:
        return f"{self.prefix}.blocks.{worker}"

    def route(self, replica: str) -> str:
        return f"{self.prefix}.route.{replica}"

    @property
    def all_routes(self) -> str:
        return f"{self.prefix}.route.*"

    def responses(self, replica: str) -> str:
        """Response ids and the worker that stored each (``router.routing.affinity``)."""
        return f"{self.prefix}.responses.{replica}"

    @property
    def all_responses(self) -> str:
        return f"{self.prefix}.responses.*"


class LoadReport(TypedDict):
    """``<prefix>.load.<worker>``: the engine's gauges; the router bounds each."""

    running: int
    waiting: int
    kv_usage: float  # 0..1
    ts: float  # unix seconds at the scrape
    # where the engine says (router.workers.load.EngineLoad): of ``waiting``, those held
    # back for their own reasons; requests preempted so far; its KV cache in tokens
    deferred: NotRequired[int]
    preemptions: NotRequired[float]
    kv_tokens: NotRequired[int]


class PrefetchHintMessage(TypedDict):
    """``<prefix>.prefetch.<target>``: pull these blocks (engine hashes) before the request."""

    request_id: str
    model: str
    source_worker: str | None  # None: the shared pool
    target_worker: str
    # in the source engine's hashes, prefix order; bytes hashes (vLLM's sha256) as hex
    block_hashes: list[int | str]
    num_tokens: int
    tier: str
    deadline_ms: float
