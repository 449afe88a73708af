"""bench/overload.py's and bench/load.py's judgement of a streamed answer
(``stream_complete``, in bench/load.py): what it counts as lost must be lost."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from load import stream_complete  # noqa: E402
from overload import Config, Outcome, Run, _label, _requests_out, _watch_loop  # noqa: E402

from router.http.errors import sse_error  # noqa: E402


def _event(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    body = {"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": [choice]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


def test_a_whole_stream_is_complete_whatever_its_tokens_say() -> None:
    """A random model's token ``error`` is text, not an error event (real vLLM's tiny
    model generated one now and then: a whole answer counted as cut)."""
    body = _event("error") + _event(' "error"') + _event("x", "length") + b"data: [DONE]\n\n"
    assert b'"error"' in body  # what the body search took for an error
    assert stream_complete(body)
    assert stream_complete(body.replace(b"\n", b"\r\n"))


def test_a_cut_stream_or_an_error_event_is_not_complete() -> None:
    whole = _event("a") + _event("b", "length") + b"data: [DONE]\n\n"
    assert not stream_complete(_event("a"))  # no [DONE]
    assert not stream_complete(b"")
    assert not stream_complete(_event("a") + sse_error("the engine broke", "upstream_broken"))
    # an error event, then [DONE] (an engine's own error in the stream)
    assert not stream_complete(
        _event("a") + sse_error("boom", "engine_error") + b"data: [DONE]\n\n"
    )
    assert not stream_complete(whole[: len(whole) // 2])
    assert stream_complete(whole)


def test_the_clients_loop_lag_is_seen() -> None:
    """A loop held 0.2 s (a starved client: every answer measured late) is reported."""

    async def main() -> Run:
        run = Run()
        watch = asyncio.create_task(_watch_loop(run))
        await asyncio.sleep(0.03)
        time.sleep(0.2)  # the loop does not run meanwhile
        await asyncio.sleep(0.03)
        watch.cancel()
        return run

    run = asyncio.run(main())
    assert run.loop_lags >= 1 and run.loop_lag_max >= 0.15


def test_each_configuration_and_load_has_its_own_requests_file(tmp_path: Path) -> None:
    """``--requests-out``: one file per run, named so that a configuration on another
    checkout (``--compare-tree``) does not overwrite the same one on this."""
    configs = [
        Config("least_load", False, 2.0),
        Config("cache_aware", True, 2.0),
        Config("cache_aware", True, 2.0, pool_reserve=True),
        Config("cache_aware", True, 2.0, tree="/tmp/main"),
        Config("cache_aware", True, 0.5),
    ]
    labels = {_label(c, load) for c in configs for load in (0.5, 1.0, 2.0)}
    assert len(labels) == 15
    run = Run([Outcome("steady", 10.25, 200, 0.031, rid="x-steady-0", worker="e1", complete=True)])
    _requests_out(tmp_path, "x", 10.0, run)
    (line,) = (tmp_path / "x.jsonl").read_bytes().splitlines()
    got = orjson.loads(line)
    assert got["at_s"] == 0.25 and got["ttft_s"] == 0.031 and got["worker"] == "e1"
    assert got["rid"] == "x-steady-0" and got["complete"] is True
