"""The hot path: a raw ASGI handler that routes one OpenAI request and streams it through.

It sits in front of FastAPI (``router.http.app``) so a completion pays for no framework
routing, middleware or models: read the body, decide, send the bytes unchanged with
keep-alive engine connections (``router.forward.upstream``), and pass the engine's status,
headers and body chunks back as they come. While waiting and streaming, a watcher task listens
for the client going away and cancels the request, which closes the upstream
connection so the engine stops working for nobody.

Retries happen only when nothing reached an engine (connect refused or timed out), on
the next-best worker, at most ``connect_retries`` times; a request an engine may have
started is never replayed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from router.admission.gate import waiter
from router.forward.migrate import Cause, Leg, Migration, cause_of, refusal
from router.forward.relay import (
    CLUSTER_UNAVAILABLE,
    REQ_DROP,
    ClientGone,
    Exchange,
    Failure,
    ProxyDeps,
    read_body,
    send_error,
    send_failure,
)
from router.forward.tokens_in import TokensIn
from router.forward.upstream import Response, UpstreamError
from router.http.asgi import Message, Receive, Scope, Send
from router.http.errors import ApiError, sse_error
from router.observe.metrics import Series
from router.observe.tracing import Trace, now_ns
from router.routing.decide import Kind, Prepared, hit_blocks
from router.workers.dp import forward_rank
from router.workers.load import WAITING, Flight

if TYPE_CHECKING:
    from policies.base import Decision
    from router.admission.core import Ticket
    from router.workers.registry import Worker

log = logging.getLogger(__name__)

_RESP_DROP = frozenset(
    (b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server", b"trailer")
)
CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')  # usage; the EPP reads it too
COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')  # usage, for admission
HEAD_BYTES = 8192  # of a Responses answer kept to find its id (the first event holds it)


HIT_HEADER = b"x-cache-router-hit-tokens"  # prompt tokens the router predicted cached


class Proxy:
    """ASGI app for one endpoint (``/v1/chat/completions`` or ``/v1/completions``)."""

    def __init__(self, deps: ProxyDeps, kind: Kind, path: str) -> None:
        self.deps = deps
        self.kind = kind
        self.path = path
        # a gateway's workers are clusters; their routers name the engine themselves
        name = b"x-cache-router-cluster" if deps.cfg.gateway else b"x-cache-router-worker"
        self.worker_header = name
        # the client's credentials are for this router, not for every engine behind it
        auth = () if deps.cfg.forward_authorization else (b"authorization",)
        self.drop = REQ_DROP | frozenset(auth)
        # chats and Responses requests go to engines that take them as the router's token
        # ids (router.forward.tokens_in)
        on = kind in ("chat", "responses") and deps.router.cfg.chat_tokens_in
        self.tokens_in = TokensIn(deps, kind) if on else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        st = self.deps
        task = asyncio.current_task()
        assert task is not None
        ex = Exchange(task, send)
        tracing = st.tracing
        trace = None if tracing is None else tracing.begin("POST", self.path, scope["headers"])
        error: str | None = None
        try:
            await self._handle(scope, receive, ex, trace)
        except ClientGone:
            error = "client gone"
            return
        except ApiError as err:
            st.metrics.error("-", "-", err.code)
            if trace is not None:
                trace.status, error = err.status, err.code
            if not ex.started:
                ex.done = True
                # the body of a refused upload may still be arriving: do not wait for it
                await send_error(send, err, close=err.status in (408, 413))
        except asyncio.CancelledError:
            if not ex.gone:
                raise
            task.uncancel()
            st.metrics.error("-", "-", "client_disconnect")
            error = "client disconnect"
        except Exception:  # a bug must still answer in the OpenAI shape, and be seen
            error = "internal"
            log.exception("request failed inside the router")
            st.metrics.error("-", "-", "internal")
            if ex.started:
                raise
            ex.done = True
            await send_error(send, ApiError(500, "internal router error", "internal_error"))
        finally:
            ex.stop()
            if trace is not None:
                trace.end(error)

    async def _handle(
        self, scope: Scope, receive: Receive, ex: Exchange, trace: Trace | None
    ) -> None:
        """Read, decide, forward; errors are answered by ``__call__``."""
        st = self.deps
        raw = await read_body(scope, receive, st.cfg.max_body_bytes, st.cfg.body_timeout)
        wanted: dict[str, str] = {}
        for key, value in scope["headers"]:
            if key in (b"x-session-id", b"x-request-id"):
                wanted[key.decode()] = value.decode("latin-1")
        t0 = 0 if trace is None else now_ns()
        parsed = st.router.parse(self.kind, raw, wanted)
        st.edge.check_sampling(parsed.body)
        if trace is not None:
            trace.span("parse", t0, now_ns(), {"gen_ai.request.model": parsed.model})
        prep = await st.router.prepare(parsed, len(raw), trace)
        ex.watch(receive)
        if st.pd is not None and st.pd.disaggregated(prep):  # prefill and decode engines
            await st.pd.forward(self, scope, raw, prep, ex)
            return
        if st.gate is None or prep.pinned is not None:  # a stored response has one engine
            await self._forward(scope, raw, prep, ex, trace)
            return
        # admission (router.admission): held here while the engines are full, or shed
        ticket = await st.gate.enter(prep, scope["headers"], trace)
        try:
            await self._forward(scope, raw, prep, ex, trace, ticket)
        finally:
            st.gate.finish(ticket, ex.output_tokens)

    async def _forward(
        self,
        scope: Scope,
        raw: bytes,
        prep: Prepared,
        ex: Exchange,
        trace: Trace | None,
        ticket: Ticket | None = None,
    ) -> None:
        """Send to the engine the policy chooses (admission's choice, with a ``ticket``,
        for the first try) and stream its answer back."""
        st = self.deps
        headers = [(k, v) for k, v in scope["headers"] if k not in self.drop]
        if not any(k == b"x-request-id" for k, _ in headers):
            headers.append((b"x-request-id", prep.request.request_id.encode()))
        why = refusal(prep.parsed, st.cfg.gateway) if st.cfg.migrate_max else "off"
        if why is None:  # it moves to another engine if its engine breaks
            await Migration(self, prep, headers, raw, ex, trace, ticket).run()
            return
        leg = await self.open(prep, headers, raw, set(), trace, ticket=ticket)
        try:
            remember = None
            if self.kind == "responses" and prep.parsed.body.get("store") is not False:
                remember = st.affinity.remembers(leg.worker.id)
            await self.stream(
                ex, leg.resp, leg.tid, leg.flight, leg.series, prep.arm, leg.hit, remember,
                first_token=self.first_token(prep, leg.tid),
            )  # fmt: skip
        except UpstreamError:
            st.metrics.not_migrated.labels(why).inc()
            raise
        else:
            if not leg.resp.complete:  # a broken stream, ended with an error event
                st.metrics.not_migrated.labels(why).inc()
        finally:
            self.close(leg, prep, trace)

    def first_token(self, prep: Prepared, tid: str) -> Callable[[float], None]:
        """The policy's time-to-first-token hook for a request on ``tid``."""
        policy = self.deps.experiment.policy_for(prep.arm)
        req = prep.request

        def first_token(ms: float) -> None:
            policy.on_first_token(req, tid, ms)

        return first_token

    async def open(
        self,
        prep: Prepared,
        headers: list[tuple[bytes, bytes]],
        raw: bytes,
        exclude: set[str],
        trace: Trace | None,
        resend: Callable[[Cause], bool] | None = None,
        ticket: Ticket | None = None,
    ) -> Leg:
        """Decide and send until an engine answers with its status and headers: the
        next-best worker gets the request while nothing can have run on the last one
        (``Failure.retry``), or while ``resend`` allows it (a migratable request: it may
        have reached the engine, the engine broke before answering). ``ApiError`` when
        no worker is left. With a ``ticket`` the first try goes where admission bound it."""
        st = self.deps
        req = prep.request
        arm = prep.arm
        bound = None if ticket is None else waiter(ticket)
        out_raw, out_body = prep.engine_body(raw)
        broke: UpstreamError | None = None  # an engine broke under it and it moved on
        while True:
            try:
                if bound is not None and bound.decision is not None:  # bound by admission
                    decision, views, bound = bound.decision, bound.views, None
                else:
                    decision, views = st.router.decide(prep, exclude, trace)
            except ApiError as err:
                if broke is None:
                    raise
                st.metrics.not_migrated.labels("no_worker").inc()  # today's error
                raise ApiError(502, str(broke), "upstream_error") from err
            tid = decision.worker_id  # the worker, or one of its DP ranks (router/workers/dp.py)
            found = st.registry.target(tid)
            worker, rank = found if found is not None else (st.registry.get(tid), None)
            if worker is None:  # removed between the views and now
                exclude.add(tid)
                continue
            hit = hit_blocks(views, decision) * req.block_size
            prefetched = await self.hint(decision, prep)
            flight = worker.rank_load(rank).begin(max(0, req.num_tokens - hit))
            if ticket is not None and st.gate is not None:
                st.gate.started(ticket)
            failure: Failure | None = None
            error: UpstreamError | None = None
            path, send_raw, send_body, plan = self.path, out_raw, out_body, None
            if self.tokens_in is not None and (plan := self.tokens_in.plan(prep, worker)):
                path, send_raw, send_body = plan.path, plan.raw, plan.body
            sent, body = forward_rank(headers, send_raw, send_body, rank, worker.dp_field)
            t_send = 0
            if trace is not None:
                sent = [h for h in sent if h[0] not in (b"traceparent", b"tracestate")]
                parent = trace.begin_upstream(worker.id, worker.url, self.path)
                sent.append((b"traceparent", parent))
                t_send = now_ns()
            try:
                resp = await st.upstream.send(worker.url, path, sent, body, st.cfg.request_timeout)
                if plan is not None:  # the engine's answer as the chat answer
                    resp = await plan.answer(resp, st.cfg.request_timeout)
            except UpstreamError as exc:
                failure, error = send_failure(exc), exc
            except BaseException:
                flight.finish()
                raise
            else:
                if resp.status == 503 and st.cfg.gateway:
                    resp.close()
                    failure = CLUSTER_UNAVAILABLE
            if failure is None:
                break
            if trace is not None:
                trace.end_upstream(failure.reason)
            flight.finish()
            # a migration (counted by ``resend``): the engine broke before it answered
            if (
                not failure.retry
                and error is not None
                and resend is not None
                and resend(cause_of(error))
            ):
                st.registry.request_failed(worker, failure.reason)
                st.registry.suspect(worker)
                st.metrics.error(arm, worker.id, failure.kind)
                exclude.add(worker.id)
                broke = error
                continue
            self.failed(worker, failure, error, arm, exclude)
        t_head = 0
        if trace is not None:
            t_head = now_ns()
            trace.upstream_step("upstream connect", t_send, resp.written_ns)
            trace.upstream_step("first byte", resp.written_ns, t_head)
            trace.status = resp.status
            trace.attrs(worker=tid, arm=arm, prompt_tokens=req.num_tokens,
                        routed_hit_tokens=hit, reason=decision.reason)  # fmt: skip
        leg = Leg(resp, worker, tid, hit, flight, st.metrics.series(arm, tid), t_head)
        try:
            st.router.predict(prep, tid)
            leg.series.requests.inc()
            leg.series.prompt_tokens.inc(req.num_tokens)
            leg.series.routed_hit_tokens.inc(hit)
            st.audit.routed(tid, req.block_hashes[0] if req.block_hashes else None)
            if st.capacity is not None and req.block_hashes:
                st.capacity.record(
                    req.model, req.block_size, tid, req.block_hashes, req.num_tokens,
                    prefetched,
                )  # fmt: skip
        except BaseException:
            self.close(leg, prep, trace)
            raise
        return leg

    def close(self, leg: Leg, prep: Prepared, trace: Trace | None) -> None:
        """Done with ``leg``: its connection (aborted unless read to the end), its
        place in the worker's load, the policy's hook, the trace's span."""
        leg.resp.close()
        leg.flight.finish()
        if trace is not None:
            trace.upstream_step("stream end", leg.t_head, now_ns())
            trace.end_upstream(None if leg.resp.complete else "stream cut", leg.resp.status)
        self.deps.experiment.policy_for(prep.arm).on_finish(prep.request, leg.tid)

    async def hint(self, decision: Decision | None, prep: Prepared) -> int:
        """Publish the decision's prefetch hint, if it carries one; the blocks it pulls
        into the decision's worker (0: none). Sent before the request (and by router.pd.exchange
        before a prefill), so that the blocks land while it waits in the engine's queue:
        a whole answer's headers, and a prefill's, come only once the prompt is computed,
        and a hint published after them named blocks the engine had just computed
        (tests/test_router_e2e.py, tests/test_pd_e2e.py)."""
        if decision is None or decision.prefetch is None:
            return 0
        hint = decision.prefetch
        if not await self.deps.hints.publish(hint, prep.request, prep.pool):
            return 0
        self.deps.metrics.prefetch_hints.labels(prep.arm, hint.target_worker).inc()
        return hint.blocks if hint.target_worker == decision.worker_id else 0

    def failed(
        self,
        worker: Worker,
        failure: Failure,
        error: UpstreamError | None,
        arm: str,
        exclude: set[str],
    ) -> None:
        """Count a send that failed; raise the client's error unless another worker may
        take the request (then ``worker`` is in ``exclude``)."""
        st = self.deps
        st.registry.request_failed(worker, failure.reason)
        if failure.suspect:
            st.registry.suspect(worker)
        st.metrics.error(arm, worker.id, failure.kind)
        if failure.retry:
            exclude.add(worker.id)
        if not failure.retry or len(exclude) > st.cfg.connect_retries:
            message = failure.message if failure.message is not None else str(error)
            raise ApiError(failure.status, message, failure.code) from error
        st.metrics.retries.labels(worker.id).inc()

    async def stream(
        self,
        ex: Exchange,
        resp: Response,
        worker_id: str,
        flight: Flight,
        series: Series | None,
        arm: str,
        hit: int,
        remember: Callable[[bytes], None] | None = None,
        prefilled_remotely: bool = False,
        first_token: Callable[[float], None] | None = None,
    ) -> None:
        """Send the engine's answer on; ``remember`` gets the body's first bytes (a
        response id is in them) once the answer is complete. A decode engine that
        received the prompt's KV from a prefill engine (``prefilled_remotely``) reports it
        as cached: its ``cached_tokens`` are no prefix hits (``router.pd.exchange`` counts the
        prefill engine's). ``first_token`` gets the time to first token in ms, for a
        streamed answer (a whole body's first byte is no TTFT).

        The steps: the status counts for the worker (``_settle``), the head is built
        (``_head``) and a stream's goes at once, the body is relayed chunk by chunk
        (``_send_body``), a cut is answered (``_broken``), the hits are counted."""
        status = resp.status
        worker = self._settle(worker_id, status, arm)
        start = self.head(resp, worker_id, hit)
        sse = (resp.header(b"content-type") or b"").startswith(b"text/event-stream")
        if sse:  # a stream's head goes now; a whole answer's with its first bytes, so
            ex.started = True  # both leave in one write (router.http.coalesce)
            await ex.send(start)
        on_first = first_token if sse and status < 400 else None
        try:
            cached, head = await self._send_body(
                ex, resp, start, flight, series, on_first, remember is not None
            )
        except UpstreamError as exc:
            self._broken(worker, worker_id, arm)
            if not sse:
                if not ex.started:  # the status the engine sent, then the cut, as before
                    ex.started = True
                    await ex.send(start)
                raise  # abort the connection: the client must not take a cut body as whole
            ex.done = True
            body = sse_error(str(exc), "upstream_broken")
            await ex.send({"type": "http.response.body", "body": body})
            return
        if not ex.done:
            ex.done = True
            if not ex.started:  # an empty body
                ex.started = True
                await ex.send(start)
            await ex.send({"type": "http.response.body", "body": b""})
        st = self.deps
        if not prefilled_remotely:
            if cached is not None and series is not None:
                series.hit_tokens.inc(cached)
            if series is not None and status < 400 and not st.cfg.gateway:
                st.audit.record(worker_id, hit, cached)
        if remember is not None and status < 400:
            remember(head)

    def _settle(self, worker_id: str, status: int, arm: str) -> Worker | None:
        """The engine's status counts for its worker's health (a 5xx as a failure) and, as
        an error, in the metrics; the worker (``worker_id``: the target, router/workers/dp.py)."""
        st = self.deps
        found = st.registry.target(worker_id)
        worker = found[0] if found is not None else st.registry.get(worker_id)
        if worker is not None:
            if status >= 500:
                st.registry.request_failed(worker, f"status {status}")
            else:
                st.registry.request_succeeded(worker)
        if status >= 400:
            st.metrics.error(arm, worker_id, f"engine_{status}")
        return worker

    def head(self, resp: Response, worker_id: str, hit: int) -> Message:
        """The client's response head: the engine's status and end-to-end headers, the
        worker that answered and the prompt tokens the index predicted cached."""
        out = [(k, v) for k, v in resp.headers if k.lower() not in _RESP_DROP]
        out.append((self.worker_header, worker_id.encode()))
        if not self.deps.cfg.gateway:  # what the index predicted; compare usage.cached_tokens
            out.append((HIT_HEADER, str(hit).encode()))
        return {"type": "http.response.start", "status": resp.status, "headers": out}

    async def _send_body(
        self,
        ex: Exchange,
        resp: Response,
        start: Message,
        flight: Flight,
        series: Series | None,
        first_token: Callable[[float], None] | None,
        keep_head: bool,
    ) -> tuple[int | None, bytes]:
        """The body's chunks to the client as they come (the head with the first, when it
        has not gone yet); the last ``cached_tokens`` the body reported, and its first
        ``HEAD_BYTES`` when ``keep_head``. The first chunk is the time to first token."""
        send = ex.send
        cached = None
        tail = b""
        head = b""
        async for chunk in resp.chunks(self.deps.cfg.request_timeout):
            if flight.state is WAITING:
                elapsed = time.perf_counter() - ex.t0
                if series is not None:
                    series.ttft.observe(elapsed)
                if first_token is not None:
                    first_token(elapsed * 1000.0)
                flight.first_byte()
            if keep_head and len(head) < HEAD_BYTES:
                head += chunk
            window = tail + chunk  # '"cached_tokens": 12' may be cut between chunks
            if b"_tokens" in window:  # usage
                numbers = CACHED_TOKENS.findall(window)
                if numbers:
                    cached = int(numbers[-1])
                numbers = COMPLETION_TOKENS.findall(window)
                if numbers:  # settles admission's fair share with what was generated
                    ex.output_tokens = int(numbers[-1])
            tail = chunk[-32:]
            if resp.drained:  # the last chunk: end the response with it
                ex.done = True
            if not ex.started:
                ex.started = True
                await send(start)
            await send({"type": "http.response.body", "body": chunk, "more_body": not ex.done})
        return cached, head

    def _broken(self, worker: Worker | None, worker_id: str, arm: str) -> None:
        """The engine's answer broke off: counted, and the worker is probed now."""
        st = self.deps
        st.metrics.error(arm, worker_id, "upstream_broken")
        if worker is not None:
            st.registry.request_failed(worker, "broken stream")
            st.registry.suspect(worker)
