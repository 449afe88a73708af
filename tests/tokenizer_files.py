"""Real tokenizers for the tokenizer tests, shared through conftest.py: Llama's
SentencePiece model (the one PyPI's ``mistral_common`` ships, converted as the
real-engine tests do) and a byte-level BPE, each written with a chat template."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from router.tokens.tokenize import HFTokenizer

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
