"""Chats encoded by segments (router/tokenize.py ``SegmentCache``) equal full encoding.

A conversation grows turn by turn through one tokenizer, so later turns take their
earlier segments from the cache; every turn's ids must equal ``encode`` of the whole
rendered text. Real chat templates (ChatML, Llama-2's ``[INST]``) on real tokenizers:
Llama's SentencePiece model (the one PyPI's ``mistral_common`` ships, converted as the
real-engine tests do) and a byte-level BPE.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from router.tokenize import HFTokenizer, SegmentCache

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-2-chat's template (system folded into the first user turn), as published.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)


def _write(out: Path, tok: Tokenizer, template: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> Tokenizer:
    pytest.importorskip("mistral_common")  # the dev extra installs it
    pytest.importorskip("sentencepiece")
    sys.path.insert(0, str(Path(__file__).parent / "real_engines"))
    try:
        from make_model import SPM, convert
    finally:
        sys.path.pop(0)
    tok = convert(SPM)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
    )
    return tok


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["a cache aware router", "hello there, how are you?"], trainer)
    return tok


@pytest.fixture(scope="module", params=["spm-chatml", "spm-llama2", "bpe-chatml"])
def hf(request, tmp_path_factory) -> HFTokenizer:
    name = request.param
    tok = request.getfixturevalue("spm" if name.startswith("spm") else "byte_bpe")
    template = LLAMA2 if name.endswith("llama2") else CHATML
    return HFTokenizer(_write(tmp_path_factory.mktemp(name), tok, template))


PIECES = [*"ab cxyz\n\t.,?!'", "数字", "🙂", "ü", "  ", "<s>", "</s>", "[INST]", "<|im_end|>"]
text = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)
turns = st.lists(st.tuples(text, text), min_size=1, max_size=6)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(system=st.none() | text, convo=turns)
def test_every_turn_of_a_growing_chat_equals_full_encoding(
    hf: HFTokenizer, system: str | None, convo: list[tuple[str, str]]
) -> None:
    messages: list[dict[str, str]] = (
        [] if system is None else [{"role": "system", "content": system}]
    )
    for user, assistant in convo:
        messages.append({"role": "user", "content": user})
        for gen in (True, False):
            body = {"messages": messages, "add_generation_prompt": gen}
            ids, rendered = hf.chat(body)
            assert ids == hf._tok.encode(rendered, add_special_tokens=False).ids, rendered
        messages.append({"role": "assistant", "content": assistant})


def test_templates_cut_where_they_write_special_tokens(hf: HFTokenizer) -> None:
    assert hf.cuts, "no cut token: the segment path would never run"
    convo = [{"role": "user", "content": "hello there " * 50}]
    hf.chat({"messages": convo})
    hits = hf.segments.hits
    convo += [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "and?"}]
    hf.chat({"messages": convo})
    assert hf.segments.hits > hits  # the second turn reused the first turn's segments


def test_segment_cache_is_bounded_in_tokens() -> None:
    from array import array

    cache = SegmentCache(max_tokens=10)
    for key in range(5):
        cache.put(key, array("I", range(4)))
    assert cache.tokens <= 10 and cache.get(0) is None and cache.get(4) is not None
    cache.put(99, array("I", range(11)))  # larger than the whole cache: not kept
    assert cache.get(99) is None
