"""Schemathesis against the router's own OpenAPI schema: no 5xx from the router itself.

The router (``cache-router serve``) and a mock engine (``cache-router mock-engine``)
run as real processes; schemathesis reads ``/openapi.json`` (which includes the raw
completion routes) and sends schema-valid and schema-breaking requests to every
operation. A 5xx is allowed only when it is the engine's own answer passed through
(it then carries ``x-cache-router-worker``); anything else is a router bug. Generation
is deterministic and bounded so the run fits the suite's budget.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from sim.demo import wait_healthy
from sim.mock.natsd import free_ports

# slow: their own CI step (`pytest -m slow`), kept out of the main suite's ~10 minutes
pytestmark = pytest.mark.slow

MODEL = "mock-model"
EXAMPLES = 15


@pytest.fixture(scope="module")
def api_schema() -> Iterator[schemathesis.BaseSchema]:
    engine_port, router_port = free_ports(2)
    cli = [sys.executable, "-m", "router.cli"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    engine = subprocess.Popen(
        [*cli, "mock-engine", "--port", str(engine_port), "--model", MODEL, "--speed", "20000",
         "--max-model-len", "4096", "--log-level", "WARNING"],
        **quiet,
    )  # fmt: skip
    # a failing engine must not open the breaker: the router's 503 would hide the cause
    env = {**os.environ, "CACHE_ROUTER_BREAKER_FAILURES": "100000", "CACHE_ROUTER_MAX_N": "8"}
    router = subprocess.Popen(
        [*cli, "serve", "--port", str(router_port), "--worker", f"e0=http://127.0.0.1:{engine_port}",
         "--admin-token", "admin-secret", "--log-level", "warning"],
        env=env,
        **quiet,
    )  # fmt: skip
    try:
        asyncio.run(wait_healthy(f"http://127.0.0.1:{engine_port}", engine))
        url = f"http://127.0.0.1:{router_port}"
        asyncio.run(wait_healthy(url, router))
        # the admin paths are listed for the admin token only; fuzz them too
        auth = {"authorization": "Bearer admin-secret"}
        schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=auth)
        schema.config.update(base_url=url, request_timeout=30)
        # coverage: boundary and schema-breaking values per field; fuzzing: random ones
        schema.config.phases.update(phases=["coverage", "fuzzing"])
        schema.config.generation.update(
            modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
            max_examples=EXAMPLES,
            deterministic=True,
            database="none",
        )
        yield schema
    finally:
        for proc in (router, engine):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_router_answers_no_5xx_of_its_own(case: schemathesis.Case) -> None:
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        body["model"] = MODEL  # reach the engine, not only the unknown-model 404
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > 16:
                body[key] = 16  # long generations only cost time; the router is the same
    response = case.call()
    status = response.status_code
    headers = {k.lower(): v for k, v in response.headers.items()}
    from_engine = "x-cache-router-worker" in headers
    assert status < 500 or from_engine, (status, case.method, case.path, body, response.text)
    if status >= 400 and not from_engine:
        assert "error" in response.json(), response.text  # the router's refusals: OpenAI shape
