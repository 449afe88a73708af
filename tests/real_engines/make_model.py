"""Writes the tiny model the real-engine tests serve, run with the engine venv's python.

- ``tokenizer.json``: the SentencePiece (BPE) model that PyPI's ``mistral_common``
  ships (``data/tokenizer.model.v1``, Llama's 32000 pieces) converted for HF
  ``tokenizers``, the form both vLLM and the router load; checked against
  ``sentencepiece`` itself on sample text;
- ``tokenizer_config.json`` with a chat template, ``config.json``: a 2-layer Llama
  (vLLM serves it with ``--load-format dummy``: random weights, real shapes);
- ``lora/``: a PEFT-format LoRA adapter with random weights (``safetensors``).

``python make_model.py OUT_DIR [SLIDING_WINDOW] [--layers N --hidden H]``. With a
window, the model is hybrid like Gemma 3 or gpt-oss: layer 0 attends over the last
SLIDING_WINDOW tokens only, layer 1 over all (``layer_types``, which vLLM's Llama reads),
so vLLM keeps two KV-cache groups. ``--layers``/``--hidden`` make it bigger, so that an
uncached prefill costs real time (``bench/e2e.py``). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mistral_common
import sentencepiece as spm
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE

SPM = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
HIDDEN = 128
LAYERS = 2
HEADS = 2
KV_HEADS = 1
LORA_RANK = 8
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SAMPLES = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnewlines; ünïcödé, 数字 123 and emoji 🙂",
    "<|user|>\nwhat is a cache-aware router?\n<|assistant|>\n",
]


def convert(model_file: Path) -> Tokenizer:
    """Llama's SentencePiece BPE as a ``tokenizers`` BPE with byte fallback."""
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    # A merge (a, b) exists for every piece a+b whose halves are pieces; SentencePiece
    # applies the highest-scoring (lowest-id) piece first, so merges go in that order.
    merges = []
    for piece, pid in vocab.items():
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                merges.append((pid, vocab[a], vocab[b], a, b))
    merges.sort()
    tok = Tokenizer(
        BPE(
            vocab,
            [(a, b) for *_, a, b in merges],
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    for text in SAMPLES:
        want = sp.encode(text)
        got = tok.encode(text, add_special_tokens=False).ids
        if got != want:
            raise SystemExit(
                f"conversion disagrees with sentencepiece on {text!r}: {got} != {want}"
            )
    return tok


def write(
    out: Path, sliding_window: int | None = None, layers: int = LAYERS, hidden: int = HIDDEN
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = convert(SPM)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 4096,
            }
        )
    )
    hybrid = {}
    if sliding_window is not None:
        hybrid = {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": sliding_window,
        }
    (out / "config.json").write_text(
        json.dumps(
            {
                **hybrid,
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": hidden,
                "intermediate_size": 4 * hidden,
                "num_hidden_layers": layers,
                "num_attention_heads": HEADS,
                "num_key_value_heads": KV_HEADS,
                "head_dim": hidden // HEADS,
                "vocab_size": tok.get_vocab_size(),
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "torch_dtype": "float32",
                "tie_word_embeddings": False,
            }
        )
    )
    write_lora(out / "lora", layers, hidden)


def write_lora(out: Path, layers: int = LAYERS, hidden: int = HIDDEN) -> None:
    """A PEFT LoRA adapter on q_proj/v_proj of every layer, random weights."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    head = hidden // HEADS
    outs = {"q_proj": HEADS * head, "v_proj": KV_HEADS * head}
    for layer in range(layers):
        for name, dim in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(LORA_RANK, hidden, generator=gen) * 0.01
            )
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(dim, LORA_RANK, generator=gen) * 0.01
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": LORA_RANK,
                "lora_alpha": 16,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": list(outs),
                "base_model_name_or_path": None,
                "fan_in_fan_out": False,
                "inference_mode": True,
            }
        )
    )


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="write the tiny model of the real-engine tests")
    cli.add_argument("out", type=Path)
    cli.add_argument("sliding_window", type=int, nargs="?")
    cli.add_argument("--layers", type=int, default=LAYERS)
    cli.add_argument("--hidden", type=int, default=HIDDEN)
    a = cli.parse_args()
    write(a.out, a.sliding_window, a.layers, a.hidden)
