"""The ``ext_proc`` gRPC server: one bidirectional stream per HTTP request.

The gateway sends the request's headers, then its body, then (after the engine
answered) the response's headers, body and trailers; this server answers each as the
body mode in force requires (``protocol_config`` in the first message says which; a
gateway that does not say gets ``epp_body_mode``):

- ``FULL_DUPLEX_STREAMED`` (what GIE's pickers run, llm-d's the only one it supports):
  nothing is answered until the body's last chunk; then the routed headers response,
  then the body sent back in ``streamed_response`` chunks (the gateway forwards what the
  picker returns, not what it sent). Response body chunks are sent back as they come,
  each on receipt, so a stream's tokens are not held.
- ``BUFFERED``: the headers are let through at once, the whole body arrives in one
  message, and the body response carries the destination header (a header mutation in
  a body response takes effect in this mode) and the same metadata.
- a request without a body (its headers end the stream), or a gateway that sends no
  request body (``NONE``): routed on load from its headers alone.
- ``STREAMED`` and ``BUFFERED_PARTIAL`` request bodies cannot be routed on (the gateway
  picks the upstream before the picker could read the prompt): the stream is closed
  with ``UNIMPLEMENTED``, which the gateway treats as the picker failing (its
  ``failureMode``: FailClose answers 5xx, FailOpen picks an endpoint itself).

Refusals (malformed body 400, unknown model 404, no usable engine 503, overload 429,
header limits 431, API key 401, admission's sheds 429/503 with ``retry-after``) are
immediate responses with the OpenAI error body, exactly what the proxy would have
answered.

Admission may hold a request before it is routed (router.admission, as the proxy's
are). Envoy times each message it sends the processor (``message_timeout``, 200 ms by
default) except in ``FULL_DUPLEX_STREAMED`` mode, where it sets no timer: there a hold
lasts up to ``queue_timeout``; in buffered mode (and for a gateway that sends no body)
it ends ``HOLD_MARGIN`` before ``epp_message_timeout``, the gateway's setting as the
router is told it, so the request is answered (routed, or shed with a 503) before the
gateway gives up on the picker. A gateway that cancels the stream while the request is
held (its client went away) takes it out of the queue. The gRPC health service answers
``liveness``, ``readiness`` and the ``ext_proc`` service name, as the protocol's
"Health Checking" section lists them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.epp import messages
from router.epp import protocol as pr
from router.epp.picker import Picker, Routed
from router.forward.relay import ProxyDeps
from router.http.errors import ApiError

if TYPE_CHECKING:
    from router.config import EppSettings

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READY_INTERVAL = 1.0  # seconds between readiness updates (the discovery's first lists)
HOLD_MARGIN = 0.05  # seconds (at most a quarter of it) a hold ends before a message timeout


def hold_bound(message_timeout: float) -> float:
    """Seconds a request may be held where the gateway gives up after ``message_timeout``."""
    return max(0.0, message_timeout - min(HOLD_MARGIN, message_timeout / 4))


class ExternalProcessor:
    """``envoy.service.ext_proc.v3.ExternalProcessor``, answered by ``Picker``."""

    def __init__(self, deps: ProxyDeps, default_mode: int, message_timeout: float = 0.2) -> None:
        self.picker = Picker(deps)
        self.deps = deps
        self.default_mode = default_mode
        self.hold = hold_bound(message_timeout)  # buffered mode's bound on a hold
        self.streams = 0
        self.refused = 0

    async def Process(  # the proto's name
        self, _requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        """One HTTP request's conversation, on the read/write API (the async-generator
        form cost more per message: ``bench/epp.py``)."""
        send = context.write
        self.streams += 1
        routed: Routed | None = None
        request_mode = response_mode = self.default_mode
        headers: dict[str, str] = {}
        subset: list[str] | None = None
        body = bytearray()
        limit = self.deps.cfg.max_body_bytes
        first = True
        try:
            while (msg := await context.read()) is not grpc.aio.EOF:
                if first and msg.HasField("protocol_config"):
                    request_mode = msg.protocol_config.request_body_mode
                    response_mode = msg.protocol_config.response_body_mode
                first = False
                which = msg.WhichOneof("request")
                if which == "request_headers":
                    headers = pr.header_map(msg.request_headers.headers)
                    subset = pr.subset_hint(msg)
                    refused = self.picker.refused(_path(headers), headers)
                    if refused is not None:
                        await send(self._refuse(refused))
                        return
                    if msg.request_headers.end_of_stream or request_mode == pr.NONE:
                        answer = await self._pick(headers, None, subset)
                        if isinstance(answer, Routed):
                            routed = answer
                            await send(self._answer(routed, "request_headers"))
                        else:
                            await send(answer)
                            return
                    elif request_mode == pr.BUFFERED:
                        await send(pr.passed("request_headers"))
                    elif request_mode != pr.FULL_DUPLEX:
                        await context.abort(
                            grpc.StatusCode.UNIMPLEMENTED,
                            "request_body_mode must be FULL_DUPLEX_STREAMED or BUFFERED",
                        )
                elif which == "request_body":
                    body += msg.request_body.body
                    if len(body) > limit:
                        err = ApiError(413, f"request body over {limit} bytes", "request_too_large")
                        await send(self._refuse(err))
                        return
                    if not msg.request_body.end_of_stream:
                        continue
                    hold = None if request_mode == pr.FULL_DUPLEX else self.hold
                    answer = await self._pick(headers, bytes(body), subset, hold)
                    if not isinstance(answer, Routed):
                        await send(answer)
                        return
                    routed = answer
                    sent = routed.body if routed.body is not None else bytes(body)
                    if request_mode == pr.FULL_DUPLEX:
                        await send(self._answer(routed, "request_headers", len(sent)))
                        for chunk in pr.body_chunks(sent, "request_body"):
                            await send(chunk)
                    else:
                        await send(self._answer(routed, "request_body", len(sent), routed.body))
                elif which == "request_trailers":
                    await send(pr.trailers("request_trailers"))
                elif which == "response_headers":
                    served = pr.served_endpoint(msg)
                    extra: list[tuple[str, str]] = []
                    if routed is not None:
                        if served is not None and served != routed.endpoint:
                            log.debug("epp: %s routed to %s, served by %s",
                                      routed.target, routed.endpoint, served)  # fmt: skip
                        extra = routed.response_headers(pr.header_map(msg.response_headers.headers))
                        if msg.response_headers.end_of_stream:
                            routed.finish(complete=True)
                    await send(pr.passed("response_headers", extra))
                elif which == "response_body":
                    chunk = msg.response_body.body
                    end = msg.response_body.end_of_stream
                    if routed is not None:
                        routed.response_body(chunk, end)
                    if response_mode == pr.FULL_DUPLEX:
                        for out in pr.body_chunks(chunk, "response_body", end):
                            await send(out)
                    else:
                        await send(pr.passed("response_body"))
                elif which == "response_trailers":
                    if routed is not None:
                        routed.finish(complete=True)
                    await send(pr.trailers("response_trailers"))
        finally:
            if routed is not None:
                routed.finish()

    async def _pick(
        self,
        headers: dict[str, str],
        raw: bytes | None,
        subset: list[str] | None,
        hold: float | None = None,
    ) -> Routed | Any:
        """The routed request, or the immediate response that refuses it."""
        try:
            return await self.picker.pick(_path(headers), raw, headers, subset, hold)
        except ApiError as err:
            return self._refuse(err)

    def _refuse(self, err: ApiError) -> Any:
        self.refused += 1
        self.deps.metrics.error("-", "-", err.code)
        extra = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in err.headers]
        return pr.immediate(err.status, err.body(), headers=extra)

    @staticmethod
    def _answer(
        routed: Routed, phase: str, length: int | None = None, body: bytes | None = None
    ) -> Any:
        headers = list(routed.set_headers)
        if length is not None and (body is not None or phase == "request_headers"):
            headers.append(("content-length", str(length)))
        return pr.routed(
            routed.endpoint, headers, phase=phase, remove=routed.remove_headers, body=body
        )


def _path(headers: dict[str, str]) -> str:
    return headers.get(":path", "/").partition("?")[0]


class EppServer:
    """The gRPC listener: the processor and the health service on ``port``."""

    def __init__(
        self,
        deps: ProxyDeps,
        host: str,
        port: int,
        body_mode: str = "full_duplex_streamed",
        ready: Callable[[], bool] | None = None,
        message_timeout: float = 0.2,
    ) -> None:
        self.processor = ExternalProcessor(deps, pr.MODE_NAMES[body_mode], message_timeout)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server()
        process = grpc.stream_stream_rpc_method_handler(
            self.processor.Process,
            request_deserializer=messages.ProcessingRequest.FromString,
            response_serializer=messages.ProcessingResponse.SerializeToString,
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(pr.SERVICE, {"Process": process}),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(_address(host, port))
        self.ready = ready  # None: ready once started
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.server.start()
        await self.health.set("liveness", SERVING)
        await self.refresh()
        if self.ready is not None:
            self._watch = asyncio.create_task(self._follow(), name="epp readiness")
        log.info("endpoint picker (ext_proc) on port %d", self.port)

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(READY_INTERVAL)
            await self.refresh()

    async def refresh(self) -> None:
        """Readiness (and the processor's service) from ``ready``: the engines listed."""
        status = SERVING if self.ready is None or self.ready() else NOT_SERVING
        for name in ("", "readiness", pr.SERVICE):
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    def describe(self) -> dict[str, object]:
        return {
            "port": self.port,
            "streams": self.processor.streams,
            "refused": self.processor.refused,
        }


async def start_picker(
    cfg: EppSettings, host: str, deps: ProxyDeps, sources: Sequence[object]
) -> EppServer:
    """The EPP serving on ``cfg.epp_port``; ready once every discovery source that can
    say so (``synced``: the Kubernetes API's) has listed its engines."""

    def ready() -> bool:
        return all(getattr(s, "synced", True) for s in sources)

    server = EppServer(
        deps, host, cfg.epp_port or 0, cfg.epp_body_mode, ready, cfg.epp_message_timeout
    )
    await server.start()
    return server


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
