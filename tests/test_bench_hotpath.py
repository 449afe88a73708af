"""Smoke test of bench/hotpath.py: it runs (cache-router alone; the peers are optional),
prints one JSON object, every request answered. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "hotpath.py"


def test_quick_run_prints_complete_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = "cache router engine prefix token block hash worker latency 0123456789"
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([words] * 10, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--tokenizer", str(tmp_path / "tokenizer.json"),
         "--peers-python", str(tmp_path / "no-such-python"), "--processes", "1"],
        capture_output=True, text=True, timeout=240, check=False, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    ours = out["cache_router"]
    for key in ("chat_100", "chat_2048", "completion_100", "completion_2048"):
        row = ours["lengths"][key]
        assert row["errors"] == 0 and row["cpu_ms_per_request"] > 0, key
    assert ours["multi_turn"]["errors"] == 0 and ours["multi_turn"]["turns"] >= 3
    assert ours["interference"]["long_prompts_sent"] > 0
    for n in (1, 4, 16):
        assert ours[f"saturation_rps_{n}_workers"] > 0
    assert "sglang_router" not in out
    assert out["tokenizer_alone_cpu_ms"]["100"] > 0
