"""A gateway's side of the ``ext_proc`` stream, built from Envoy's own protos as packaged
(``envoy-data-plane``: all of them, generated apart from the picker's own declaration of
the fields it uses in router/epp/messages.py, so the wire is checked both ways).

``Gateway.send`` plays what Envoy's ext_proc filter does for one HTTP request, in the
order the filter sends it: the request headers (with ``protocol_config`` in the first
message, as Envoy 1.34+ does), the body in chunks, the picker's answers read back;
then it forwards the body the picker returned to the endpoint it named (httpx, the
upstream the gateway would open), and plays the response phase: response headers,
each body chunk as the engine sent it, every answer read back and its echoed chunk
compared. A refusal ends the exchange with the immediate response.

The messages are betterproto2's dataclasses (``bytes(msg)``, ``Msg.parse``), carried by
grpcio as raw bytes on the service's method path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import betterproto2
import grpc
import httpx
from envoy_data_plane.envoy.config.core import v3 as core
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ProcessingModeBodySendMode as Mode,
)
from envoy_data_plane.envoy.service.ext_proc import v3 as ep
from envoy_data_plane.google.protobuf import Struct
from stack import DoubleStack

from router.epp.server import EppServer

FULL_DUPLEX = Mode.FULL_DUPLEX_STREAMED
BUFFERED = Mode.BUFFERED
METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def headers_msg(pairs: dict[str, str], end: bool = False) -> Any:
    hm = core.HeaderMap(
        headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    return ep.HttpHeaders(headers=hm, end_of_stream=end)


def set_headers(mutation: Any) -> dict[str, str]:
    if mutation is None:
        return {}
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def which(answer: Any) -> str:
    """The ``ProcessingResponse`` oneof that is set ("" for none)."""
    return betterproto2.which_one_of(answer, "response")[0]  # type: ignore[no-any-return]


def streamed(answer: Any, phase: str) -> Any:
    """The ``streamed_response`` of a body answer (an empty one when absent)."""
    body = getattr(answer, phase)
    mutation = body.response.body_mutation if body and body.response else None
    if mutation is None or mutation.streamed_response is None:
        return ep.StreamedBodyResponse()
    return mutation.streamed_response


@dataclass
class Exchange:
    """What one request went through: the picker's answers and the engine's."""

    immediate: Any = None  # the ImmediateResponse, when the picker refused
    endpoint: str | None = None  # x-gateway-destination-endpoint
    metadata: dict[str, Any] = field(default_factory=dict)
    set: dict[str, str] = field(default_factory=dict)  # request headers set
    removed: list[str] = field(default_factory=list)
    clear_route_cache: bool = False
    body: bytes = b""  # what the gateway forwards
    status: int = 0
    response_set: dict[str, str] = field(default_factory=dict)
    response: bytes = b""  # the engine's answer as echoed back
    answers: list[Any] = field(default_factory=list)

    @property
    def worker(self) -> str:
        return self.response_set["x-cache-router-worker"]

    def error(self) -> dict[str, Any]:
        import orjson

        assert self.immediate is not None
        return orjson.loads(self.immediate.body)["error"]  # type: ignore[no-any-return]


class Gateway:
    """The gateway side, over a gRPC channel to the picker."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.process = self.channel.stream_stream(
            METHOD, request_serializer=bytes, response_deserializer=ep.ProcessingResponse.parse
        )
        self.http = httpx.AsyncClient(timeout=10)

    async def close(self) -> None:
        await self.channel.close()
        await self.http.aclose()

    async def send(
        self,
        path: str,
        body: bytes | None,
        *,
        headers: dict[str, str] | None = None,
        mode: int = FULL_DUPLEX,
        response_mode: int | None = None,
        subset: list[str] | str | None = None,
        chunk: int = 40,
        forward: bool = True,
        config: bool = True,
    ) -> Exchange:
        response_mode = mode if response_mode is None else response_mode
        call = self.process()
        ex = Exchange()
        first = ep.ProcessingRequest(
            request_headers=headers_msg(
                {":method": "POST" if body is not None else "GET", ":path": path,
                 ":authority": "gw", "content-type": "application/json", **(headers or {})},
                end=body is None,
            )
        )  # fmt: skip
        if config:
            first.protocol_config = ep.ProtocolConfiguration(
                request_body_mode=mode, response_body_mode=response_mode
            )
        if subset is not None:
            hint = Struct.from_dict({"x-gateway-destination-endpoint-subset": subset})
            first.metadata_context = core.Metadata(filter_metadata={"envoy.lb.subset_hint": hint})
        await call.write(first)
        if body is None:
            await self._routed(call, ex, "request_headers")
        elif mode == BUFFERED:
            answer = await call.read()
            ex.answers.append(answer)
            if which(answer) == "immediate_response":
                ex.immediate = answer.immediate_response
                return ex
            assert which(answer) == "request_headers", answer
            await call.write(
                ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
            )
            await self._routed(call, ex, "request_body")
            ex.body = ex.body or body
        else:
            pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
            for i, piece in enumerate(pieces):
                end = i == len(pieces) - 1
                msg = ep.ProcessingRequest(request_body=ep.HttpBody(body=piece, end_of_stream=end))
                try:
                    await call.write(msg)
                except grpc.aio.AioRpcError:  # the picker answered early and closed (413)
                    break
            await self._routed(call, ex, "request_headers")
            if ex.immediate is None:
                while True:  # the body comes back in streamed chunks
                    answer = await call.read()
                    ex.answers.append(answer)
                    chunk = streamed(answer, "request_body")
                    ex.body += chunk.body
                    if chunk.end_of_stream:
                        break
        if ex.immediate is not None or not forward:
            call.cancel()
            return ex
        await self._respond(call, ex, path, body, response_mode)
        await call.done_writing()
        return ex

    async def _routed(self, call: Any, ex: Exchange, phase: str) -> None:
        answer = await call.read()
        ex.answers.append(answer)
        if which(answer) == "immediate_response":
            ex.immediate = answer.immediate_response
            return
        assert which(answer) == phase, answer
        common = getattr(answer, phase).response
        ex.set = set_headers(common.header_mutation)
        ex.removed = list(common.header_mutation.remove_headers)
        ex.clear_route_cache = common.clear_route_cache
        ex.endpoint = ex.set["x-gateway-destination-endpoint"]
        ex.metadata = answer.dynamic_metadata.to_dict()
        if common.body_mutation is not None and common.body_mutation.body:
            ex.body = common.body_mutation.body

    async def _respond(
        self, call: Any, ex: Exchange, path: str, body: bytes | None, mode: int
    ) -> None:
        """Forward to the endpoint, then play the response phase."""
        skip = {"x-gateway-destination-endpoint", "content-length"}
        sent = {k: v for k, v in ex.set.items() if k not in skip}
        url = f"http://{ex.endpoint}{path}"
        method = "POST" if body is not None else "GET"
        async with self.http.stream(method, url, content=ex.body or None, headers=sent) as r:
            ex.status = r.status_code
            head = {":status": str(r.status_code), **dict(r.headers)}
            await call.write(ep.ProcessingRequest(response_headers=headers_msg(head)))
            answer = await call.read()
            assert which(answer) == "response_headers", answer
            ex.response_set = set_headers(answer.response_headers.response.header_mutation)
            chunks = [c async for c in r.aiter_raw()]
        chunks.append(b"")  # the end of the body, as its own message
        for i, piece in enumerate(chunks):
            end = i == len(chunks) - 1
            await call.write(
                ep.ProcessingRequest(response_body=ep.HttpBody(body=piece, end_of_stream=end))
            )
            if mode == FULL_DUPLEX:
                echoed = b""
                while True:
                    answer = await call.read()
                    chunk = streamed(answer, "response_body")
                    echoed += chunk.body
                    if len(echoed) >= len(piece):
                        assert chunk.end_of_stream == end
                        break
                assert echoed == piece
                ex.response += echoed
            else:
                answer = await call.read()
                assert which(answer) == "response_body"
                ex.response += piece


async def picker(stack: DoubleStack, **kw: Any) -> tuple[EppServer, Gateway]:
    """An endpoint picker on the stack's router, on a free port, and a gateway of it."""
    server = EppServer(stack.state.proxy_deps(), "127.0.0.1", 0, **kw)
    await server.start()
    return server, Gateway(server.port)
