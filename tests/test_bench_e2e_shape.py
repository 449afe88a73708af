"""bench/hotpath.py's e2e shape: aiperf's chat bodies read from its dataset cache as its
chat endpoint sends them, and the canned engine's vLLM-shaped stream."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import hotpath


def test_aiperf_slice_reads_each_conversation_as_aiperfs_chat_body(tmp_path: Path) -> None:
    def conv(i: int, ts: float, text: str, out: int) -> dict[str, object]:
        turn = {"model": "tiny", "timestamp": ts, "max_tokens": out,
                "texts": [{"name": "text", "contents": [text]}]}  # fmt: skip
        return {"session_id": f"session_{i}", "turns": [turn]}

    rows = [conv(0, 0.0, "<s> first block<s> second", 3), conv(1, 2000.5, "<s> other", 1)]
    (tmp_path / "dataset.dat").write_text("".join(json.dumps(r) for r in rows) + "\n")
    got = hotpath.aiperf_slice(tmp_path)
    assert [g["ts"] for g in got] == [0.0, 2000.5]
    assert got[0]["body"] == {
        "messages": [{"role": "user", "content": "<s> first block<s> second"}],
        "model": "tiny",
        "stream": True,
        "max_completion_tokens": 3,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    assert got[1]["body"]["max_completion_tokens"] == 1


def _events(writes: list[bytes]) -> list[bytes]:
    """The SSE payloads of chunked writes."""
    raw = b"".join(writes)
    out = []
    while True:
        size_end = raw.index(b"\r\n")
        size = int(raw[:size_end], 16)
        if size == 0:
            return out
        data = raw[size_end + 2 : size_end + 2 + size]
        out.append(data.removeprefix(b"data: ").removesuffix(b"\n\n"))
        raw = raw[size_end + 2 + size + 2 :]


def test_the_canned_stream_is_one_write_a_token_with_role_first_and_usage_last() -> None:
    writes = hotpath.stream_events(4, 100)
    assert len(writes) == 4  # the role chunk rides with the first token, as vLLM sends it
    events = _events(writes)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) == 4
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
