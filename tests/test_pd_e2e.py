"""Disaggregated pools end to end: mock prefill and decode engines in both wire protocols
(vLLM KV-connector transfer params, SGLang bootstrap rooms), their KV events over node
agents and NATS, the router in front, the openai client.

Streaming and not, a dead prefill engine (retried on another one, the decode engine
generating once), an unreachable decode engine (another one takes the transfer), a decode
stream cut mid-way (an error event ends it), the local-prefill threshold, and a prefill
sent away from its busy holder with a prefetch hint. Engines that answer and then fail:
test_pd_faults.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import nats
import orjson
import pytest
from stack import BS, MODEL, EngineStack, mock_engine_config, until

from policies.experiments import Arm, Experiment
from router.config import RouterConfig, WorkerSpec
from sim.mock.natsd import free_port
from sim.mock.scheduler import Timing

AUTH = {"authorization": "Bearer t"}
SYSTEM = "You are the assistant of a disaggregated cache-aware router test; be brief. " * 4

pytestmark = pytest.mark.parametrize("protocol", ["vllm", "sglang"])


class PdStack(EngineStack):
    def counts(self, wid: str) -> dict[str, int]:
        return self.engines[wid].pd.counts


@contextlib.asynccontextmanager
async def pd_stack(
    nats_url: str,
    protocol: str,
    *,
    dead: tuple[str, ...] = (),
    extra: list[WorkerSpec] | None = None,
    bootstrap_timeout: float = 30.0,
    prefill: dict[str, Any] | None = None,
    **cfg: Any,
) -> AsyncIterator[PdStack]:
    """Prefill engines p0, p1 and decode engines d0, d1 (those in ``dead`` are ports
    nobody listens on), each mock with a node agent on NATS, and the router.
    ``prefill``: other MockEngineConfig fields of the prefill engines."""
    s = PdStack(nats_url)
    specs: list[WorkerSpec] = []
    try:
        for wid in ("p0", "p1", "d0", "d1"):
            role = "prefill" if wid.startswith("p") else "decode"
            if wid in dead:
                url = f"http://127.0.0.1:{free_port()}"
                specs.append(WorkerSpec(wid, url, model=MODEL, role=role, bootstrap_port=1))
                continue
            fields: dict[str, Any] = {"gpu_blocks": 256, "timing": Timing(speed=50.0)}
            if role == "prefill":
                fields |= prefill or {}
            engine = await s.add(
                mock_engine_config(wid, role=role, bootstrap_timeout=bootstrap_timeout, **fields)
            )
            # the mock's bootstrap server shares its HTTP port
            specs.append(
                WorkerSpec(wid, engine.url, model=MODEL, role=role, bootstrap_port=engine.port)
            )
        await s.serve(
            RouterConfig(
                nats_url=nats_url,
                block_size=BS,
                admin_token="t",
                health_interval=30.0,  # a dead engine is found by the requests, not the checker
                pd_protocol=protocol,  # type: ignore[arg-type]
                workers=specs + (extra or []),
                **cfg,
            )
        )
        yield s
    finally:
        await s.stop()


def messages(turn: str = "what is disaggregation?") -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": turn}]


def decode_holds(s: PdStack, wid: str, tokens: int) -> bool:
    """The router's index (fed by the decode engine's KV events) holds the prompt there."""
    stats = s.state.registry.pools["default"].index.stats()
    return stats.workers.get(wid, {}).get("gpu", 0) * BS >= tokens - BS


async def metrics(s: PdStack) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(s.url + "/metrics")).text


async def test_a_request_is_prefilled_on_one_engine_and_decoded_on_another(
    nats_url: str, protocol: str
) -> None:
    async with pd_stack(nats_url, protocol) as s:
        raw = await s.client().chat.completions.with_raw_response.create(
            model=MODEL, messages=messages(), max_tokens=12
        )
        answer = raw.parse()
        worker = raw.headers["x-cache-router-worker"]
        assert worker in ("d0", "d1")
        assert answer.usage is not None and answer.usage.completion_tokens == 12
        prefills = [w for w in ("p0", "p1") if s.counts(w)["prefills"]]
        assert len(prefills) == 1 and s.counts(worker)["decodes"] == 1
        prompt = answer.usage.prompt_tokens
        # the prefill engine computed the prompt; the decode engine received its blocks
        assert s.engines[prefills[0]].scheduler.prompt_tokens == prompt
        assert s.counts(worker)["blocks_received"] == prompt // BS
        assert s.engines[worker].scheduler.prefix_hits >= prompt // BS * BS
        assert s.engines[worker].scheduler.generation_tokens == 12
        # ... and the decode engine's KV events told the router so
        await until(lambda: decode_holds(s, worker, prompt), what="decode blocks indexed")
        text = await metrics(s)
        remote = f'{{path="remote",role="decode",worker="{worker}"}} 1.0'
        assert "cache_router_pd_requests_total" + remote in text
        assert 'cache_router_pd_phase_seconds_count{phase="prefill_queue"' in text
        # the prefill choice was the prefill-side instance's, with its own parameters
        exp = s.state.experiment
        prefill, mixed = exp.prefill_policy_for("cache_aware"), exp.policy_for("cache_aware")
        assert prefill is not mixed and prefill.place_slack_ms is not None  # type: ignore[attr-defined]
        assert prefill._placed[prefills[0]] > 0  # type: ignore[attr-defined]
        assert prefill._recent and not mixed._recent  # type: ignore[attr-defined]


async def test_streaming_comes_from_the_decode_engine(nats_url: str, protocol: str) -> None:
    async with pd_stack(nats_url, protocol) as s:
        stream = await s.client().chat.completions.create(
            model=MODEL,
            messages=messages("stream it"),
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        assert len(pieces) == 10 and usage is not None and usage.completion_tokens == 10
        decoded = [w for w in ("d0", "d1") if s.counts(w)["decodes"]]
        assert len(decoded) == 1
        assert sum(s.counts(p)["prefills"] for p in ("p0", "p1")) == 1
        text = await metrics(s)
        assert f'cache_router_pd_tpot_seconds_count{{worker="{decoded[0]}"}} 1.0' in text
        assert 'cache_router_pd_phase_seconds_count{phase="transfer"' in text
        # the prefill's own time too: SGLang's answer ends after the transfer, read in the
        # background (its phase was never recorded before session 13)
        for _ in range(50):
            if 'cache_router_pd_phase_seconds_count{phase="prefill"' in text:
                break
            await asyncio.sleep(0.1)
            text = await metrics(s)
        assert 'cache_router_pd_phase_seconds_count{phase="prefill"' in text


async def test_a_dead_prefill_engine_is_retried_and_decode_runs_once(
    nats_url: str, protocol: str
) -> None:
    # round robin sends the first prefill to p0, which nobody listens on
    async with pd_stack(nats_url, protocol, dead=("p0",), policy="round_robin") as s:
        answer = await s.client().chat.completions.create(
            model=MODEL, messages=messages(), max_tokens=6
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 6
        assert s.counts("p1")["prefills"] == 1
        generated = sum(s.engines[d].scheduler.generation_tokens for d in ("d0", "d1"))
        assert generated == 6  # the decode side generated once
        assert 'cache_router_retries_total{worker="p0"} 1.0' in await metrics(s)


async def test_an_unreachable_decode_engine_hands_the_transfer_to_another(
    nats_url: str, protocol: str
) -> None:
    async with pd_stack(nats_url, protocol, dead=("d0",), decode_policy="round_robin") as s:
        for turn in range(2):
            answer = await s.client().completions.create(
                model=MODEL, prompt=SYSTEM + f" turn {turn}", max_tokens=5
            )
            assert answer.usage is not None and answer.usage.completion_tokens == 5
        assert s.counts("d1")["decodes"] == 2
        assert s.engines["d1"].scheduler.generation_tokens == 10
        if protocol == "vllm":  # the transfer params were reused: one prefill per request
            assert sum(s.counts(p)["prefills"] for p in ("p0", "p1")) == 2


async def test_a_decode_stream_cut_midway_ends_with_an_error_event(
    nats_url: str, protocol: str
) -> None:
    cut = await _cut_stream_server()
    host, port = cut.sockets[0].getsockname()[:2]
    # SGLang: the prefill engines wait for a decode engine to join the room, which these
    # "engines" never do: each fails after the bootstrap timeout and is retried
    async with pd_stack(
        nats_url,
        protocol,
        dead=("d0", "d1"),
        extra=[],
        bootstrap_timeout=0.5,
        decode_policy="round_robin",
    ) as s:
        for wid in ("d0", "d1"):  # both decode "engines" answer and then break off
            s.state.registry.get(wid).url = f"http://{host}:{port}"  # type: ignore[union-attr]
        body = {"model": MODEL, "messages": messages(), "max_tokens": 8, "stream": True}
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(s.url + "/v1/chat/completions", json=body)
        assert resp.status_code == 200
        assert b'data: {"partial"' in resp.content
        assert b"upstream_broken" in resp.content and b"[DONE]" not in resp.content
    cut.close()
    await cut.wait_closed()


async def test_a_short_uncached_suffix_is_prefilled_by_the_decode_engine(
    nats_url: str, protocol: str
) -> None:
    async with pd_stack(nats_url, protocol, pd_local_prefill_tokens=64) as s:
        client = s.client()
        first = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages(), max_tokens=4
        )
        decode = first.headers["x-cache-router-worker"]
        prompt = first.parse().usage.prompt_tokens  # type: ignore[union-attr]
        assert prompt > 64
        await until(lambda: decode_holds(s, decode, prompt), what="decode blocks indexed")
        # the same conversation and a few more tokens: under 64 uncached on that engine
        second = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages("what is disaggregation? ok"), max_tokens=4
        )
        assert second.headers["x-cache-router-worker"] == decode
        assert sum(s.counts(p)["prefills"] for p in ("p0", "p1")) == 1  # no second prefill
        assert s.counts(decode)["decodes"] == 1  # the second one came without PD fields
        local = f'{{path="local",role="decode",worker="{decode}"}} 1.0'
        assert "cache_router_pd_requests_total" + local in await metrics(s)


async def test_a_prefill_sent_away_from_the_busy_holder_finds_its_blocks_prefetched(
    nats_url: str, protocol: str
) -> None:
    # Prefill engines running one request at a time, 64 tokens a step (the prefill policy
    # is told that budget), 10 ms a step, with host memory for a prefetch to land in. Their
    # queues are real: requests sent to them directly, which their agents report.
    engine = {"host_blocks": 256, "max_num_seqs": 1, "max_num_batched_tokens": 64}
    costs = {"costs": {"max_batch_tokens": 64}}
    async with pd_stack(
        nats_url, protocol, prefill=engine | {"timing": Timing(speed=2.0)}, prefill_params=costs
    ) as s:
        client = s.client()
        await client.chat.completions.create(model=MODEL, messages=messages(), max_tokens=2)
        holder = next(p for p in ("p0", "p1") if s.counts(p)["prefills"])
        target = "p1" if holder == "p0" else "p0"
        prompt = s.engines[holder].text.chat({"messages": messages()})
        blocks = s.engines[holder].cache.hash_blocks(prompt)  # the holder's names
        index = s.state.registry.pools["default"].index
        await until(
            lambda: index.stats().workers.get(holder, {}).get("gpu", 0) >= len(blocks),
            what="the holder's blocks indexed",
        )
        nc = await nats.connect(nats_url)
        try:
            hints = await nc.subscribe("kv.prefetch.>")
            hits_before = s.engines[target].scheduler.prefix_hits
            # the holder: one long request running (2.5 s: the agents report each second),
            # eight waiting; the target: one running, one waiting (a queue the transfer
            # fits in, the holder's far longer)
            async with httpx.AsyncClient(timeout=30) as http:
                load = [
                    asyncio.create_task(_occupy(http, s.engines[wid].url, i, tokens))
                    for wid, queue in ((holder, 8), (target, 1))
                    for i, tokens in enumerate([250] + [1] * queue)
                ]
                try:
                    registry = s.state.registry
                    await until(
                        lambda: (
                            registry.get(holder).load.engine.waiting == 8
                            and registry.get(target).load.engine.waiting == 1
                        ),
                        what="both queues reported",
                    )
                    answer = await client.chat.completions.create(
                        model=MODEL, messages=messages(), max_tokens=2
                    )
                    assert answer.usage is not None and answer.usage.completion_tokens == 2
                finally:
                    for task in load:
                        task.cancel()
                    await asyncio.gather(*load, return_exceptions=True)
            published = await hints.next_msg(timeout=5)
            assert hints.pending_msgs == 0  # one hint
        finally:
            await nc.close()
        assert s.counts(target)["prefills"] == 1
        # the hint went to the target, naming the holder's blocks of this prompt ...
        assert published.subject == f"kv.prefetch.{target}"
        hint = orjson.loads(published.data)
        assert (hint["source_worker"], hint["target_worker"]) == (holder, target)
        assert hint["block_hashes"] == blocks and hint["num_tokens"] == len(blocks) * BS
        # ... reached the target engine through its agent, landed, and the prefill found
        # them: the hint went out before the prefill, not after its answer
        assert s.engines[target].prefetched_blocks == len(blocks)
        assert s.engines[target].scheduler.prefix_hits - hits_before == len(blocks) * BS
        text = await metrics(s)
        assert (
            f'cache_router_prefetch_hints_total{{arm="cache_aware",worker="{target}"}} 1.0' in text
        )


async def _occupy(http: httpx.AsyncClient, url: str, i: int, tokens: int) -> None:
    """A request of its own (a distinct prompt) sent to an engine directly: ``tokens``
    generated whatever the text says."""
    body = {"model": MODEL, "prompt": f"load {i} {url} " * 4, "max_tokens": tokens}
    await http.post(url + "/v1/completions", json=body | {"ignore_eos": True})


async def test_admin_lists_roles_and_explains_both_choices(nats_url: str, protocol: str) -> None:
    async with pd_stack(nats_url, protocol, pd_local_prefill_tokens=8) as s:
        async with httpx.AsyncClient(headers=AUTH) as client:
            listed = (await client.get(s.url + "/admin/workers")).json()["workers"]
            assert {w["id"]: w["role"] for w in listed} == {
                "p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode",
            }  # fmt: skip
            mixed = {"id": "m0", "url": "http://127.0.0.1:1", "model": MODEL}
            refused = await client.post(s.url + "/admin/workers", json=mixed)
            assert refused.status_code == 400 and "mixes mixed" in refused.text
            added = await client.post(
                s.url + "/admin/workers", json={**mixed, "id": "d2", "role": "decode"}
            )
            assert added.status_code == 201 and added.json()["role"] == "decode"
            await client.delete(s.url + "/admin/workers/d2")
            body = {"model": MODEL, "messages": messages(), "max_tokens": 4}
            explained = (await client.post(s.url + "/admin/explain", json=body)).json()
        pd = explained["pd"]
        assert pd["protocol"] == protocol and pd["local_prefill"] is False
        assert pd["decode"]["worker_id"] in ("d0", "d1") and pd["decode_policy"] == "decode_load"
        assert pd["prefill"]["worker_id"] in ("p0", "p1")
        assert sorted(pd["prefill"]["candidates"]) == ["p0", "p1"]
        assert "ttft_ms" in pd["prefill"]["scores"][pd["prefill"]["worker_id"]]
        assert "tpot_ms" in pd["decode"]["scores"][pd["decode"]["worker_id"]]
        assert explained["decision"]["worker_id"] == pd["decode"]["worker_id"]
        assert sum(s.counts(w)["prefills"] for w in ("p0", "p1")) == 0  # nothing was sent


async def _cut_stream_server() -> asyncio.Server:
    """An 'engine' that starts an SSE answer and breaks the connection off mid-stream."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        chunk = b'data: {"partial": true}\n\n'
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    return await asyncio.start_server(serve, "127.0.0.1", 0, family=socket.AF_INET)


