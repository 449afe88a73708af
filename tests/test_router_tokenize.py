"""The tokenizer stage: HF tokenizer + chat template like the engine, and the fallback.

The tokenizer is trained in-process on a few sentences (nothing is downloaded).
"""

from __future__ import annotations

import orjson
import pytest
from stack import EngineDouble, Served, until
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from index.hashing import BlockHasher
from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp
from router.http.errors import ApiError
from router.tokens.tokenize import ChatTemplate, FallbackTokenizer, HFTokenizer, TokenizerSet

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a cache aware router sends requests to the engine that holds their prefix",
    "hello there, how are you today? fine thanks, and you?",
]
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A tiny byte-level BPE with a BOS post-processor and a ChatML template."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tok.decoder = decoders.ByteLevel()
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "</s>",
        "chat_template": CHATML,
    }
    (path / "tokenizer_config.json").write_bytes(orjson.dumps(config))
    return path


MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there"},
]


def test_chat_renders_the_template_then_encodes_without_special_tokens(tok_dir):
    tok = HFTokenizer(tok_dir)
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids, text = tok.chat({"messages": MESSAGES})
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert ids[0] == raw.token_to_id("<|im_start|>")  # special tokens stay whole
    ids2, text2 = tok.chat({"messages": MESSAGES, "add_generation_prompt": False})
    assert not text2.endswith("assistant\n") and ids2 == ids[: len(ids2)]


def test_completion_adds_bos_and_token_prompts_pass_through(tok_dir):
    tok = HFTokenizer(tok_dir)
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids, _ = tok.completion("the lazy dog")
    assert (
        ids[0] == raw.token_to_id("<s>")
        and ids[1:] == raw.encode("the lazy dog", add_special_tokens=False).ids
    )
    assert tok.completion([5, 6, 7]) == ([5, 6, 7], None)
    assert tok.completion([[8, 9], [1]]) == ([8, 9], None)  # a batch routes by its first
    assert tok.completion(["the lazy dog", "x"])[0] == ids


def test_template_environment_matches_transformers():
    source = (
        "{%- for m in messages %}\n"
        "  {{ bos_token }}{{ m.role }}: {{ m.content | tojson }}\n"
        "{% endfor %}\n"
        "{% generation %}X{% endgeneration %}"
    )
    t = ChatTemplate(source, {"bos_token": "<s>"})
    out = t.render({"messages": [{"role": "user", "content": 'héllo "q"'}]})
    # trim_blocks + lstrip_blocks; tojson keeps non-ASCII like json.dumps(ensure_ascii=False)
    assert out == '  <s>user: "héllo \\"q\\""\nX'
    strict = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ApiError) as err:
        strict.render({"messages": []})
    assert err.value.status == 400 and "roles must alternate" in err.value.message


def test_render_equals_jinjas_own_with_globals_macros_and_kwargs():
    """``ChatTemplate.render`` builds the context itself (globals merged once): it must
    give what ``Template.render`` gives, globals (namespace, range, strftime_now),
    macros, imports of none, and ``chat_template_kwargs`` included."""
    source = (
        "{% macro turn(m) %}[{{ m.role }}]{{ m.content }}{% endmacro %}"
        "{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ turn(m) }}{% endfor %}"
        "{% for i in range(2) %}{{ i }}{% endfor %}|{{ ns.n }}|{{ eos_token }}|"
        "{{ strftime_now('%Y') | length }}|{{ tools | length if tools else 0 }}|"
        "{{ add_generation_prompt }}|{{ think | default('none') }}"
    )
    t = ChatTemplate(source, {"eos_token": "</s>"})
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    body = {"messages": messages, "tools": [{"type": "function"}],
            "chat_template_kwargs": {"think": True}}  # fmt: skip
    want = t.template.render(
        messages=messages, eos_token="</s>", tools=body["tools"], think=True,
        add_generation_prompt=True,
    )  # fmt: skip
    assert t.render(body) == want == "[user]a[assistant]b01|2|</s>|4|1|True|True"
    # a kwarg that names a variable the router sets is refused, as before
    with pytest.raises(ApiError) as err:
        t.render({"messages": messages, "chat_template_kwargs": {"messages": []}})
    assert err.value.status == 400 and err.value.code == "chat_template_error"


def test_fallback_gives_the_same_hashes_for_the_same_prefix():
    tok = FallbackTokenizer()
    hasher = BlockHasher(4)
    # 96 bytes rendered: whole tokens, so no padding sits inside a block of the prefix
    first = [{"role": "user", "content": "tell me about caches " * 4 + "ok"}]
    second = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    a, text_a = tok.chat({"messages": first, "add_generation_prompt": False})
    b, _ = tok.chat({"messages": second})
    ha, hb = hasher.hash_tokens(a), hasher.hash_tokens(b)
    assert len(ha) == 6 and hb[: len(ha)] == ha
    assert text_a.startswith("<|user|>\ntell me")
    parts = [{"type": "text", "text": "tell me about caches " * 4 + "ok"}]
    c, _ = tok.chat(
        {"messages": [{"role": "user", "content": parts}], "add_generation_prompt": False}
    )
    assert c == a  # text parts render like a plain string
    assert len(tok.encode("abcde", True)) == 8  # padded to whole 4-byte tokens


