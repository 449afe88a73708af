"""Data-parallel ranks: one engine endpoint, ``dp_size`` KV caches.

An engine started with ``--data-parallel-size N`` (vLLM) or ``--dp N`` with DP attention
(SGLang) serves one HTTP endpoint but keeps one KV cache per rank, each publishing its
own KV events (vLLM: one ZMQ publisher per rank, its port offset by the rank, every batch
stamped ``data_parallel_rank``). A prefix on rank 3 is no hit for a request the engine's
own balancer puts on rank 5, so the router indexes and routes per *target*: one
(worker, rank) pair, named ``<worker>-dp<rank>``. That name is a worker id in every
place that takes one: the index, the events subject ``kv.events.<worker>-dp<rank>`` (run
one agent per rank with that id), metrics labels and prefetch hints. A worker with
``dp_size = 1`` is its own single target, named as before.

The chosen rank reaches the engine in the form it reads:

- vLLM: the ``X-data-parallel-rank`` header (``OpenAIServing._get_data_parallel_rank``
  in its API server; the internal balancer is skipped when it is set);
- SGLang: the body field ``routed_dp_rank`` (newer) or ``data_parallel_rank`` (older),
  picked per worker with ``dp_field``.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson

DpField = Literal["header", "routed_dp_rank", "data_parallel_rank"]
DP_FIELDS: tuple[DpField, ...] = ("header", "routed_dp_rank", "data_parallel_rank")
DP_HEADER = b"x-data-parallel-rank"
_SEP = "-dp"
MAX_DP_SIZE = 1024  # ranks per engine: far past any deployment, bounds the targets made


def target_id(worker_id: str, rank: int | None) -> str:
    """The target name of ``worker_id``'s ``rank`` (the worker itself when None)."""
    return worker_id if rank is None else f"{worker_id}{_SEP}{rank}"


def target_ids(worker_id: str, dp_size: int) -> list[str]:
    """Every target of a worker: itself, or one per rank."""
    if dp_size <= 1:
        return [worker_id]
    return [target_id(worker_id, r) for r in range(dp_size)]


def split_target(tid: str) -> tuple[str, int | None]:
    """``(worker, rank)`` of a target name that looks like one (the caller checks that the
    worker exists with that many ranks); ``(tid, None)`` otherwise."""
    head, sep, tail = tid.rpartition(_SEP)
    if sep and head and tail.isdigit() and (tail == "0" or tail[0] != "0"):
        return head, int(tail)
    return tid, None


def rank_headers(
    headers: list[tuple[bytes, bytes]], rank: int | None, field: DpField
) -> list[tuple[bytes, bytes]]:
    """``headers`` with the rank header for ``rank`` (unchanged when None); a client's own
    is replaced: the router's choice is the one the index matched against."""
    if rank is None:
        return headers
    out = [h for h in headers if h[0] != DP_HEADER]
    if field == "header":
        out.append((DP_HEADER, str(rank).encode()))
    return out


def rank_body(body: dict[str, Any], rank: int | None, field: DpField) -> dict[str, Any]:
    """``body`` with ``rank`` in the engine's field (``body`` itself when the rank goes in a
    header or is None); a client's own rank fields are replaced."""
    if rank is None or field == "header":
        return body
    out = {k: v for k, v in body.items() if k not in ("routed_dp_rank", "data_parallel_rank")}
    out[field] = rank
    return out


def forward_rank(
    headers: list[tuple[bytes, bytes]],
    raw: bytes,
    body: dict[str, Any],
    rank: int | None,
    field: DpField,
) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """Headers and body that pin the request to ``rank`` (unchanged when None)."""
    out = rank_body(body, rank, field)
    return rank_headers(headers, rank, field), raw if out is body else orjson.dumps(out)
