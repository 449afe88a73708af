"""``forward_token_ids``: a completions text prompt reaches the engine as the router's
token ids, so the engine does not tokenize it again; off by default, never with the
fallback tokenizer, never for chat or batches.

The mock engine here has no tokenizer (it counts the fallback's one token per 4 UTF-8
bytes), the router a real one: the engine's ``usage.prompt_tokens`` says which it got.
"""

from __future__ import annotations

import httpx
import orjson
import pytest
from stack import Served
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from router.config import RouterConfig, WorkerSpec, load_config
from router.http.app import RouterApp
from router.tokens.tokenize import FallbackTokenizer, HFTokenizer
from sim.mock.engine import MockEngine, MockEngineConfig
from sim.mock.scheduler import Timing

PROMPT = "the cache holds every block of the prompt so the next turn starts there"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>"])
    tok.train_from_iterator([PROMPT] * 3, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    return path


async def _serve(tok_dir, forward: bool, tokenizer: bool = True):
    engine = await MockEngine(
        MockEngineConfig(block_size=4, gpu_blocks=256, timing=Timing(speed=200.0))
    ).start()
    cfg = RouterConfig(
        block_size=4,
        tokenizer=str(tok_dir) if tokenizer else None,
        forward_token_ids=forward,
        workers=[WorkerSpec("w0", engine.url, model="mock-model")],
    )
    app = RouterApp(cfg)
    served = await Served(app).start()
    return engine, app, served


async def _prompt_tokens(url: str, body: dict) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        r = await http.post(body.pop("path", "/v1/completions"), json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("forward", [False, True])
async def test_completions_text_goes_as_ids_only_when_asked(tok_dir, forward):
    hf = HFTokenizer(tok_dir)
    ids, _ = hf.completion(PROMPT)
    fallback = len(FallbackTokenizer().encode(PROMPT, True)) // 4
    assert len(ids) == len(PROMPT.split()) + 1 != fallback  # the BOS is the router's
    engine, _app, served = await _serve(tok_dir, forward)
    try:
        body = {"model": "mock-model", "prompt": PROMPT, "max_tokens": 2}
        got = await _prompt_tokens(served.url, body)
        assert got == (len(ids) if forward else fallback)
        # a prompt already in ids, and a chat, go as they came either way
        ids_body = {"model": "mock-model", "prompt": [5, 6, 7, 8, 9], "max_tokens": 2}
        assert await _prompt_tokens(served.url, ids_body) == 5
        chat = {"model": "mock-model", "messages": [{"role": "user", "content": PROMPT}]}
        chat_ids, _ = FallbackTokenizer().chat(chat)
        got = await _prompt_tokens(served.url, {**chat, "path": "/v1/chat/completions"})
        assert got == len(chat_ids) // 4
    finally:
        await served.stop()
        await engine.stop()


async def test_fallback_tokens_and_batches_are_never_forwarded(tok_dir):
    for tokenizer, prompt in ((False, PROMPT), (True, [PROMPT, PROMPT])):
        engine, app, served = await _serve(tok_dir, True, tokenizer=tokenizer)
        try:
            router = app.state.router
            raw = orjson.dumps({"model": "mock-model", "prompt": prompt})
            prep = await router.prepare(router.parse("completion", raw, {}), len(raw))
            assert prep.prompt_ids is None
            assert prep.engine_body(raw)[0] == raw
        finally:
            await served.stop()
            await engine.stop()


def test_the_setting_is_off_by_default_and_layers():
    assert load_config(env={}).forward_token_ids is False
    assert load_config(env={"CACHE_ROUTER_FORWARD_TOKEN_IDS": "1"}).forward_token_ids is True


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_both_engines_of_a_disaggregated_pair_get_the_ids(tok_dir, protocol):
    """The prefill engine computes, and the decode engine receives, the prompt the router
    hashed: both get its ids (a vLLM pull names the prefill's block hashes of them)."""
    ids, _ = HFTokenizer(tok_dir).completion(PROMPT)
    engines = {}
    for wid, role in (("p0", "prefill"), ("d0", "decode")):
        engines[wid] = await MockEngine(
            MockEngineConfig(
                worker_id=wid,
                block_size=4,
                gpu_blocks=256,
                timing=Timing(speed=200.0),
                role=role,
                bootstrap_timeout=5.0,
            )
        ).start()
    specs = [
        WorkerSpec(w, e.url, model="mock-model", role=e.cfg.role, bootstrap_port=e.port)
        for w, e in engines.items()
    ]
    cfg = RouterConfig(
        block_size=4, tokenizer=str(tok_dir), forward_token_ids=True,
        pd_protocol=protocol, workers=specs,
    )  # fmt: skip
    served = await Served(RouterApp(cfg)).start()
    try:
        body = {"model": "mock-model", "prompt": PROMPT, "max_tokens": 3}
        assert await _prompt_tokens(served.url, body) == len(ids)  # the decode engine's usage
        assert engines["p0"].pd.counts["prefills"] == 1
        assert engines["p0"].scheduler.prompt_tokens == len(ids)
        assert engines["d0"].pd.counts["blocks_received"] == len(ids) // 4
    finally:
        await served.stop()
        for e in engines.values():
            await e.stop()