def test_tokenizer_set_loads_once_per_path(tok_dir):
    paths = {"a": str(tok_dir), "b": str(tok_dir / "tokenizer.json")}
    tokenizers = TokenizerSet(paths.get)
    assert isinstance(tokenizers.get("a"), HFTokenizer)
    assert tokenizers.get("a") is tokenizers.get("a")
    assert tokenizers.get("nope") is tokenizers.fallback


def test_the_default_tokenizer_is_loaded_at_start_not_by_the_first_request(tok_dir):
    """Workers given without a model (their models are learnt from the engines later):
    the ``tokenizer`` every model falls back to is loaded when the router starts, so
    the first request finds it (it used to load there: ~130 ms of a fresh router's
    first request for Llama's tokenizer, inside bench/e2e.py's CPU per request), and
    any model then gets that same one."""
    cfg = RouterConfig(tokenizer=str(tok_dir), workers=[WorkerSpec("w0", "http://127.0.0.1:9")])
    app = RouterApp(cfg)
    tokenizers = app.state.tokenizers
    assert not tokenizers._by_path  # nothing loaded when the app is built
    app.state.warn_fallbacks()  # RouterState.start's step
    loaded = tokenizers._by_path.get(str(tok_dir))
    assert isinstance(loaded, HFTokenizer)
    assert tokenizers.get("learnt-later") is loaded
    assert tokenizers.load(str(tok_dir)) is loaded  # once per path


async def test_router_and_engine_with_the_same_tokenizer_agree_on_blocks(tok_dir, nats_url):
    """The router's hashes of a chat prompt match the blocks the engine reports."""
    tok = HFTokenizer(tok_dir)
    engine = await EngineDouble("w0", nats_url=nats_url, tokenizer=tok).start()
    cfg = RouterConfig(
        nats_url=nats_url,
        block_size=4,
        tokenizer=str(tok_dir),
        admin_token="t",
        offload_chars=16,  # every prompt goes through the thread pool
        workers=[WorkerSpec("w0", engine.url, model="m")],
    )
    app = RouterApp(cfg)
    served = await Served(app).start()
    try:
        import httpx

        async with httpx.AsyncClient(base_url=served.url) as http:
            body = {
                "model": "m",
                "messages": [*MESSAGES, {"role": "user", "content": "the lazy dog"}],
            }
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200
            ingest = app.state.registry.pools["default"].ingest
            await until(lambda: ingest.last_seq("w0") == engine.seq, what="events applied")
            r = await http.post("/admin/explain", json=body, headers={"authorization": "Bearer t"})
            out = r.json()
        ids, _ = tok.chat(body)
        assert out["num_tokens"] == len(ids)
        assert out["workers"][0]["match"]["total"] == len(ids) // 4 > 0
    finally:
        await served.stop()
        await engine.stop()


async def test_a_cached_turn_encodes_its_new_text_on_the_loop_a_cold_one_on_the_pool(tok_dir):
    """Whether a chat goes to the tokenize pool is decided by what is left to encode
    after the conversation prefix cache, not by the body's size: a turn whose earlier
    messages are cached encodes its short new text in place (the hop costs more), a
    cold conversation of the same size still goes to the pool (here shut down, so it is
    refused: the request that would have hopped is seen)."""
    cfg = RouterConfig(
        tokenizer=str(tok_dir),
        offload_chars=4096,
        tokenize_processes=0,
        workers=[WorkerSpec("w0", "http://127.0.0.1:9", model="m")],
    )
    app = RouterApp(cfg)
    router = app.state.router
    long = " ".join(SENTENCES) * 40  # ~6.5K characters: over offload_chars
    first = [{"role": "system", "content": long}, {"role": "user", "content": "hello there"}]

    async def prepare(messages: list[dict[str, str]]) -> int:
        raw = orjson.dumps({"model": "m", "messages": messages})
        prep = await router.prepare(router.parse("chat", raw, {}), len(raw))
        return prep.request.num_tokens

    try:
        assert await prepare(first) == len(HFTokenizer(tok_dir).chat({"messages": first})[0])
        app.state.tokenize_pool.shutdown()  # from here, a hop is refused (503)
        turn = [
            *first,
            {"role": "assistant", "content": "fine"},
            {"role": "user", "content": "ok?"},
        ]
        ids, _ = HFTokenizer(tok_dir).chat({"messages": turn})
        assert await prepare(turn) == len(ids)  # on the loop: its new text is short
        with pytest.raises(ApiError) as refused:
            await prepare([{"role": "system", "content": long + " cold"}, *first[1:]])
        assert refused.value.status == 503
    finally:
        app.state.tokenize_pool.shutdown()


def test_a_continued_final_message_ends_the_prompt_as_vllm_renders_it():
    """``continue_final_message`` (router.forward.migrate sends a broken stream's text so
    far this way): the rendered chat ends with the final message's text, the template's
    end-of-turn marker after it cut, no generation prompt (transformers' rule, vLLM's)."""
    source = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    t = ChatTemplate(source)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cac"}]
    body = {"messages": chat, "continue_final_message": True, "add_generation_prompt": False}
    assert t.render(body) == "<|user|>hi<|end|>\n<|assistant|>the cac"
    trailing = [chat[0], {"role": "assistant", "content": "the cache "}]  # kept as it came
    assert t.render({**body, "messages": trailing}).endswith("<|assistant|>the cache ")
    fallback = FallbackTokenizer().chat_template
    assert fallback.render(body) == "<|user|>\nhi\n<|assistant|>\nthe cac"
    missing = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(ApiError) as err:
        missing.render(body)
    assert err.value.status == 400
