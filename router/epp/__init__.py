"""cache-router as the Endpoint Picker (EPP) of a Gateway API inference gateway.

``cache-router serve --epp-port PORT`` adds a gRPC listener speaking Envoy's
``envoy.service.ext_proc.v3.ExternalProcessor`` as the gateway-api-inference-extension's
Endpoint Picker protocol specifies (``router.epp.protocol``): the gateway carries the
bytes, the router only decides, with the proxy's own decision path
(``router.epp.picker``). The HTTP port keeps ``/health``, ``/metrics``, ``/admin`` and
the proxy itself, so one deployment can serve both.

grpcio, grpcio-health-checking and protobuf (the messages are declared in
``router.epp.messages``) are the ``epp`` extra, imported only when an EPP port is
configured.
"""

from __future__ import annotations


def extra_missing() -> str | None:
    """Why the EPP cannot run here (its extra not installed), or None."""
    try:
        import grpc  # noqa: F401
        import grpc_health.v1.health  # noqa: F401
        from google.protobuf import message_factory  # noqa: F401
    except ImportError:
        return "the endpoint picker needs grpcio and protobuf: pip install 'cache-router[epp]'"
    return None
