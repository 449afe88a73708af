"""Long texts encoded in other processes (router/tokens/pool.py ``EncodeProcesses``) give
exactly the ids the router's own tokenizer gives, through the tokenizer's segments and
the conversation prefix cache, and a lost or stopped process loses no request: the
router encodes the text itself."""

from __future__ import annotations

import os
import signal
from array import array
from collections.abc import Iterator

import pytest
from tokenizer_files import CHATML, _write
from tokenizers import Tokenizer

from index.hashing import BlockHasher, request_block_hashes
from router.tokens.pool import EncodeProcesses
from router.tokens.prefix_cache import PrefixCache
from router.tokens.tokenize import HFTokenizer

TEXTS = [
    "<|im_start|>user\nwhich engine holds 数字 🙂 e\u0301?<|im_end|>\n",
    "  leading spaces\n\n\ttabs ▁ and </s> <s>[INST]" * 50,
    "",
    "a",
]


@pytest.fixture(scope="module")
def procs() -> Iterator[EncodeProcesses]:
    p = EncodeProcesses(1, timeout=60.0, min_chars=0)  # every text goes to the process
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def tok(spm: Tokenizer, tmp_path_factory, procs: EncodeProcesses) -> HFTokenizer:
    return HFTokenizer(_write(tmp_path_factory.mktemp("spm"), spm, CHATML), procs)


def own(tok: HFTokenizer, text: str) -> list[int]:
    ids: list[int] = tok._tok.encode(text, add_special_tokens=False).ids
    return ids


def test_a_process_gives_the_tokenizers_own_ids(tok: HFTokenizer, procs: EncodeProcesses) -> None:
    got = procs.encode(tok.path, TEXTS)
    assert got is not None and procs._pool is not None  # it ran in a process
    assert [a.tolist() for a in got] == [own(tok, t) for t in TEXTS]
    assert any(len(a) > 100 for a in got)


def test_segments_and_the_prefix_cache_through_a_process(tok: HFTokenizer) -> None:
    messages = [{"role": "system", "content": TEXTS[1]}]
    cache, hasher = PrefixCache(1 << 24, min_chars=0), BlockHasher(4)
    for turn in range(3):
        messages.append({"role": "user", "content": f"question {turn} 数字 " * 20})
        rendered = tok.chat_template.render({"messages": messages})
        ids, hashes = cache.finish(cache.lookup(tok, rendered, hasher))
        assert ids.tolist() == own(tok, rendered)
        assert hashes == request_block_hashes(hasher, own(tok, rendered))
        assert tok.encode_segments(rendered) == own(tok, rendered)
        messages.append({"role": "assistant", "content": f"answer {turn}"})
    assert cache.hits == 2


def test_completions_and_special_tokens_chats_through_a_process(tok: HFTokenizer) -> None:
    """A long completions prompt (and a chat with ``add_special_tokens``) is encoded with
    the tokenizer's special tokens in a process too, its ids back packed: built as a
    Python list here they would hold the GIL (~5 ms at 128K tokens)."""
    text = TEXTS[1]
    ids, _ = tok.completion(text)
    assert isinstance(ids, array)  # packed: it came from the process
    assert ids.tolist() == tok._tok.encode(text, add_special_tokens=True).ids
    assert ids.tolist() != own(tok, text)  # with the special tokens (BOS)
    body = {"messages": [{"role": "user", "content": text}], "add_special_tokens": True}
    chat_ids, rendered = tok.chat(body)
    assert isinstance(chat_ids, array)
    assert chat_ids.tolist() == tok._tok.encode(rendered, add_special_tokens=True).ids


def test_a_killed_process_loses_no_request(spm: Tokenizer, tmp_path) -> None:
    procs = EncodeProcesses(1, timeout=60.0, min_chars=0)
    tok = HFTokenizer(_write(tmp_path, spm, CHATML), procs)
    try:
        text = TEXTS[1]
        assert tok.segment_ids([text])[0].tolist() == own(tok, text)
        pool = procs._pool
        assert pool is not None
        for pid in list(pool._processes):  # type: ignore[attr-defined]
            os.kill(pid, signal.SIGKILL)
        tok.segments._lru.clear()  # not from the segment cache: encoded again
        # the request that finds the pool broken is encoded by the router itself ...
        assert tok.segment_ids([text + "!"])[0].tolist() == own(tok, text + "!")
        tok.segments._lru.clear()
        # ... and the next one starts processes again
        assert tok.segment_ids([text + "?"])[0].tolist() == own(tok, text + "?")
        assert procs._pool is not None and procs._pool is not pool
    finally:
        procs.shutdown()
    tok.segments._lru.clear()
    assert procs.encode(tok.path, [text]) is None  # stopped: the router encodes
    assert tok.segment_ids([text])[0].tolist() == own(tok, text)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_an_encode_process_leaves_with_its_killed_router(spm: Tokenizer, tmp_path) -> None:
    """A router killed outright (SIGKILL: no shutdown runs) takes its encode processes
    with it; before, each stayed for ever with its tokenizer loaded."""
    import subprocess
    import sys
    import time

    path = HFTokenizer(_write(tmp_path, spm, CHATML)).path
    script = (
        "import sys, time\n"
        "from router.tokens.pool import EncodeProcesses\n"
        "p = EncodeProcesses(1, timeout=60.0, min_chars=0)\n"
        "assert p.encode(sys.argv[1], ['which engine holds it']) is not None\n"
        "print(*p._pool._processes, flush=True)\n"
        "time.sleep(120)\n"
    )
    router = subprocess.Popen(
        [sys.executable, "-c", script, path], stdout=subprocess.PIPE, text=True
    )
    workers: list[int] = []
    try:
        assert router.stdout is not None
        workers = [int(pid) for pid in router.stdout.readline().split()]
        assert workers and all(_running(pid) for pid in workers)
        router.kill()
        router.wait(10)
        deadline = time.monotonic() + 15
        while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(pid) for pid in workers), "an encode process outlived its router"
    finally:
        router.kill()
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(("preset", "after"), [(None, "false"), ("true", "true")])
def test_a_text_is_encoded_on_one_core_unless_the_user_says_otherwise(
    spm: Tokenizer, tmp_path, monkeypatch: pytest.MonkeyPatch, preset: str | None, after: str
) -> None:
    """Loading the router's tokenizer turns the tokenizer's own workers off (they spin
    after each call, beside the event loop: router/tokens/tokenize.py), for the encode
    processes too, which inherit it; a value the user set stays."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", preset or "")  # restored after the test
    if preset is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    HFTokenizer(_write(tmp_path, spm, CHATML))
    assert os.environ["TOKENIZERS_PARALLELISM"] == after
