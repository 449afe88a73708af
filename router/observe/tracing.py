"""OpenTelemetry spans for the request path and event ingest; nothing at all when off.

One request is a SERVER span (its parent taken from the client's W3C ``traceparent``)
with children ``parse``, ``tokenize``, ``hash``, ``match``, ``decide`` and, per attempt,
a CLIENT span ``upstream`` whose context goes to the engine as ``traceparent`` (vLLM
and SGLang continue the trace), itself with ``upstream connect`` (until the request is
written), ``first byte`` and ``stream end``. An event batch applied to the index is one
``kv.ingest`` span.

The steps are timed with ``time.time_ns()`` and their spans made afterwards with those
times, so a step that runs on the tokenizer pool needs no context carried across
threads, and the hot path holds no span open between steps.

Off (the default), the router holds ``None`` instead of a ``Tracing`` and every hook is
one ``is not None`` test: ``bench/tracing.py`` measures what that costs. On
(``tracing = true``, ``--tracing`` or ``CACHE_ROUTER_TRACING``), the ``tracing`` extra
(opentelemetry-sdk and its OTLP/HTTP exporter) must be installed, and the exporter,
sampler and batch processor read the usual ``OTEL_*`` variables:
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``..._HEADERS``,
``OTEL_TRACES_SAMPLER`` and ``_ARG``, ``OTEL_BSP_*``, ``OTEL_SERVICE_NAME``
(``cache-router`` by default), ``OTEL_RESOURCE_ATTRIBUTES``; ``OTEL_TRACES_EXPORTER``
may be ``otlp`` (the default), ``console`` or ``none``; ``OTEL_SDK_DISABLED=true`` keeps
it off.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from router.config import ConfigError, RouterConfig

now_ns = time.time_ns  # spans take epoch nanoseconds


def extra_missing() -> str | None:
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return "tracing needs opentelemetry-sdk: pip install 'cache-router[tracing]'"
    return None


class Tracing:
    """The router's tracer; ``begin`` starts one request's trace."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("cache-router")
        self.propagator = TraceContextTextMapPropagator()
        self._trace = trace

    @classmethod
    def from_config(cls, cfg: RouterConfig) -> Tracing | None:
        """A tracer exporting as ``OTEL_*`` says, or None when tracing is off."""
        if not cfg.tracing or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return None
        missing = extra_missing()
        if missing is not None:
            raise ConfigError(missing)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

        name = os.environ.get("OTEL_SERVICE_NAME", "cache-router")
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
        if kind == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif kind == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif kind != "none":
            raise ConfigError(f"OTEL_TRACES_EXPORTER={kind!r}: otlp, console or none")
        return cls(provider)

    def begin(
        self, method: str, path: str, headers: Iterable[tuple[bytes, bytes]]
    ) -> Trace | None:
        """The SERVER span of one request, child of the client's ``traceparent`` if any;
        None when the sampler drops it: the request then takes the untraced path, and the
        client's ``traceparent`` (with its sampled flag) goes to the engine as it came."""
        carrier = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in headers
            if k in (b"traceparent", b"tracestate")
        }
        parent = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=self._trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        )
        if not span.is_recording():
            return None
        return Trace(self, span)

    def ingest(self, worker_id: str, seq: int, size: int) -> Any:
        """A span around one event batch applied to the index (a context manager)."""
        return self.tracer.start_as_current_span(
            "kv.ingest",
            attributes={
                "cache_router.worker": worker_id,
                "cache_router.seq": seq,
                "messaging.message.body.size": size,
            },
        )

    def shutdown(self) -> None:
        self.provider.shutdown()


class Trace:
    """One request's spans."""

    __slots__ = ("ctx", "root", "status", "tracing", "upstream")

    def __init__(self, tracing: Tracing, root: Any) -> None:
        self.tracing = tracing
        self.root = root
        self.ctx = tracing._trace.set_span_in_context(root)
        self.status = 0
        self.upstream: Any = None

    def span(self, name: str, start: int, end: int, attrs: Mapping[str, Any] | None = None) -> None:
        """A finished step of the request path, from ``start`` to ``end`` (epoch ns)."""
        span = self.tracing.tracer.start_span(
            name, context=self.ctx, start_time=start, attributes=attrs
        )
        span.end(end_time=end)

    def attrs(self, **values: Any) -> None:
        self.root.set_attributes({f"cache_router.{k}": v for k, v in values.items()})

    def begin_upstream(self, worker_id: str, url: str, path: str) -> bytes:
        """Start an attempt's CLIENT span; its ``traceparent`` header value for the engine."""
        self.end_upstream(None)
        trace = self.tracing._trace
        span = self.tracing.tracer.start_span(
            "upstream",
            context=self.ctx,
            kind=trace.SpanKind.CLIENT,
            attributes={"cache_router.worker": worker_id, "server.address": url, "url.path": path},
        )
        self.upstream = span
        carrier: dict[str, str] = {}
        self.tracing.propagator.inject(carrier, trace.set_span_in_context(span))
        return carrier["traceparent"].encode()

    def upstream_step(self, name: str, start: int, end: int) -> None:
        if self.upstream is not None:
            ctx = self.tracing._trace.set_span_in_context(self.upstream)
            self.tracing.tracer.start_span(name, context=ctx, start_time=start).end(end_time=end)

    def end_upstream(self, error: str | None, status: int = 0) -> None:
        span = self.upstream
        if span is None:
            return
        if status:
            span.set_attribute("http.response.status_code", status)
        if error is not None or status >= 500:
            span.set_status(self.tracing._trace.Status(
                self.tracing._trace.StatusCode.ERROR, error or f"status {status}"
            ))  # fmt: skip
        span.end()
        self.upstream = None

    def end(self, error: str | None = None) -> None:
        """End the request: the status sent to the client, an error if one."""
        self.end_upstream(error)
        if self.status:
            self.root.set_attribute("http.response.status_code", self.status)
        if error is not None or self.status >= 500:
            trace = self.tracing._trace
            self.root.set_status(trace.Status(trace.StatusCode.ERROR, error or str(self.status)))
        self.root.end()
