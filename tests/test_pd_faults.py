"""Disaggregated pools whose engines fail mid-way, end to end: mock prefill and decode
engines (``sim.mock.engine.Fault``) behind node agents on a real NATS, the router in
front, real HTTP (the stack is test_pd_e2e's).

What router/pd/exchange.py promises (its module docstring): a prefill that fails before the decode
engine produced anything is retried on another prefill engine without duplicated decode
work, a refusal (4xx) reaches the client as the engine sent it, retries that run out are
a clear error, and a decode stream cut mid-way ends with an error event.
"""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from stack import MODEL
from test_pd_e2e import PdStack, messages, metrics, pd_stack

from sim.mock.engine import Fault

PREFILLS = ("p0", "p1")
DECODES = ("d0", "d1")


def received(s: PdStack, wids: tuple[str, ...]) -> int:
    """Chat and completion requests the engines ``wids`` received."""
    return sum(s.engines[w].generate_requests for w in wids)


@pytest.mark.parametrize(
    "broken", [{"status": 503}, {"cut_after": 0}], ids=["status_5xx", "cut_mid_answer"]
)
async def test_a_failed_vllm_prefill_is_retried_and_the_decode_engine_gets_one_request(
    nats_url: str, broken: dict[str, int]
) -> None:
    fault = Fault(**broken)
    # round robin sends the first prefill to p0, which fails once
    async with pd_stack(nats_url, "vllm", policy="round_robin") as s:
        s.engines["p0"].fault = fault
        answer = await s.client().chat.completions.create(
            model=MODEL, messages=messages(), max_tokens=6
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 6
        assert s.engines["p0"].generate_requests == s.engines["p1"].generate_requests == 1
        assert s.counts("p1")["prefills"] == 1
        # one decode request, with the retried prefill's transfer params, generated once
        assert received(s, DECODES) == 1
        assert sum(s.engines[d].scheduler.generation_tokens for d in DECODES) == 6
        assert sum(s.counts(d)["transfer_failures"] for d in DECODES) == 0
        text = await metrics(s)
        kind = "prefill_status" if fault.status else "prefill_broken"
        assert 'cache_router_retries_total{worker="p0"} 1.0' in text
        assert f'kind="{kind}",worker="p0"}} 1.0' in text


async def test_vllm_prefill_retries_run_out_into_a_clear_error_and_no_decode(
    nats_url: str,
) -> None:
    # one retry: p0 and p1 fail, and no third attempt goes anywhere
    async with pd_stack(nats_url, "vllm", policy="round_robin", connect_retries=1) as s:
        for p in PREFILLS:
            s.engines[p].fault = Fault(status=500)
        body = {"model": MODEL, "messages": messages(), "max_tokens": 6}
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(s.url + "/v1/chat/completions", json=body)
        assert resp.status_code == 502
        error = resp.json()["error"]
        assert error["code"] == "upstream_error" and error["type"] == "server_error"
        assert "prefill status 500" in error["message"]
        assert received(s, PREFILLS) == 2
        assert received(s, DECODES) == 0


async def test_every_vllm_prefill_engine_failing_leaves_the_prompt_to_the_decode_engine(
    nats_url: str,
) -> None:
    # the default two retries: p0 and p1 fail, and with no prefill engine left the third
    # attempt is the decode engine's own prefill (policies/pd.py: slower, not an error)
    async with pd_stack(nats_url, "vllm", policy="round_robin") as s:
        for p in PREFILLS:
            s.engines[p].fault = Fault(status=500)
        answer = await s.client().chat.completions.create(
            model=MODEL, messages=messages(), max_tokens=6
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 6
        assert received(s, PREFILLS) == 2 and received(s, DECODES) == 1
        assert sum(s.counts(d)["decodes"] for d in DECODES) == 0  # no transfer params
        assert 'cache_router_pd_requests_total{path="local",role="decode"' in await metrics(s)


async def test_a_vllm_prefill_refusal_reaches_the_client_without_retry_or_decode(
    nats_url: str,
) -> None:
    async with pd_stack(nats_url, "vllm", policy="round_robin") as s:
        s.engines["p0"].fault = Fault(status=400)
        body = {"model": MODEL, "messages": messages(), "max_tokens": 6}
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(s.url + "/v1/chat/completions", json=body)
        # the engine's own answer, byte for byte
        assert resp.status_code == 400
        assert resp.headers["content-type"] == "application/json"
        assert resp.json() == orjson.loads(
            b'{"error":{"message":"injected fault: status 400","type":"invalid_request_error",'
            b'"param":null,"code":"invalid_request"}}'
        )
        assert s.engines["p0"].generate_requests == 1
        assert s.engines["p1"].generate_requests == 0 and received(s, DECODES) == 0
        assert "cache_router_retries_total{" not in await metrics(s)


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_a_paired_decode_stream_cut_midway_ends_with_an_error_and_no_second_prefill(
    nats_url: str, protocol: str
) -> None:
    # real engines on both sides: the prefill hands its KV over (SGLang: through the
    # bootstrap room both joined), then the decode engine breaks off after 3 tokens
    async with pd_stack(nats_url, protocol) as s:
        for d in DECODES:
            s.engines[d].fault = Fault(cut_after=3)
        body = {"model": MODEL, "messages": messages(), "max_tokens": 8, "stream": True}
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(s.url + "/v1/chat/completions", json=body)
        assert resp.status_code == 200
        events = [orjson.loads(e.removeprefix(b"data: ")) for e in resp.content.split(b"\n\n") if e]
        tokens = [e for e in events if e.get("choices") and e["choices"][0]["delta"].get("content")]
        assert len(tokens) == 3
        assert events[-1]["error"]["code"] == "upstream_broken"  # the last: no [DONE]
        # the pair really was formed: one prefill, whose blocks the decode engine received
        decoded = [d for d in DECODES if s.counts(d)["decodes"]]
        assert len(decoded) == 1 and s.counts(decoded[0])["blocks_received"] > 0
        assert s.counts(decoded[0])["transfer_failures"] == 0
        assert sum(s.counts(p)["prefills"] for p in PREFILLS) == 1
        # ... and nothing was sent again: the stream had started
        assert received(s, PREFILLS) == 1 and received(s, DECODES) == 1
        assert "cache_router_retries_total{" not in await metrics(s)


async def test_an_sglang_prefill_answer_cut_after_the_pairing_counts_against_its_engine(
    nats_url: str,
) -> None:
    # SGLang: the prefill's answer is read after the decode engine joined the room; when
    # it breaks off there, the client's stream (the decode engine's) goes on, and the
    # prefill engine is charged with a failure as a broken vLLM prefill is
    async with pd_stack(nats_url, "sglang", policy="round_robin") as s:
        for p in PREFILLS:
            s.engines[p].fault = Fault(cut_after=0)
        answer = await s.client().chat.completions.create(
            model=MODEL, messages=messages(), max_tokens=4
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        assert received(s, PREFILLS) == 1 and received(s, DECODES) == 1
        failed = [p for p in PREFILLS if s.engines[p].generate_requests]

        async def charged() -> bool:
            return f'kind="prefill_broken",worker="{failed[0]}"}} 1.0' in await metrics(s)

        for _ in range(100):  # the answer is drained in the background
            if await charged():
                break
            await asyncio.sleep(0.05)
        assert await charged()
        worker = s.state.registry.get(failed[0])
        assert worker is not None and worker.request_failures == 1
