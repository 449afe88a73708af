"""Prefill/decode disaggregation on the wire: one request, two engines, two protocols.

A pool whose workers have roles (``prefill``, ``decode``) is disaggregated; the proxy
hands its requests here. ``policies.pd.choose`` picks the decode engine (load, KV room,
its own prefix) and, unless the decode engine's uncached suffix is under
``pd_local_prefill_tokens``, a prefill engine (the arm's policy, its prefill-side
instance: ``Experiment.prefill_policy_for``). Then, in
the protocol the engines speak (``pd_protocol``), as their own proxies do it:

- ``vllm`` (KV connectors: NixlConnector, P2pNcclConnector, Mooncake; vLLM's
  ``toy_proxy_server.py``): the prefill engine gets the request with
  ``kv_transfer_params = {do_remote_decode: true, ...}``, ``max_tokens`` 1 and no
  streaming; its answer's ``kv_transfer_params`` (``remote_engine_id``,
  ``remote_block_ids``, ``remote_host``, ``remote_port``...) go into the decode request,
  which streams to the client. The two run one after the other.
- ``sglang`` (``--disaggregation-mode``; SGLang's mini_lb and sgl-router's PD mode): the
  request gets ``bootstrap_host`` (the prefill engine's host), ``bootstrap_port`` (its
  ``--disaggregation-bootstrap-port``) and a random 63-bit ``bootstrap_room``, and goes
  to both engines at once: the decode engine registers in the room, the prefill engine
  sends the KV there. The decode engine's answer goes to the client.

Either side may be a DP rank of its engine (router/workers/dp.py): each choice is a (worker,
rank) target, and each request carries its own engine's rank (``_sglang_pair`` says how
SGLang's decode engine learns the prefill's).

Failures, without duplicated work:

- the prefill side fails before the decode engine has produced anything (connect
  refused, the prefill broken off or answering 5xx): the request goes to another prefill
  engine (its answer is thrown away, so running it again is safe), at most
  ``connect_retries`` times; an SGLang decode engine waiting in the room is let go (its
  connection closed) and the pair is formed again with a new room;
- the decode engine cannot be reached: another decode engine takes the same transfer
  params (vLLM's prefill engine keeps the blocks until one pulls them) or the pair
  again (SGLang);
- the decode engine dies mid-stream: the stream ends with an error event, as for any
  engine (``Relay.stream``).

Admission (router.admission, the proxy's queue and counts): a request is held before
its prefill leg while every prefill engine it may use is full, since the prefill pool is
the scarce side and the first leg; it is bound (both sides chosen, the full prefill
engines excluded) when one has room, and its slot is that prefill engine's, freed when
the prefill leg ends (the vLLM prefill answer read; SGLang's prefill answer drained),
not when the decode stream does. Decode engines are not held for: a decode engine's
load is the decode policy's (its streams and KV room), and one that queues is passed
over there. A request that takes no prefill engine (the Responses and Messages APIs; a
stored response's engine) is never held, nor one its decode engine would prefill
itself (uncached suffix under ``pd_local_prefill_tokens``, asked when the prefill side
is full); one bound and then prefilled locally has the decode engine's slot until its
stream ends. docs/overload.md says more.

Metrics per role: ``cache_router_pd_phase_seconds{phase}`` splits the TTFT into the
prefill engine's queue as the policy estimated it, the prefill exchange and the transfer
(the decode engine's first byte after the prefill answered: KV pull plus its first
step). The queue is estimated because no answer on the path carries it: vLLM answers a
non-streamed request (the prefill) with headers and body together once it is done, a
streamed one with headers before it is even scheduled. Both engines measure each
request's queue time, neither puts it in an OpenAI answer (read in their code, session
6): vLLM v1 keeps ``queued_ts``/``scheduled_ts`` per request (``RequestStateStats``) and
sends their difference only to the ``vllm:request_queue_time_seconds`` histogram and to
OpenTelemetry spans (``gen_ai.latency.time_in_queue``, with ``--otlp-traces-endpoint``);
SGLang puts ``queue_time`` in ``meta_info`` with ``--enable-metrics``, which only its
native ``/generate`` answer carries (its OpenAI answers' ``sglext`` holds
``routed_experts`` and ``cached_tokens_details``), and the PD path carries chat and
completions only (``PD_KINDS``). ``cache_router_pd_tpot_seconds`` is the decode stream's
time per output token (``usage.completion_tokens`` where the stream carries it: one event
may hold several).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

import orjson
from prometheus_client import Counter, Histogram

from policies.base import Decision, NoWorkerError, Policy, WorkerView
from policies.pd import PdDecision, choose, make_decode_policy
from router.forward.relay import Failure, send_failure
from router.forward.upstream import ConnectFailed, Response, UpstreamError, UpstreamTimeout
from router.http.errors import ApiError
from router.workers.dp import forward_rank, rank_body, rank_headers
from router.workers.load import Flight

if TYPE_CHECKING:
    from router.admission.core import Ticket
    from router.admission.gate import Gate
    from router.config import PdSettings
    from router.forward.relay import Exchange, ProxyDeps, Relay
    from router.http.asgi import Message, Scope, Send
    from router.routing.decide import Prepared
    from router.workers.registry import Worker

PD_KINDS = frozenset(("chat", "completion"))  # the endpoints both protocols carry
MAX_PREFILL_BODY = 1 << 20  # a max_tokens=1 answer is a few hundred bytes
PHASE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

# The prefill side's failures; all but a timeout are retried on another prefill engine,
# since a prefill's output is thrown away and running it again changes nothing the client
# sees (a timeout already cost ``request_timeout``: another one would double it).
PREFILL_BROKEN = Failure(502, "upstream_error", "prefill_broken", "prefill failed", True, True)
PREFILL_STATUS = Failure(502, "upstream_error", "prefill_status", "prefill 5xx", True, False)


def prefill_failure(exc: UpstreamError) -> Failure:
    if isinstance(exc, ConnectFailed | UpstreamTimeout):
        return send_failure(exc)
    return PREFILL_BROKEN


class _Failed(Exception):
    """One side failed before the decode engine answered: ``failure`` says who retries."""

    def __init__(self, worker: Worker, failure: Failure, error: UpstreamError | None) -> None:
        super().__init__(failure.reason)
        self.worker = worker
        self.failure = failure
        self.error = error


class _EngineAnswer(Exception):
    """The prefill engine refused the request (4xx): the client gets that answer."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


