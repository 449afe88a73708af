"""The ``ext_proc`` v3 messages the picker reads and writes, declared here.

Only the fields the picker uses are declared, with the field numbers of Envoy's
``envoy/service/ext_proc/v3/external_processor.proto`` (and of ``HeaderMap``,
``HeaderValue``, ``HeaderValueOption``, ``Metadata``, ``HttpStatus``, ``ProcessingMode``
it imports); protobuf's own runtime (upb, the ``protobuf`` package grpcio's health
service already needs) builds the classes in a private descriptor pool, so nothing here
collides with another copy of Envoy's protos loaded in the same process. A field not
declared is kept as an unknown field and never read. The wire is what counts: it is
checked against Envoy's own protos as packaged (``envoy-data-plane``) by
tests/test_epp.py, which plays the gateway with them.

Why not a package of generated protos: ``xds-protos`` ships its own old copy of
``opentelemetry/proto/...`` that overwrites ``opentelemetry-proto``'s files (the
tracing extra's OTLP exporter then fails to import); ``envoy-data-plane``
(betterproto2, pure Python) parses a headers message in ~200 us where upb takes ~1 us,
and a request is eight messages: ~1.5 ms more, as much as the whole EPP costs now. The
classes here parse and build as fast as xds-protos' (the same upb runtime: 0.75 us a
headers message, 5.5 us a routed answer, whose bytes are the same).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2

PACKAGE = "envoy.service.ext_proc.v3"  # the names are the pool's own; the numbers are Envoy's

F = descriptor_pb2.FieldDescriptorProto
OPTIONAL, REPEATED = F.LABEL_OPTIONAL, F.LABEL_REPEATED
SCALARS = {
    "string": F.TYPE_STRING,
    "bytes": F.TYPE_BYTES,
    "bool": F.TYPE_BOOL,
    "int32": F.TYPE_INT32,
}

# message: [(field, number, type, oneof)]; a type that is not a scalar names a message,
# "[T]" repeats it, "enum:E" is an enum of this file
MESSAGES: dict[str, list[tuple[str, int, str, str | None]]] = {
    "HeaderValue": [
        ("key", 1, "string", None),
        ("value", 2, "string", None),
        ("raw_value", 3, "bytes", None),
    ],
    "HeaderMap": [("headers", 1, "[HeaderValue]", None)],
    "HeaderValueOption": [("header", 1, "HeaderValue", None)],
    "Metadata": [("filter_metadata", 1, "map:google.protobuf.Struct", None)],
    "HttpStatus": [("code", 1, "int32", None)],  # an enum in Envoy: the same varint
    "ProtocolConfiguration": [
        ("request_body_mode", 1, "enum:BodySendMode", None),
        ("response_body_mode", 2, "enum:BodySendMode", None),
    ],
    "HttpHeaders": [("headers", 1, "HeaderMap", None), ("end_of_stream", 3, "bool", None)],
    "HttpBody": [("body", 1, "bytes", None), ("end_of_stream", 2, "bool", None)],
    "HttpTrailers": [("trailers", 1, "HeaderMap", None)],
    "ProcessingRequest": [
        ("request_headers", 2, "HttpHeaders", "request"),
        ("response_headers", 3, "HttpHeaders", "request"),
        ("request_body", 4, "HttpBody", "request"),
        ("response_body", 5, "HttpBody", "request"),
        ("request_trailers", 6, "HttpTrailers", "request"),
        ("response_trailers", 7, "HttpTrailers", "request"),
        ("metadata_context", 8, "Metadata", None),
        ("protocol_config", 11, "ProtocolConfiguration", None),
    ],
    "HeaderMutation": [
        ("set_headers", 1, "[HeaderValueOption]", None),
        ("remove_headers", 2, "[string]", None),
    ],
    "StreamedBodyResponse": [("body", 1, "bytes", None), ("end_of_stream", 2, "bool", None)],
    "BodyMutation": [
        ("body", 1, "bytes", "mutation"),
        ("streamed_response", 3, "StreamedBodyResponse", "mutation"),
    ],
    "CommonResponse": [
        ("header_mutation", 2, "HeaderMutation", None),
        ("body_mutation", 3, "BodyMutation", None),
        ("clear_route_cache", 5, "bool", None),
    ],
    "HeadersResponse": [("response", 1, "CommonResponse", None)],
    "BodyResponse": [("response", 1, "CommonResponse", None)],
    "TrailersResponse": [("header_mutation", 1, "HeaderMutation", None)],
    "ImmediateResponse": [
        ("status", 1, "HttpStatus", None),
        ("headers", 2, "HeaderMutation", None),
        ("body", 3, "bytes", None),
    ],
    "ProcessingResponse": [
        ("request_headers", 1, "HeadersResponse", "response"),
        ("response_headers", 2, "HeadersResponse", "response"),
        ("request_body", 3, "BodyResponse", "response"),
        ("response_body", 4, "BodyResponse", "response"),
        ("request_trailers", 5, "TrailersResponse", "response"),
        ("response_trailers", 6, "TrailersResponse", "response"),
        ("immediate_response", 7, "ImmediateResponse", "response"),
        ("dynamic_metadata", 8, "google.protobuf.Struct", None),
    ],
}
# envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode
BODY_SEND_MODE = {
    "NONE": 0,
    "STREAMED": 1,
    "BUFFERED": 2,
    "BUFFERED_PARTIAL": 3,
    "FULL_DUPLEX_STREAMED": 4,
    "GRPC": 5,
}


def _field(msg: descriptor_pb2.DescriptorProto, name: str, number: int, kind: str,
           oneof: str | None) -> None:  # fmt: skip
    field = msg.field.add(name=name, number=number, label=OPTIONAL)
    if kind.startswith("["):
        field.label = REPEATED
        kind = kind[1:-1]
    if kind in SCALARS:
        field.type = SCALARS[kind]
    elif kind.startswith("enum:"):
        field.type, field.type_name = F.TYPE_ENUM, f".{PACKAGE}.{kind[5:]}"
    elif kind.startswith("map:"):  # map<string, V>: a repeated nested entry message
        entry = msg.nested_type.add(name="".join(p.title() for p in name.split("_")) + "Entry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, label=OPTIONAL, type=F.TYPE_STRING)
        entry.field.add(name="value", number=2, label=OPTIONAL, type=F.TYPE_MESSAGE,
                        type_name=f".{kind[4:]}")  # fmt: skip
        field.label, field.type = REPEATED, F.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{msg.name}.{entry.name}"
    else:
        field.type = F.TYPE_MESSAGE
        field.type_name = f".{kind}" if "." in kind else f".{PACKAGE}.{kind}"
    if oneof is not None:
        names = [o.name for o in msg.oneof_decl]
        if oneof not in names:
            msg.oneof_decl.add(name=oneof)
            names.append(oneof)
        field.oneof_index = names.index(oneof)


def _build() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    struct_file = descriptor_pb2.FileDescriptorProto()
    struct_pb2.DESCRIPTOR.CopyToProto(struct_file)
    pool.Add(struct_file)
    proto = descriptor_pb2.FileDescriptorProto(
        name="cache_router/epp/ext_proc.proto", package=PACKAGE, syntax="proto3",
        dependency=[struct_file.name],
    )  # fmt: skip
    enum = proto.enum_type.add(name="BodySendMode")
    for name, number in BODY_SEND_MODE.items():
        enum.value.add(name=name, number=number)
    for name, fields in MESSAGES.items():
        msg = proto.message_type.add(name=name)
        for field in fields:
            _field(msg, *field)
    pool.Add(proto)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        for name in MESSAGES
    }


_CLASSES = _build()
HeaderValue: Any = _CLASSES["HeaderValue"]
HeaderMap: Any = _CLASSES["HeaderMap"]
HeaderValueOption: Any = _CLASSES["HeaderValueOption"]
HttpStatus: Any = _CLASSES["HttpStatus"]
HttpHeaders: Any = _CLASSES["HttpHeaders"]
HttpBody: Any = _CLASSES["HttpBody"]
ProcessingRequest: Any = _CLASSES["ProcessingRequest"]
ProcessingResponse: Any = _CLASSES["ProcessingResponse"]
HeaderMutation: Any = _CLASSES["HeaderMutation"]
CommonResponse: Any = _CLASSES["CommonResponse"]
ImmediateResponse: Any = _CLASSES["ImmediateResponse"]
