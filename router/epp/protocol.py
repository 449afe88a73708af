"""The Endpoint Picker protocol's names and messages, over Envoy's ``ext_proc`` v3.

Everything here is what the gateway side reads, so it follows the protocol's text
(gateway-api-inference-extension, ``docs/proposals/004-endpoint-picker-protocol``,
v1.0.0) and the reference pickers (that repository's ``pkg/lwepp/handlers`` and
``pkg/common/envoy``; llm-d's router, ``pkg/epp/handlers``):

- the chosen endpoint goes out twice, with the same value: the request header
  ``x-gateway-destination-endpoint`` and the dynamic metadata
  ``envoy.lb / x-gateway-destination-endpoint`` (``ip:port``; a comma list is primary
  then fallbacks), in the response to the request headers, with ``clear_route_cache``
  so the gateway routes again on the new header;
- the gateway may narrow the choice with the filter metadata
  ``envoy.lb.subset_hint / x-gateway-destination-endpoint-subset`` (a list, or one
  comma-separated string: both occur); none eligible is a 503 immediate response;
- no ready endpoint: an immediate response 503; a request dropped (overload): 429
  (admission's shed answers, 429 or 503, carry ``retry-after`` in the immediate
  response's headers and the OpenAI error body, as the proxy answers them);
- in the response phase the gateway reports ``envoy.lb /
  x-gateway-destination-endpoint-served``, the endpoint that answered (it may have
  retried down the list);
- a body sent back in ``FULL_DUPLEX_STREAMED`` mode goes in ``streamed_response``
  chunks of at most 62,000 bytes (some Envoy builds cap a chunk at 64 KiB), the last
  one marked ``end_of_stream``.

The messages are declared in ``router/epp/messages.py`` (the fields used, Envoy's
numbers, protobuf's runtime), the service is ``grpcio``'s; both are the ``epp`` extra,
imported only when the EPP runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from router.epp import messages as ep

DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION_KEY = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # also a health service name
CHUNK_BYTES = 62_000  # a streamed body chunk sent back (pkg/common/envoy/chunking.go)

FULL_DUPLEX = ep.BODY_SEND_MODE["FULL_DUPLEX_STREAMED"]
BUFFERED = ep.BODY_SEND_MODE["BUFFERED"]
STREAMED = ep.BODY_SEND_MODE["STREAMED"]
NONE = ep.BODY_SEND_MODE["NONE"]
MODE_NAMES = {"full_duplex_streamed": FULL_DUPLEX, "buffered": BUFFERED}


def header_map(headers: Any) -> dict[str, str]:
    """An ``HttpHeaders.headers`` (``HeaderMap``) as a dict of lower-case names; Envoy
    sends ``raw_value`` (bytes), older builds ``value``."""
    out: dict[str, str] = {}
    for h in headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def endpoint_list(value: Any) -> list[str] | None:
    """The endpoints of a subset entry (a list of strings, each maybe a comma list, or
    one comma list); None when the value is neither."""
    if value.HasField("string_value"):
        items: Iterable[str] = [value.string_value]
    elif value.HasField("list_value"):
        items = [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    else:
        return None
    return [p.strip() for item in items for p in item.split(",") if p.strip()]


def subset_hint(request: Any) -> list[str] | None:
    """The endpoints the gateway allows for this request; None: no hint (any of the pool)."""
    meta = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in meta:
        return None
    fields = meta[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    found = endpoint_list(fields[SUBSET_KEY])
    return [] if found is None else found


def served_endpoint(request: Any) -> str | None:
    """The endpoint the gateway reports as having answered, if it says."""
    meta = request.metadata_context.filter_metadata
    if DESTINATION_NAMESPACE not in meta:
        return None
    value = meta[DESTINATION_NAMESPACE].fields.get(SERVED_KEY)
    if value is None or not value.HasField("string_value"):
        return None
    return value.string_value or None


def _headers(pairs: Sequence[tuple[str, str]]) -> list[Any]:
    return [
        ep.HeaderValueOption(header=ep.HeaderValue(key=k, raw_value=v.encode())) for k, v in pairs
    ]


def routed(
    endpoints: str,
    set_headers: Sequence[tuple[str, str]],
    *,
    phase: str,
    remove: Sequence[str] = (),
    body: bytes | None = None,
) -> Any:
    """The answer that routes the request: the destination header (plus ``set_headers``,
    less ``remove``) and the same value in the dynamic metadata. ``phase``:
    ``request_headers`` (full duplex and headers-only requests) or ``request_body``
    (buffered mode, where header mutations in a body response take effect); ``body``: a
    replacement body (buffered mode)."""
    common = ep.CommonResponse(
        header_mutation=ep.HeaderMutation(
            set_headers=_headers([(DESTINATION_KEY, endpoints), *set_headers]),
            remove_headers=list(remove),
        ),
        clear_route_cache=True,
    )
    if body is not None:
        common.body_mutation.body = body
    out = ep.ProcessingResponse()
    meta = out.dynamic_metadata.fields[DESTINATION_NAMESPACE].struct_value
    meta.fields[DESTINATION_KEY].string_value = endpoints
    getattr(out, phase).response.CopyFrom(common)
    return out


def body_chunks(body: bytes, phase: str, end: bool = True) -> Iterator[Any]:
    """A body sent back in full-duplex mode: ``streamed_response`` chunks of at most
    ``CHUNK_BYTES``; ``end``: the last one ends the stream (an empty body is one empty
    chunk). ``phase``: ``request_body`` or ``response_body``."""
    start = 0
    while True:
        chunk = body[start : start + CHUNK_BYTES]
        start += len(chunk)
        out = ep.ProcessingResponse()
        streamed = getattr(out, phase).response.body_mutation.streamed_response
        streamed.body = chunk
        streamed.end_of_stream = end and start >= len(body)
        yield out
        if start >= len(body):
            return


def passed(phase: str, set_headers: Sequence[tuple[str, str]] = ()) -> Any:
    """An answer that lets the message through unchanged (``phase``: the
    ``ProcessingResponse`` field named like the request's), with headers to set."""
    out = ep.ProcessingResponse()
    common = getattr(out, phase).response
    if set_headers:
        common.header_mutation.set_headers.extend(_headers(set_headers))
    else:
        common.SetInParent()
    return out


def trailers(phase: str) -> Any:
    """Trailers let through (``phase``: ``request_trailers`` or ``response_trailers``)."""
    out = ep.ProcessingResponse()
    getattr(out, phase).SetInParent()
    return out


def immediate(
    status: int,
    body: bytes,
    content_type: str = "application/json",
    headers: Sequence[tuple[str, str]] = (),
) -> Any:
    """The gateway answers the client itself with ``status``, ``body`` and ``headers``
    (a shed request's ``retry-after``)."""
    pairs = [("content-type", content_type), *headers]
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=ep.HttpStatus(code=status),
            headers=ep.HeaderMutation(set_headers=_headers(pairs)),
            body=body,
        )
    )
