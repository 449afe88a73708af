"""The worker registry: who serves what, who is healthy, who is draining.

Health has two signals. The active check polls ``GET /health`` and flips a worker
down after ``unhealthy_after`` failures in a row and up after ``healthy_after``
successes. The passive circuit breaker counts failed requests (connect errors, 5xx):
after ``breaker_failures`` in a row the worker gets no traffic for ``breaker_cooldown``
seconds, then one trial request decides. A request that fails on a worker (connect
refused, a stream broken off) makes the registry check that worker at once instead of
at the next round, so a dead engine is down within ``unhealthy_after`` quick checks.

A worker going down or leaving loses its blocks from the index: a dead engine's cache
died with it, and a restarted one starts empty, so stale entries would only send
prefix traffic to a cold engine. When it is back, ``on_up`` hooks run (the router
asks its agent for a replay), so the index holds what the new engine holds.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from index.groups import parse_groups
from router.config import RouterConfig, WorkerSpec, pool_roles_error, role_error
from router.forward.upstream import Upstream, UpstreamError
from router.workers.dp import DpField, split_target, target_ids
from router.workers.load import WorkerLoad, parse_engine_metrics
from router.workers.lora import MODELS_EVERY, LoraSlots, parse_lora_info
from router.workers.pools import Pool

log = logging.getLogger(__name__)

PROBE_GAP = 0.1  # seconds between the quick checks of a suspect worker
MAX_SCRAPE_BYTES = 16 << 20  # an engine's /metrics (vLLM's with LoRA adapters: ~100 KB)


class Worker:
    """One engine endpoint as the router knows it."""

    __slots__ = (
        "_changed",
        "_models",
        "base_models",
        "bootstrap_port",
        "breaker_until",
        "candidates",
        "dp_field",
        "dp_size",
        "draining",
        "fail_streak",
        "healthy",
        "id",
        "last_error",
        "load",
        "lora",
        "ok_streak",
        "pool",
        "rank_loads",
        "request_failures",
        "role",
        "targets",
        "url",
    )

    def __init__(self, spec: WorkerSpec, pool: Pool) -> None:
        self.id = spec.id
        self.url = spec.url
        # told when ``models`` changes (the registry's ``for_model`` cache; None: no one)
        self._changed: Callable[[], None] | None = None
        self._models: frozenset[str] = frozenset((spec.model,)) if spec.model else frozenset()
        # what the config says it serves: adapters it lists are added (router/workers/lora.py)
        self.base_models = self._models
        self.lora: LoraSlots | None = None  # its adapter slots, when it reports them
        self.pool = pool
        self.role = spec.role  # "mixed", or one side of a disaggregated pool (router.pd.exchange)
        self.bootstrap_port = spec.bootstrap_port
        self.load = WorkerLoad()
        self.dp_size = spec.dp_size
        self.dp_field: DpField = spec.dp_field
        # the (worker, rank) pairs the index and the policies see (router/workers/dp.py); each rank
        # counts this router's own requests on it, the engine reports the ranks' sum
        self.targets = target_ids(spec.id, spec.dp_size)
        self.rank_loads = [WorkerLoad() for _ in self.targets] if spec.dp_size > 1 else []
        # each target with the load its requests count against, paired once: every
        # request's views walk these (pairing them per request cost ~0.2 us a worker)
        self.candidates = tuple(zip(self.targets, self.rank_loads or (self.load,), strict=True))
        self.healthy = True  # until a check says otherwise; failed sends trip the breaker
        self.draining = False
        self.fail_streak = 0
        self.ok_streak = 0
        self.request_failures = 0
        self.breaker_until = 0.0
        self.last_error: str | None = None

    @property
    def models(self) -> frozenset[str]:
        """The models it serves (its base model and the adapters it lists)."""
        return self._models

    @models.setter
    def models(self, models: frozenset[str]) -> None:
        models = frozenset(models)  # never a set changed in place behind the registry
        if models != self._models:
            self._models = models
            if self._changed is not None:
                self._changed()

    def usable(self, now: float) -> bool:
        return self.healthy and not self.draining and now >= self.breaker_until

    def rank_load(self, rank: int | None) -> WorkerLoad:
        """The load a request on ``rank`` counts against (the worker's own without ranks)."""
        return self.load if rank is None else self.rank_loads[rank]

    def forget_blocks(self) -> None:
        """Drop every target's blocks and event state (its engine's caches are gone)."""
        for tid in self.targets:
            self.pool.ingest.remove_worker(tid)

    def describe(self, now: float) -> dict[str, object]:
        return {
            "id": self.id,
            "url": self.url,
            "models": sorted(self.models),
            "pool": self.pool.name,
            "role": self.role,
            "block_size": self.pool.block_size,
            "dp_size": self.dp_size,
            "healthy": self.healthy,
            "draining": self.draining,
            "breaker_open": now < self.breaker_until,
            "in_sync": all(self.pool.ingest.in_sync(t) for t in self.targets),
            "last_error": self.last_error,
            "load": self.load.snapshot(),
        }


class WorkerRegistry:
    """All workers, their pools, and the loop that keeps their health and load fresh."""

    def __init__(
        self, cfg: RouterConfig, *, keep_names: bool = True, tls: ssl.SSLContext | None = None
    ) -> None:
        """``keep_names``: whether the pools keep the bytes engines name blocks by, which
        only prefetch hints read (``RouterState`` says whether any policy sends them).
        ``tls``: the context ``https`` engines are checked with (``engine_tls``)."""
        self.cfg = cfg
        self.keep_names = keep_names
        self.pools: dict[str, Pool] = {}
        self.on_up: list[Callable[[Worker], None]] = []  # run when a worker is healthy again
        # run when a worker is removed, before its blocks are forgotten
        self.on_leave: list[Callable[[Worker], None]] = []
        self.on_failing: list[Callable[[Worker], None]] = []  # each failed check while down
        self._workers: dict[str, Worker] = {}
        # model -> its workers (``for_model``), dropped on any change of who serves what
        self._for_model: dict[str, list[Worker]] = {}
        self._sources: dict[str, Worker] = {}  # target name -> its worker (router/workers/dp.py)
        # told a target's name on each move of its load (``watch_moves``), and on its leaving
        self._on_move: list[Callable[[str], None]] = []
        self._client: httpx.AsyncClient | None = None
        # /health and /metrics every health_interval per worker: on the raw client, as an
        # httpx GET cost ~1.5 ms of CPU here against ~0.13 ms (a loopback engine; session
        # 7), 16 workers x 2 GETs every 2 s; its own connections, so a check's answer does
        # not count as the engine's progress on requests (``Upstream.stalled``)
        self._raw = Upstream(connect_timeout=cfg.health_timeout, tls=tls)
        self._probes: dict[str, asyncio.Task[Any]] = {}
        # LoRA adapter -> base model: from the config, and learnt from engines' /v1/models
        # (vLLM lists each adapter with its base as "parent")
        self.adapters: dict[str, str] = {
            name: spec.base for name, spec in cfg.models.items() if spec.base and spec.base != name
        }

    # -- membership --------------------------------------------------------------
    def pool(self, name: str, block_size: int) -> Pool:
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = Pool.create(
                name, block_size, self.cfg.max_index_blocks, keep_names=self.keep_names
            )
        elif pool.block_size != block_size:
            raise ValueError(f"pool {name} has block size {pool.block_size}, not {block_size}")
        return pool

    def add(self, spec: WorkerSpec) -> Worker:
        if spec.id in self._workers:
            raise ValueError(f"worker {spec.id} exists")
        pool = self.pool(spec.pool, spec.block_size or self.cfg.block_size)
        if spec.model is not None:
            other = self.pool_of_model(spec.model)
            if other is not None and other is not pool:
                raise ValueError(f"model {spec.model} is served by pool {other.name}")
        roles = {w.role for w in self._workers.values() if w.pool is pool} | {spec.role}
        error = pool_roles_error(pool.name, roles) or role_error(spec, self.cfg.pd_protocol)
        if error is not None:
            raise ValueError(error)
        worker = Worker(spec, pool)
        taken = [t for t in worker.targets if t in self._sources]
        if taken:
            raise ValueError(f"worker {spec.id}: target name {taken[0]} is taken")
        if spec.kv_groups:
            groups = parse_groups(spec.kv_groups)
            declared = pool.ingest.declared_groups()
            if declared and declared != groups:
                raise ValueError(f"pool {pool.name} has other kv_groups than {spec.kv_groups!r}")
            pool.ingest.declare_groups(groups)
        self._workers[spec.id] = worker
        worker._changed = self._changed
        self._changed()
        for tid in worker.targets:
            self._sources[tid] = worker
            pool.index.add_worker(tid)
        if self._on_move:
            for tid, load in worker.candidates:
                load.listen(self._moved, tid)
                self._moved(tid)  # its load counts there now
        return worker

    def remove(self, worker_id: str) -> Worker:
        """Forget the worker and its blocks; requests already on it run to the end."""
        worker = self._workers.pop(worker_id)
        worker._changed = None
        self._changed()
        for hook in self.on_leave:
            hook(worker)
        worker.forget_blocks()
        for tid in worker.targets:
            self._sources.pop(tid, None)
        if self._on_move:
            for tid, load in worker.candidates:
                load.listen(None)
                self._moved(tid)  # its load no longer counts there
        return worker

    def watch_moves(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(target)`` on each move of a target's load (a flight begun, its
        first byte, its end, a peer's count) and when it leaves: what admission counts
        the workers without room by (``Admission.moved``)."""
        self._on_move.append(listener)
        for worker in self._workers.values():
            for tid, load in worker.candidates:
                load.listen(self._moved, tid)

    def _moved(self, target: str) -> None:
        for listener in self._on_move:
            listener(target)

    def drain(self, worker_id: str) -> Worker:
        worker = self._workers[worker_id]
        worker.draining = True
        self._changed()
        return worker

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def source(self, target: str) -> Worker | None:
        """The worker whose KV events (and index rows) ``target`` names: the worker itself,
        or one of its DP ranks."""
        return self._sources.get(target)

    def target(self, target: str) -> tuple[Worker, int | None] | None:
        """``(worker, rank)`` of a routing target (rank None: a worker without ranks)."""
        worker = self._sources.get(target)
        if worker is None:
            return None
        return worker, (None if worker.dp_size <= 1 else split_target(target)[1])

    def sources(self) -> list[str]:
        """Every event source: each worker, or each of its DP ranks."""
        return list(self._sources)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def models(self) -> set[str]:
        return {m for w in self._workers.values() for m in w.models}

    def pool_of_model(self, model: str) -> Pool | None:
        return next((w.pool for w in self._workers.values() if model in w.models), None)

    def for_model(self, model: str) -> list[Worker]:
        """Workers that serve ``model``, in any state ([] means the model is unknown).

        An adapter the config names is served wherever its base is. Kept per model until
        the registry changes (a worker added, removed, draining, up or down, its models
        or the adapters learnt): O(1) a request, where a pass over every worker cost
        ~8 us at 128 (BENCHMARKS.md, wide pools). The same list object while nothing
        changes (the pruner compares it by identity): callers never change it."""
        found = self._for_model.get(model)
        if found is not None:
            return found
        known = [w for w in self._workers.values() if model in w.models]
        base = self.adapters.get(model)
        if not known and base is not None:
            # not kept: which engines have a free adapter slot changes with each scrape
            known = [w for w in self._workers.values() if base in w.models]
            # no engine has the adapter loaded: those with a free adapter slot first
            free = [w for w in known if w.lora is not None and w.lora.can_take(model)]
            return free or known
        found = known or [w for w in self._workers.values() if not w.models]
        self._for_model[model] = found
        return found

    def _changed(self) -> None:
        """Who serves what may have changed: ``for_model`` looks again."""
        self._for_model = {}

    def lora_name(self, model: str) -> str | None:
        """The adapter name engines key ``model``'s blocks under; None for a base model."""
        return model if model in self.adapters else None

    # -- passive health ----------------------------------------------------------
    def request_failed(self, worker: Worker, error: str) -> None:
        worker.request_failures += 1
        worker.last_error = error
        if worker.request_failures >= self.cfg.breaker_failures:
            worker.breaker_until = time.monotonic() + self.cfg.breaker_cooldown
            log.warning("worker %s: breaker open after %s (%s)", worker.id, error, worker.url)

    def request_succeeded(self, worker: Worker) -> None:
        if worker.request_failures:
            worker.request_failures = 0
            worker.breaker_until = 0.0

    def suspect(self, worker: Worker) -> None:
        """A request just failed on ``worker``: check it now (at most one probe at a time)."""
        if self._client is None or not worker.healthy or worker.id in self._probes:
            return
        task = asyncio.create_task(self._probe(self._client, worker), name=f"probe-{worker.id}")
        self._probes[worker.id] = task
        task.add_done_callback(lambda _t: self._probes.pop(worker.id, None))

    async def _probe(self, client: httpx.AsyncClient, worker: Worker) -> None:
        for _ in range(self.cfg.unhealthy_after):
            await self.check(client, worker)
            if worker.fail_streak == 0 or not worker.healthy:
                return
            await asyncio.sleep(PROBE_GAP)

    async def close(self) -> None:
        probes = list(self._probes.values())
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        self._raw.close()

    # -- active health and load --------------------------------------------------
    async def monitor(self, client: httpx.AsyncClient) -> None:
        """Check every worker each ``health_interval`` seconds, forever."""
        self._client = client
        while True:
            await self.check_all(client)
            await asyncio.sleep(self.cfg.health_interval)

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.check(client, w) for w in self))

    async def check(self, client: httpx.AsyncClient, worker: Worker) -> None:
        try:
            status, _ = await self._get(worker, "/health")
            ok = status < 300
            error = None if ok else f"health status {status}"
        except (UpstreamError, TimeoutError) as exc:
            ok, error = False, f"health: {type(exc).__name__}"
        if ok:
            await self._healthy(client, worker)
        else:
            self._unhealthy(worker, error or "")

    async def _healthy(self, client: httpx.AsyncClient, worker: Worker) -> None:
        worker.fail_streak = 0
        worker.ok_streak += 1
        if not worker.healthy and worker.ok_streak >= self.cfg.healthy_after:
            worker.healthy = True
            self._changed()
            worker.request_failures = 0
            worker.breaker_until = 0.0
            log.info("worker %s is healthy again", worker.id)
            for hook in self.on_up:
                hook(worker)
        timeout = self.cfg.health_timeout
        try:
            if not worker.models or worker.ok_streak % MODELS_EVERY == 0:
                # again every few checks: the adapters an engine has loaded change
                resp = await client.get(worker.url + "/v1/models", timeout=timeout)
                cards = [m for m in resp.json().get("data", []) if isinstance(m, dict)]
                ids = {str(m["id"]) for m in cards}
                if ids and worker.id in self._workers:
                    base = worker.base_models
                    adapters = set()
                    for m in cards:
                        parent = m.get("parent")
                        if isinstance(parent, str) and parent and parent != str(m["id"]):
                            if str(m["id"]) not in self.adapters:
                                self.adapters[str(m["id"])] = parent
                                self._changed()
                            if parent in base:
                                adapters.add(str(m["id"]))
                    worker.models = base | adapters if base else frozenset(ids)
            if worker.load.engine_fresh(self.cfg.load_stale_after) is None:
                seen = worker.load.engine_seen
                status, body = await self._get(worker, "/metrics")
                if status == 200:
                    text = body.decode("utf-8", "replace")
                    # A push report (kv.load) that came in while the scrape was in flight is
                    # newer than the scrape: keep it (CI lost a waiting=40 report this way).
                    if worker.load.engine_seen == seen:
                        worker.load.report(parse_engine_metrics(text))
                    worker.lora = parse_lora_info(text)
        except (httpx.HTTPError, UpstreamError, TimeoutError, ValueError, AttributeError,
                KeyError) as exc:  # fmt: skip
            log.debug("worker %s: discovery/scrape failed: %s", worker.id, exc)

    async def _get(self, worker: Worker, path: str) -> tuple[int, bytes]:
        """Status and body of a GET, all of it within ``health_timeout``."""
        timeout = self.cfg.health_timeout

        async def get() -> tuple[int, bytes]:
            resp = await self._raw.send(worker.url, path, [], b"", timeout, b"GET")
            try:
                return resp.status, await resp.read(timeout, MAX_SCRAPE_BYTES, path)
            finally:
                resp.close()  # a no-op once complete; else the connection is dropped

        return await asyncio.wait_for(get(), timeout)

    def _unhealthy(self, worker: Worker, error: str) -> None:
        worker.ok_streak = 0
        worker.fail_streak += 1
        worker.last_error = error
        if worker.healthy and worker.fail_streak >= self.cfg.unhealthy_after:
            worker.healthy = False
            self._changed()
            # Its engine may restart empty: forget its blocks; events resync it on return.
            worker.forget_blocks()
            for tid in worker.targets:
                worker.pool.index.add_worker(tid)
            log.warning("worker %s is down (%s)", worker.id, error)
        if not worker.healthy:
            for hook in self.on_failing:
                hook(worker)
