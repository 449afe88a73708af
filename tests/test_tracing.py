"""OpenTelemetry spans of the request path and event ingest, read from the SDK's
in-memory exporter; the trace context the mock engine receives is the upstream span's."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from stack import MODEL, MockStack, Served, until

from router.config import ConfigError, RouterConfig, WorkerSpec
from router.http.app import RouterApp
from router.observe.tracing import Tracing
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.scheduler import Timing

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
STEPS = ["parse", "tokenize", "hash", "match", "decide"]
UPSTREAM_STEPS = ["upstream connect", "first byte", "stream end"]


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def tracing(exporter: InMemorySpanExporter) -> Tracing:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider)


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


async def test_request_spans_and_the_traceparent_the_engine_sees(exporter):
    engine = await MockEngine(MockEngineConfig(timing=Timing(speed=100.0))).start()
    cfg = RouterConfig(workers=[WorkerSpec("w0", engine.url, model=MODEL)])
    app = RouterApp(cfg, tracing=tracing(exporter))
    served = await Served(app).start()
    try:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            for stream in (False, True):
                exporter.clear()
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 50}],
                        "max_tokens": 5, "stream": stream}  # fmt: skip
                headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
                r = await http.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200
                await until(lambda: by_name(exporter.get_finished_spans(),
                                            "POST /v1/chat/completions"))  # fmt: skip
                spans = exporter.get_finished_spans()
                (root,) = by_name(spans, "POST /v1/chat/completions")
                assert root.kind is SpanKind.SERVER
                # a child of the client's span, in the client's trace
                assert f"{root.context.trace_id:032x}" == CLIENT_TRACE
                assert root.parent is not None and f"{root.parent.span_id:016x}" == CLIENT_SPAN
                assert root.attributes["cache_router.worker"] == "w0"
                assert root.attributes["http.response.status_code"] == 200
                assert root.attributes["cache_router.prompt_tokens"] > 0
                steps = [by_name(spans, n)[0] for n in STEPS]
                for s in steps:
                    assert s.parent.span_id == root.context.span_id
                    assert root.start_time <= s.start_time <= s.end_time <= root.end_time
                # in order: parse, tokenize, hash, match, decide
                assert [s.start_time for s in steps] == sorted(s.start_time for s in steps)
                assert steps[2].attributes["cache_router.blocks"] >= 1
                (up,) = by_name(spans, "upstream")
                assert up.kind is SpanKind.CLIENT and up.parent.span_id == root.context.span_id
                assert up.attributes["http.response.status_code"] == 200
                assert up.status.status_code is not StatusCode.ERROR
                parts = [by_name(spans, n)[0] for n in UPSTREAM_STEPS]
                assert all(p.parent.span_id == up.context.span_id for p in parts)
                assert parts[0].end_time <= parts[1].end_time <= parts[2].end_time
                assert steps[-1].end_time <= up.start_time
                # the engine got the upstream span's context, not the client's
                seen = engine.traceparents[-1]
                assert seen == f"00-{CLIENT_TRACE}-{up.context.span_id:016x}-01"
    finally:
        await served.stop()
        await engine.stop()


async def test_a_traced_request_keeps_the_data_parallel_rank_header(exporter):
    """The traceparent swap must not drop the rank header: each request lands on the rank
    the router named (round robin over the two ranks: both run one; without the header the
    engine puts both on its idle rank 0)."""
    engine = await MockEngine(MockEngineConfig(timing=Timing(speed=100.0), dp_size=2)).start()
    cfg = RouterConfig(
        policy="round_robin",
        workers=[WorkerSpec("w0", engine.url, model=MODEL, dp_size=2, dp_field="header")],
    )
    served = await Served(RouterApp(cfg, tracing=tracing(exporter))).start()
    try:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            for i in range(2):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"q{i} " * 40}],
                        "max_tokens": 2}  # fmt: skip
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        assert len(by_name(exporter.get_finished_spans(), "upstream")) == 2
        assert all(rank.scheduler.prompt_tokens > 0 for rank in engine.ranks)
    finally:
        await served.stop()
        await engine.stop()


async def test_a_failed_attempt_is_its_own_errored_upstream_span(exporter):
    engine = await MockEngine(MockEngineConfig(timing=Timing(speed=100.0))).start()
    dead = await MockEngine(MockEngineConfig()).start()
    dead_url = dead.url
    await dead.stop()  # nothing listens there any more: connect refused
    cfg = RouterConfig(
        policy="round_robin",
        workers=[WorkerSpec("dead", dead_url, model=MODEL), WorkerSpec("w0", engine.url,
                                                                      model=MODEL)],
    )  # fmt: skip
    app = RouterApp(cfg, tracing=tracing(exporter))
    served = await Served(app).start()
    try:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            retried = None
            for _ in range(4):  # round robin: one of two starts on the dead worker
                exporter.clear()
                body = {"model": MODEL, "prompt": "hello " * 20, "max_tokens": 2}
                assert (await http.post("/v1/completions", json=body)).status_code == 200
                await until(lambda: by_name(exporter.get_finished_spans(),
                                            "POST /v1/completions"))  # fmt: skip
                ups = by_name(exporter.get_finished_spans(), "upstream")
                if len(ups) == 2:
                    retried = ups
                    break
            assert retried is not None, "no request met the dead worker"
            failed, ok = sorted(retried, key=lambda s: s.start_time)
            assert failed.attributes["cache_router.worker"] == "dead"
            assert failed.status.status_code is StatusCode.ERROR
            assert ok.attributes["cache_router.worker"] == "w0"
            assert engine.traceparents[-1].split("-")[2] == f"{ok.context.span_id:016x}"
    finally:
        await served.stop()
        await engine.stop()


async def test_event_ingest_spans(exporter, nats_url):
    stack = await MockStack(nats_url).start(1)
    cfg = stack.router_config("r0")
    app = RouterApp(cfg, tracing=tracing(exporter))
    served = await Served(app).start()
    try:
        await until(lambda: app.state.feed.using, what="router on NATS")
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            body = {"model": MODEL, "prompt": "cache me " * 40, "max_tokens": 2}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
        span = await until(lambda: by_name(exporter.get_finished_spans(), "kv.ingest"),
                           what="an ingest span")  # fmt: skip
        assert span[0].attributes["cache_router.worker"] == "m0"
        assert span[0].attributes["messaging.message.body.size"] > 0
        assert span[0].attributes["cache_router.seq_status"]
    finally:
        await served.stop()
        await stack.stop()


async def test_off_by_default_and_the_clients_traceparent_passes_untouched():
    engine = await MockEngine(MockEngineConfig(timing=Timing(speed=100.0))).start()
    app = RouterApp(RouterConfig(workers=[WorkerSpec("w0", engine.url, model=MODEL)]))
    assert app.state.tracing is None
    served = await Served(app).start()
    try:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            tp = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
            r = await http.post("/v1/completions", json=body, headers={"traceparent": tp})
            assert r.status_code == 200
        assert engine.traceparents[-1] == tp
    finally:
        await served.stop()
        await engine.stop()


def test_tracing_config_reads_otel_variables(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    on = Tracing.from_config(RouterConfig(tracing=True))
    assert on is not None
    on.shutdown()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert Tracing.from_config(RouterConfig(tracing=True)) is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaeger-thrift")
    with pytest.raises(ConfigError, match="otlp, console or none"):
        Tracing.from_config(RouterConfig(tracing=True))
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1/v1/traces")
    otlp = Tracing.from_config(RouterConfig(tracing=True))
    assert otlp is not None
    (processor,) = otlp.provider._active_span_processor._span_processors
    assert processor.span_exporter._endpoint == "http://127.0.0.1:1/v1/traces"
    otlp.provider.shutdown = lambda: None  # nothing listens: do not wait on a flush


def test_the_router_runs_without_the_tracing_extra():
    code = (
        "import sys; sys.modules['opentelemetry.sdk'] = None\n"
        "from router.http.app import RouterApp\n"
        "from router.config import ConfigError, RouterConfig\n"
        "RouterApp(RouterConfig())\n"
        "try:\n"
        "    RouterApp(RouterConfig(tracing=True))\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'cache-router[tracing]'" in out.stdout


async def test_a_request_the_sampler_drops_takes_the_untraced_path(exporter):
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    engine = await MockEngine(MockEngineConfig(timing=Timing(speed=100.0))).start()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = RouterApp(RouterConfig(workers=[WorkerSpec("w0", engine.url, model=MODEL)]),
                    tracing=Tracing(provider))  # fmt: skip
    served = await Served(app).start()
    try:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            tp = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
            r = await http.post("/v1/completions", json=body, headers={"traceparent": tp})
            assert r.status_code == 200
        assert engine.traceparents[-1] == tp
        assert exporter.get_finished_spans() == ()
    finally:
        await served.stop()
        await engine.stop()