async def test_arms_act_per_side(nats_url: str, protocol: str) -> None:
    # arm "dec" varies the decode side only (round robin there), "pre" the prefill side
    arms = [
        Arm("dec", "cache_aware", decode_policy="round_robin"),
        Arm("pre", "round_robin"),
    ]
    split = Experiment(arms, salt="default")
    session = {a: next(f"s{i}" for i in range(1000) if split.assign(f"s{i}").name == a)
               for a in ("dec", "pre")}  # fmt: skip
    async with pd_stack(nats_url, protocol, arms=arms) as s:
        for arm in ("dec", "pre"):
            before = {d: s.counts(d)["decodes"] for d in ("d0", "d1")}
            for turn in range(2):
                answer = await s.client().chat.completions.create(
                    model=MODEL,
                    messages=messages(f"turn {turn} of {arm}"),
                    max_tokens=4,
                    extra_headers={"x-session-id": session[arm]},
                )
                assert answer.usage is not None and answer.usage.completion_tokens == 4
            if arm == "dec":  # its own round robin: one decode on each engine
                assert all(s.counts(d)["decodes"] == before[d] + 1 for d in ("d0", "d1"))
        async with httpx.AsyncClient(headers=AUTH) as client:
            body = {"model": MODEL, "messages": messages(), "max_tokens": 4}
            explained = {
                arm: (
                    await client.post(
                        s.url + "/admin/explain", json=body, headers={"x-session-id": sid}
                    )
                ).json()["pd"]
                for arm, sid in session.items()
            }
            listed = (await client.get(s.url + "/admin/experiments")).json()["arms"]
        text = await metrics(s)
    assert explained["dec"]["arm"] == "dec" and explained["dec"]["decode_policy"] == "round_robin"
    assert explained["dec"]["prefill_policy"] == "cache_aware"
    assert explained["pre"]["decode_policy"] == "decode_load"  # the router's own
    assert explained["pre"]["prefill_policy"] == "round_robin"
    assert [(a["name"], a["decode_policy"]) for a in listed] == [
        ("dec", "round_robin"), ("pre", None),
    ]  # fmt: skip
    for labels in (
        'arm="dec",decode_policy="round_robin",path="remote",prefill_policy="cache_aware"',
        'arm="pre",decode_policy="decode_load",path="remote",prefill_policy="round_robin"',
    ):
        assert f"cache_router_pd_arm_requests_total{{{labels}}} 2.0" in text