# -- the request bodies each protocol sends ---------------------------------------------


def vllm_prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill request of vLLM's KV-connector proxies: one token, no stream, and
    ``kv_transfer_params`` asking the engine to keep the KV for a remote decode."""
    out = dict(body)
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens"):  # min_tokens > 1 would be refused
        out.pop(key, None)
    return orjson.dumps(out)


def vllm_decode_body(body: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The client's request with the prefill engine's ``kv_transfer_params``."""
    return orjson.dumps({**body, "kv_transfer_params": params})


def sglang_body(body: dict[str, Any], host: str, port: int, room: int) -> bytes:
    """The client's request with SGLang's bootstrap fields, for both engines."""
    return orjson.dumps(
        {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    )


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill engine's JSON answer (None: absent)."""
    try:
        obj = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
    return params if isinstance(params, dict) and params else None


def _cached(answer: bytes) -> int | None:
    try:
        usage = orjson.loads(answer).get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return cached if isinstance(cached, int) else None


@dataclass(slots=True)
class PdChoice:
    """A ``PdDecision`` with each side's views, for load counting and explain."""

    decision: PdDecision
    prefill_views: list[WorkerView]
    decode_views: list[WorkerView]

    def hit(self, worker_id: str, block_size: int) -> int:
        """Prompt tokens the index says ``worker_id`` holds."""
        for v in (*self.prefill_views, *self.decode_views):
            if v.worker_id == worker_id:
                return v.match.total * block_size if v.in_sync else 0
        return 0


class PdMetrics:
    def __init__(self, registry: Any) -> None:
        self.phase = Histogram(
            "cache_router_pd_phase_seconds",
            "Disaggregated requests' TTFT by phase: prefill_queue (the policy's estimate), "
            "prefill (the prefill exchange), transfer (the decode engine's first byte after it)",
            ["phase", "worker"],
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "cache_router_pd_tpot_seconds",
            "Decode engines' time per output token of streamed disaggregated requests "
            "(usage.completion_tokens when the stream carries it, else one per event)",
            ["worker"],
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        self.arm_tpot = Histogram(
            "cache_router_pd_arm_tpot_seconds",
            "Time per output token of streamed disaggregated requests by A/B arm and the "
            "policy of each side (an arm may vary the prefill side, the decode side or both)",
            ["arm", "prefill_policy", "decode_policy"],
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        self.arm_requests = Counter(
            "cache_router_pd_arm_requests",
            "Disaggregated requests by A/B arm, the policy of each side and path (local: "
            "the decode engine prefilled; its prefill_policy made no choice)",
            ["arm", "prefill_policy", "decode_policy", "path"],
            registry=registry,
        )
        self.requests = Counter(
            "cache_router_pd_requests",
            "Disaggregated requests by role and path (remote: a prefill engine computed the "
            "prompt; local: the decode engine did)",
            ["role", "worker", "path"],
            registry=registry,
        )


class PdRouter:
    """Routes the requests of disaggregated pools (see the module docstring)."""

    def __init__(self, settings: PdSettings, deps: ProxyDeps) -> None:
        self.state = deps
        self.protocol = settings.pd_protocol
        self.bootstrap_port = settings.pd_bootstrap_port
        self.local_prefill_tokens = settings.pd_local_prefill_tokens
        self.decode_policy = make_decode_policy(settings.decode_policy)
        self.metrics = PdMetrics(deps.metrics.registry)
        self.rng = random.Random()
        self._drains: set[asyncio.Task[None]] = set()  # SGLang prefill answers read to the end

    @staticmethod
    def disaggregated(prep: Prepared) -> bool:
        return any(w.role != "mixed" for w in prep.workers)

    @staticmethod
    def remote_prefill(prep: Prepared) -> bool:
        """Whether the request may take a prefill engine (both protocols carry chat and
        completions only; a stored response's engine decodes and prefills it)."""
        return prep.parsed.kind in PD_KINDS and prep.pinned is None

    def prefills_locally(self, prep: Prepared) -> bool:
        """Whether the decode engine would prefill the request itself now (its uncached
        suffix under ``pd_local_prefill_tokens``): a choice made and undone, asked only
        by admission while the prefill side is full, since such a request takes no
        prefill slot and is not held for one."""
        if self.local_prefill_tokens <= 0:
            return False
        try:
            choice = self.decide(prep)
        except ApiError:
            return False  # binding will answer why
        self.finish(prep, choice.decision)  # nothing is sent: the policies forget it
        return choice.decision.prefill is None

    # -- deciding ---------------------------------------------------------------------
    def decide(self, prep: Prepared, exclude: set[str] | frozenset[str] = frozenset()) -> PdChoice:
        """Both choices among usable targets (a worker, or one of its DP ranks:
        router/workers/dp.py); ``ApiError`` 503 without a decode engine."""
        st = self.state
        views = st.router.views(prep, exclude)
        roles = {t: w.role for w in prep.workers for t in w.targets}
        prefill = [v for v in views if roles.get(v.worker_id) == "prefill"]
        decode = [v for v in views if roles.get(v.worker_id) == "decode"]
        if prep.parsed.kind not in PD_KINDS:
            prefill = []  # the Responses and Messages APIs carry neither protocol's fields
        if prep.pinned is not None:
            decode = [v for v in decode if _worker_of(st, v.worker_id) == prep.pinned]
            prefill = []
        if not decode:
            raise ApiError(
                503, f"no healthy decode worker for model {prep.parsed.model}", "no_healthy_worker"
            )
        policy = st.experiment.prefill_policy_for(prep.arm)
        try:
            decision = choose(
                prep.request,
                prefill,
                decode,
                policy,
                self.decode_for(prep.arm),
                self.local_prefill_tokens,
            )
        except NoWorkerError as exc:
            raise ApiError(503, str(exc), "no_healthy_worker") from exc
        return PdChoice(decision, prefill, decode)

    def explain(self, prep: Prepared) -> dict[str, Any]:
        """Both choices and each side's numbers, for ``/admin/explain`` (nothing is sent)."""
        choice = self.decide(prep)
        d = choice.decision
        self.finish(prep, d)  # explain routes nothing: release what the policies counted
        return {
            "protocol": self.protocol,
            "local_prefill": d.prefill is None,
            "reason": d.reason,
            "uncached_on_decode": d.uncached_on_decode,
            "local_prefill_tokens": self.local_prefill_tokens,
            "arm": prep.arm,
            "prefill_policy": self.state.experiment.prefill_policy_for(prep.arm).name,
            "decode_policy": self.decode_for(prep.arm).name,
            "decode": _side(d.decode, choice.decode_views),
            "prefill": None if d.prefill is None else _side(d.prefill, choice.prefill_views),
        }

    def decode_for(self, arm: str) -> Policy:
        """The arm's decode-side policy, or the router's (``decode_policy``)."""
        return self.state.experiment.decode_policy_for(arm) or self.decode_policy

    def finish(self, prep: Prepared, d: PdDecision) -> None:
        self.decode_for(prep.arm).on_finish(prep.request, d.decode.worker_id)
        if d.prefill is not None:
            prefill_policy = self.state.experiment.prefill_policy_for(prep.arm)
            prefill_policy.on_finish(prep.request, d.prefill.worker_id)

    # -- forwarding -------------------------------------------------------------------
    async def forward(
        self, proxy: Relay, scope: Scope, raw: bytes, prep: Prepared, ex: Exchange
    ) -> None:
        """Admitted (held while the prefill engines are full, or shed: ``ShedError``),
        then prefill (unless local), then stream the decode engine's answer."""
        gate = self.state.gate
        if gate is None:
            await self._forward(proxy, scope, raw, prep, ex, None)
            return
        ticket = await gate.enter(prep, scope["headers"], pd=self, via="pd")
        slot = Slot(gate, ticket)
        try:
            await self._forward(proxy, scope, raw, prep, ex, slot)
        finally:
            slot.free(ex.output_tokens)  # if the prefill leg did not already

    async def _forward(
        self,
        proxy: Relay,
        scope: Scope,
        raw: bytes,
        prep: Prepared,
        ex: Exchange,
        slot: Slot | None,
    ) -> None:
        st = self.state
        req = prep.request
        headers = [(k, v) for k, v in scope["headers"] if k not in proxy.drop]
        if not any(k == b"x-request-id" for k, _ in headers):
            headers.append((b"x-request-id", req.request_id.encode()))
        path = proxy.path
        # ``forward_token_ids``: both engines get the router's ids, so the prefill engine
        # computes (and the decode engine receives) the blocks the index hashed
        raw, body = prep.engine_body(raw)
        exclude: set[str] = set()
        # vLLM: the transfer params and the prefill engine holding their blocks, kept for
        # a retried decode engine (the blocks wait there until one pulls them), when it
        # answered and the blocks a hint pulled into it
        done: tuple[Target, dict[str, Any] | None, float, int] | None = None
        while True:
            bound = None if slot is None else slot.take()
            choice = bound if bound is not None else self.decide(prep, exclude)
            d = choice.decision
            decode = _target(st, d.decode.worker_id)
            prefill = None if d.prefill is None else _target(st, d.prefill.worker_id)
            gone = d.decode.worker_id if decode is None else None
            if d.prefill is not None and prefill is None:
                gone = d.prefill.worker_id
            if gone is not None or decode is None:  # removed between the views and now
                self.finish(prep, d)
                exclude.add(gone or d.decode.worker_id)
                continue
            try:
                if prefill is None:
                    resp, flight = await self._local(decode, choice, prep, raw, body, headers, path)
                    if slot is not None:
                        slot.begun()  # the decode engine prefills: the slot is its own
                    prefilled, prefetched = time.perf_counter(), 0
                elif self.protocol == "vllm":
                    if done is None:
                        hinted = await proxy.hint(d.prefill, prep)
                        params = await self._vllm_prefill(
                            prefill, choice, prep, body, headers, path, slot
                        )
                        done = (prefill, params, time.perf_counter(), hinted)
                    prefill, params, prefilled, prefetched = done
                    w = decode.worker
                    if params is None:
                        sent, out = forward_rank(headers, raw, body, decode.rank, w.dp_field)
                    else:
                        sent = rank_headers(headers, decode.rank, w.dp_field)
                        out = vllm_decode_body(rank_body(body, decode.rank, w.dp_field), params)
                    resp, flight = await self._send_decode(decode, prep, out, sent, 0, path)
                else:
                    prefetched = await proxy.hint(d.prefill, prep)
                    resp, flight = await self._sglang_pair(
                        prefill, decode, choice, prep, body, headers, path, slot
                    )
                    prefilled = time.perf_counter()
            except _Failed as f:
                self.finish(prep, d)
                if prefill is not None and f.worker is prefill.worker:
                    done = None
                proxy.failed(f.worker, f.failure, f.error, prep.arm, exclude)
                continue
            except _EngineAnswer as answer:
                self.finish(prep, d)
                await _send_answer(ex, answer)
                return
            except BaseException:
                self.finish(prep, d)
                raise
            break
        await self._stream(
            proxy, ex, prep, choice, decode, prefill, resp, flight, prefilled, prefetched
        )

    async def _stream(
        self,
        proxy: Relay,
        ex: Exchange,
        prep: Prepared,
        choice: PdChoice,
        decode: Target,
        prefill: Target | None,
        resp: Response,
        flight: Flight,
        prefilled: float,
        prefetched: int,
    ) -> None:
        """Stream the decode engine's answer (``prefilled``: when the prefill answered;
        ``prefetched``: leading blocks a hint pulled into the prefill engine)."""
        st = self.state
        req = prep.request
        d = choice.decision
        arm = prep.arm
        answering = (prefill or decode).id  # whose cache the prompt's hit was counted on
        hit = choice.hit(answering, req.block_size)
        path = "local" if prefill is None else "remote"
        self.metrics.requests.labels("decode", decode.id, path).inc()
        sides = (arm, st.experiment.prefill_policy_for(arm).name, self.decode_for(arm).name)
        self.metrics.arm_requests.labels(*sides, path).inc()
        tpot = _TpotClock(ex.send)
        ex.send = tpot.send
        try:
            st.router.predict(prep, answering)
            if prefill is not None:
                st.router.predict(prep, decode.id)  # the transferred blocks land there too
            series = st.metrics.series(arm, decode.id)
            series.requests.inc()
            series.prompt_tokens.inc(req.num_tokens)
            series.routed_hit_tokens.inc(hit)
            if st.capacity is not None and req.block_hashes:  # where the prompt is cached
                st.capacity.record(
                    req.model, req.block_size, answering, req.block_hashes, req.num_tokens,
                    prefetched,
                )  # fmt: skip
            remote = prefill is not None
            await proxy.stream(
                ex, resp, decode.id, flight, series, arm, hit, prefilled_remotely=remote
            )
        finally:
            resp.close()
            flight.finish()
            self.finish(prep, d)
            if prefill is not None and tpot.first is not None and prep.parsed.stream:
                self.metrics.phase.labels("transfer", decode.id).observe(tpot.first - prefilled)
            per = tpot.tpot()
            if per is not None:
                self.metrics.tpot.labels(decode.id).observe(per)
                self.metrics.arm_tpot.labels(*sides).observe(per)

    async def _local(
        self,
        decode: Target,
        choice: PdChoice,
        prep: Prepared,
        raw: bytes,
        body: dict[str, Any],
        headers: list[tuple[bytes, bytes]],
        path: str,
    ) -> tuple[Response, Flight]:
        """The decode engine prefills the prompt itself: the client's body (with its rank)."""
        uncached = max(0, prep.request.num_tokens - choice.hit(decode.id, prep.request.block_size))
        sent, out = forward_rank(headers, raw, body, decode.rank, decode.worker.dp_field)
        return await self._send_decode(decode, prep, out, sent, uncached, path)

    async def _send_decode(
        self,
        decode: Target,
        prep: Prepared,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        prefill_tokens: int,
        path: str,
    ) -> tuple[Response, Flight]:
        st = self.state
        w = decode.worker
        flight = w.rank_load(decode.rank).begin(prefill_tokens)
        try:
            resp = await st.upstream.send(w.url, path, headers, body, st.cfg.request_timeout)
        except UpstreamError as exc:
            flight.finish()
            raise _Failed(w, send_failure(exc), exc) from exc
        except BaseException:
            flight.finish()
            raise
        return resp, flight

    async def _vllm_prefill(
        self,
        prefill: Target,
        choice: PdChoice,
        prep: Prepared,
        body: dict[str, Any],
        headers: list[tuple[bytes, bytes]],
        path: str,
        slot: Slot | None = None,
    ) -> dict[str, Any] | None:
        """The prefill exchange; the ``kv_transfer_params`` its answer carries. None from
        a connector that keys the KV by the prompt itself (vLLM's ExampleConnector and
        shared-storage ones answer without them): the decode request goes as the client
        sent it and its engine's connector finds the KV, as vLLM's toy proxy does. With
        DP ranks the params name the prefill rank's own engine (vLLM gives each rank its
        engine id and side-channel port), so the decode engine pulls from that rank."""
        field = prefill.worker.dp_field
        sent = rank_headers(headers, prefill.rank, field)
        out = vllm_prefill_body(rank_body(body, prefill.rank, field))
        answer = await self._prefill_exchange(prefill, choice, prep, sent, out, path, None, slot)
        params = transfer_params(answer)
        if params is None:
            self.metrics.requests.labels("prefill", prefill.id, "no_transfer_params").inc()
        return params

    async def _prefill_exchange(
        self,
        prefill: Target,
        choice: PdChoice,
        prep: Prepared,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        path: str,
        accepted: list[tuple[Response, Flight, Callable[[bytes | None], None]]] | None = None,
        slot: Slot | None = None,
    ) -> bytes:
        """Send the prefill request; its whole answer, or b"" once its headers are in when
        ``accepted`` takes the response and its load (SGLang: the answer comes after the
        decode engine joined the room). ``_Failed`` on a failure the proxy may retry
        elsewhere, ``_EngineAnswer`` on a refusal (4xx)."""
        st = self.state
        req = prep.request
        d = choice.decision
        assert d.prefill is not None
        w, tid = prefill.worker, prefill.id
        hit = choice.hit(tid, req.block_size)
        flight = w.rank_load(prefill.rank).begin(max(0, req.num_tokens - hit))
        if slot is not None:
            slot.begun()  # admission's slot is this prefill engine's now
        queue_ms = d.prefill.scores.get(tid, {}).get("queue_ms")
        if queue_ms is not None:
            self.metrics.phase.labels("prefill_queue", tid).observe(queue_ms / 1000.0)
        self.metrics.requests.labels("prefill", tid, "remote").inc()
        started = time.perf_counter()
        resp: Response | None = None
        try:
            resp = await st.upstream.send(w.url, path, headers, body, st.cfg.request_timeout)
            if accepted is not None and resp.status < 400:
                # SGLang: the answer ends after the transfer; its timing, success and
                # cached tokens are recorded once ``_drain`` has read it
                accepted.append(
                    (resp, flight, partial(self._prefill_done, prefill, prep, hit, started))
                )
                return b""
            answer = await resp.read(st.cfg.request_timeout, MAX_PREFILL_BODY, "prefill answer")
        except UpstreamError as exc:
            st.metrics.error(prep.arm, tid, "prefill_" + type(exc).__name__)
            raise _Failed(w, prefill_failure(exc), exc) from exc
        finally:
            if accepted is None or not accepted:
                flight.finish()
                if slot is not None:
                    slot.free()  # the prefill leg is over: the next held request may go
                if resp is not None:
                    resp.close()
        status = resp.status
        if status >= 400:
            self.metrics.phase.labels("prefill", tid).observe(time.perf_counter() - started)
        if status >= 500:
            raise _Failed(w, PREFILL_STATUS, UpstreamError(f"prefill status {status}"))
        if status >= 400:
            raise _EngineAnswer(status, answer)
        self._prefill_done(prefill, prep, hit, started, answer)
        return answer

    def _prefill_done(
        self, prefill: Target, prep: Prepared, hit: int, started: float, answer: bytes | None
    ) -> None:
        """A prefill answered in full: its time, the engine's success, its cached tokens.
        None: its answer broke off after the decode engine had joined (SGLang), which
        counts against the engine as a broken vLLM prefill does; the client's stream is
        the decode engine's and goes on."""
        st, tid = self.state, prefill.id
        if answer is None:
            st.registry.request_failed(prefill.worker, PREFILL_BROKEN.reason)
            st.metrics.error(prep.arm, tid, PREFILL_BROKEN.kind)
            return
        self.metrics.phase.labels("prefill", tid).observe(time.perf_counter() - started)
        st.registry.request_succeeded(prefill.worker)
        cached = _cached(answer)
        if cached is not None:
            st.metrics.series(prep.arm, tid).hit_tokens.inc(cached)
            st.audit.record(tid, hit, cached)

    async def _sglang_pair(
        self,
        prefill: Target,
        decode: Target,
        choice: PdChoice,
        prep: Prepared,
        body: dict[str, Any],
        headers: list[tuple[bytes, bytes]],
        path: str,
        slot: Slot | None = None,
    ) -> tuple[Response, Flight]:
        """Both engines at once with one bootstrap room; the decode engine's response
        once the prefill engine has accepted the request too (its headers are in).

        DP ranks as SGLang's gateway names them: the prefill engine's rank in its field
        (``routed_dp_rank``), the decode engine's in its own and the prefill's as
        ``disagg_prefill_dp_rank`` (where the KV waits). The room is drawn with ``room %
        prefill dp_size`` equal to the prefill rank: SGLang's PD load balancing
        (``follow_bootstrap_room``) and an older decode engine's receiver
        (``target_dp_group = bootstrap_room % prefill_dp_size``) read the rank from it.
        Some older releases took a decode request's ``data_parallel_rank`` as the prefill's
        DP group as well: with those, ranks of the two sides pair up only when equal."""
        p, dec = prefill.worker, decode.worker
        host = urlsplit(p.url).hostname or ""
        port = p.bootstrap_port or self.bootstrap_port
        room = bootstrap_room(self.rng, prefill.rank, p.dp_size)
        p_body = sglang_body(rank_body(body, prefill.rank, p.dp_field), host, port, room)
        d_fields = rank_body(body, decode.rank, dec.dp_field)
        if prefill.rank is not None:
            d_fields = {**d_fields, "disagg_prefill_dp_rank": prefill.rank}
        d_body = sglang_body(d_fields, host, port, room)
        p_headers = rank_headers(headers, prefill.rank, p.dp_field)
        d_headers = rank_headers(headers, decode.rank, dec.dp_field)
        accepted: list[tuple[Response, Flight, Callable[[bytes | None], None]]] = []
        p_task = asyncio.ensure_future(
            self._prefill_exchange(prefill, choice, prep, p_headers, p_body, path, accepted, slot)
        )
        d_task = asyncio.ensure_future(self._send_decode(decode, prep, d_body, d_headers, 0, path))
        try:
            await _both(p_task, d_task)
        except BaseException:
            for r, f, _ in accepted:
                r.close()  # the prefill engine sees its client leave and frees the room
                f.finish()
            if slot is not None:
                slot.free()
            raise
        for r, f, done in accepted:
            self._drain(r, f, done, slot)
        return d_task.result()

    def _drain(
        self,
        resp: Response,
        flight: Flight,
        done: Callable[[bytes | None], None],
        slot: Slot | None = None,
    ) -> None:
        """Read the prefill engine's answer to its end in the background (its prefill load
        counts until then), then ``done(answer)``, ``done(None)`` if it broke off."""

        async def drain() -> None:
            try:
                answer = await resp.read(
                    self.state.cfg.request_timeout, MAX_PREFILL_BODY, "prefill answer"
                )
                done(answer)
            except UpstreamError:
                done(None)  # a failed transfer shows in the decode engine's stream too
            finally:
                resp.close()
                flight.finish()
                if slot is not None:
                    slot.free()  # the prefill engine is done with it

        task = asyncio.ensure_future(drain())
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def close(self) -> None:
        tasks = list(self._drains)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Slot:
    """Admission's hold on one request of a disaggregated pool (router.admission): the
    choice it was bound with (for the first try), its engine counting it once the
    prefill flight begins (``begun``), free once the prefill leg ends (``free``, once;
    the decode stream goes on)."""

    __slots__ = ("choice", "freed", "gate", "ticket")

    def __init__(self, gate: Gate, ticket: Ticket) -> None:
        from router.admission.gate import waiter

        self.gate = gate
        self.ticket = ticket
        self.choice = waiter(ticket).choice
        self.freed = False

    def take(self) -> PdChoice | None:
        """The bound choice, the first time (a retry decides again)."""
        choice, self.choice = self.choice, None
        # the gate holds it as its protocol's PdChosen; this router's decide made it
        return cast("PdChoice | None", choice)

    def begun(self) -> None:
        self.gate.started(self.ticket)

    def free(self, output_tokens: int | None = None) -> None:
        if not self.freed:
            self.freed = True
            self.gate.finish(self.ticket, output_tokens)


@dataclass(slots=True, frozen=True)
class Target:
    """One side's engine: the worker, its DP rank (None: a worker without ranks) and the
    target's name (router/workers/dp.py), which labels its metrics and index rows."""

    worker: Worker
    rank: int | None
    id: str


def _target(st: ProxyDeps, tid: str) -> Target | None:
    found = st.registry.target(tid)
    return None if found is None else Target(found[0], found[1], tid)


def _worker_of(st: ProxyDeps, tid: str) -> str | None:
    found = st.registry.target(tid)
    return None if found is None else found[0].id


def bootstrap_room(rng: random.Random, rank: int | None, dp_size: int) -> int:
    """A random 63-bit room whose remainder by ``dp_size`` is ``rank`` (any room when the
    prefill engine has no ranks)."""
    room = rng.getrandbits(63)
    if rank is None or dp_size <= 1:
        return room
    room += rank - room % dp_size
    return room if room < 1 << 63 else room - dp_size


async def _both(
    first: asyncio.Future[Any], second: asyncio.Future[tuple[Response, Flight]]
) -> None:
    """Wait for both; the first failure cancels the other (and undoes its send)."""
    pending: set[asyncio.Future[Any]] = {first, second}
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises the side's failure
    except BaseException:
        for task in (first, second):
            if not task.done():
                task.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        if second.done() and not second.cancelled() and second.exception() is None:
            resp, flight = second.result()
            resp.close()  # the decode engine waiting in the room is let go
            flight.finish()
        raise


async def _send_answer(ex: Exchange, answer: _EngineAnswer) -> None:
    size = b"%d" % len(answer.body)
    headers = [(b"content-type", b"application/json"), (b"content-length", size)]
    await ex.send({"type": "http.response.start", "status": answer.status, "headers": headers})
    ex.started = True
    ex.done = True
    await ex.send({"type": "http.response.body", "body": answer.body})


def _side(decision: Decision, views: list[WorkerView]) -> dict[str, Any]:
    return {
        "worker_id": decision.worker_id,
        "reason": decision.reason,
        "prefetch": decision.prefetch,
        "candidates": [v.worker_id for v in views],
        "scores": decision.scores,
    }


_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class _TpotClock:
    """Wraps the client's ``send``: when the first and the last SSE events went out and
    how many output tokens lay between them. An event can carry several tokens
    (speculative decoding, an engine's stream interval, a proxy that coalesces), so the
    count is the engine's ``usage.completion_tokens`` when the stream carries it
    (``stream_options.include_usage``), else one per event that is not the usage-only one."""

    __slots__ = ("events", "first", "last", "send_next", "tail", "usage_tokens")

    def __init__(self, send: Send) -> None:
        self.send_next = send
        self.first: float | None = None
        self.last = 0.0
        self.events = 0
        self.usage_tokens: int | None = None
        self.tail = b""

    @property
    def tokens(self) -> int:
        """Output tokens of the stream (see the class doc)."""
        return self.usage_tokens if self.usage_tokens is not None else self.events

    def tpot(self) -> float | None:
        """Seconds per output token after the first; None with fewer than two."""
        n = self.tokens
        if self.first is None or n < 2 or self.last <= self.first:
            return None
        return (self.last - self.first) / (n - 1)

    async def send(self, message: Message) -> None:
        body = message.get("body")
        if body:
            now = time.perf_counter()
            if self.first is None:
                self.first = now
            window = self.tail + body  # the usage may be cut between two bodies
            self.tail = body[-64:]
            found = _COMPLETION.findall(window) if b"completion_tokens" in window else None
            if found:
                self.usage_tokens = int(found[-1])
            n = body.count(b"data: ") - body.count(b"[DONE]")
            if found and b'"choices":[]' in body.replace(b" ", b""):
                n -= 1  # the usage-only event carries no token
            if n > 0:
                self.events += n
                self.last = now
        await self.send_next(message)
