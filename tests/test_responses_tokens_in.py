"""A Responses request sent as token ids (router.forward.responses_out): the answer the
router builds from vLLM's tokens-in answer is vLLM's own Responses answer.

The fixtures (``responses_vllm_032.json``) are one request answered by the real vLLM 0.32
both ways on a warm cache: its ``/inference/v1/generate`` answers (whole, with logprobs,
streamed) and its ``/v1/responses`` answers. The router's shaping of the first must give
the second, but for the clock and the random item ids (and a stream's cut into deltas,
which follows the engine's steps). Through the router, a fake engine plays the tokens-in
answers back. The real-engine step (tests/real_engines/test_vllm_tokens_in.py) asks a
running vLLM the same way, for many requests.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from stack import Served
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.config import RouterConfig, WorkerSpec
from router.forward.responses_out import ResponsesPlan, request_reason
from router.forward.tokens_in import _DEFAULTED, Capability
from router.http.app import RouterApp
from router.routing.responses import prompt_chat, render_reason

CAPTURED = json.loads((Path(__file__).parent / "responses_vllm_032.json").read_text())
BODY = {"model": "tiny", "input": "Say hello.", "instructions": "You are terse.",
        "temperature": 0, "max_output_tokens": 6}  # fmt: skip
IDS: list[int] = CAPTURED["render"]["token_ids"]
SP = CAPTURED["render"]["sampling_params"]
CAP = Capability(
    engine="vllm",
    defaults={k: SP.get(k, d) for k, d in _DEFAULTED.items()},
    stop_token_ids=[],
    max_model_len=1024,
    capped=False,
    served="tiny",
    fingerprint=None,
    details=True,
)
LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}


def plan(**extra: Any) -> ResponsesPlan:
    return ResponsesPlan({**BODY, **extra}, IDS, CAP, "tiny", 32, lambda: None)


def comparable(response: dict[str, Any], with_id: bool = True) -> dict[str, Any]:
    out = {k: v for k, v in response.items() if k != "created_at" and (with_id or k != "id")}
    out["output"] = [{k: v for k, v in item.items() if k != "id"} for item in out["output"]]
    return out


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for event in text.split("\n\n"):
        if event:
            head, data = event.split("\ndata: ", 1)
            out.append((head.removeprefix("event: "), orjson.loads(data)))
    return out


def folded(evs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """A stream as what it says: types in order (a run of deltas as one), the deltas'
    text, every other event without ids and clocks; sequence numbers 0, 1, ..."""
    types: list[str] = []
    text = ""
    others = []
    for n, (kind, data) in enumerate(evs):
        assert data["type"] == kind and data["sequence_number"] == n
        if kind == "response.output_text.delta":
            text += data["delta"]
            if types[-1] == kind:
                continue
        else:
            rest = {k: v for k, v in data.items() if k not in ("sequence_number", "item_id")}
            if "response" in rest:
                rest["response"] = comparable(rest["response"], with_id=False)
            if "item" in rest:
                rest["item"] = {k: v for k, v in rest["item"].items() if k != "id"}
            others.append(rest)
        types.append(kind)
    return {"types": types, "text": text, "events": others}


def stream_of(p: ResponsesPlan, gen_events: list[str]) -> bytes:
    out = p.start()
    for event in gen_events:
        out += p.event(event.removeprefix("data: ").encode())
    return out


def test_the_generate_request_carries_the_responses_sampling() -> None:
    body = plan(seed=5, stop=["x"], top_p=0.5, **LOGPROBS).body
    sp = body["sampling_params"]
    assert body["token_ids"] == IDS and body["output_mode"] == "text"
    assert sp["temperature"] == 0 and sp["top_p"] == 0.5 and sp["seed"] == 5
    assert sp["stop"] == ["x"] and sp["logprobs"] == 2 and sp["max_tokens"] == 6
    assert "stream" not in body
    # no max_output_tokens: the context left, as vLLM's default
    unlimited = plan(max_output_tokens=None).body["sampling_params"]
    assert unlimited["max_tokens"] == 1024 - len(IDS)
    streamed = plan(stream=True).body
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}


def test_a_whole_answer_is_vllms() -> None:
    mine = plan(request_id="resp_probe1").whole(CAPTURED["gen"])
    assert comparable(mine) == comparable(CAPTURED["resp"])
    assert mine["id"] == "resp_probe1" and mine["output"][0]["id"].startswith("msg_")
    assert mine["status"] == "incomplete"
    assert mine["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_whole_answer_with_logprobs_is_vllms() -> None:
    mine = plan(**LOGPROBS).whole(CAPTURED["gen_lp"])
    assert comparable(mine, False) == comparable(CAPTURED["resp_lp"], False)
    assert mine["id"].startswith("resp_") and len(mine["id"]) == 21


def test_a_stream_is_vllms() -> None:
    mine = events(stream_of(plan(stream=True), CAPTURED["gen_stream"]).decode())
    theirs = events("\n\n".join(CAPTURED["resp_stream"]))
    assert folded(mine) == folded(theirs)
    assert [k for k, _ in mine][:2] == ["response.created", "response.in_progress"]
    assert mine[-1][0] == "response.completed"


def test_finished_by_a_stop_and_without_text() -> None:
    """A stop (status completed, no incomplete_details); no text: no content part (whole),
    no output item at all (streamed), as vLLM's two paths do."""
    use = {"prompt_tokens": 33, "completion_tokens": 1,
           "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    gen = {"choices": [{"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}],
           "usage": use}  # fmt: skip
    mine = plan().whole(gen)
    assert mine["status"] == "completed" and mine["incomplete_details"] is None
    assert mine["output"][0]["content"] == []
    assert mine["usage"]["input_tokens_details"]["cache_write_tokens"] == 32
    choice = {"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}
    stream = [orjson.dumps({"choices": [choice]}).decode(),
              orjson.dumps({"choices": [], "usage": use}).decode(), "[DONE]"]  # fmt: skip
    evs = events(stream_of(plan(stream=True), stream).decode())
    kinds = [k for k, _ in evs]
    assert kinds == ["response.created", "response.in_progress", "response.completed"]
    assert evs[-1][1]["response"]["output"] == []


def test_a_stream_without_its_usage_is_broken() -> None:
    p = plan(stream=True)
    p.start()
    with pytest.raises(ValueError):
        p.event(b"[DONE]")


def test_greedy_and_tiny_temperatures_echo_as_the_engine_holds_them() -> None:
    use = CAPTURED["gen"]
    assert plan(temperature=0, top_p=0.3).whole(use)["top_p"] == 1.0
    assert plan(temperature=0.001).whole(use)["temperature"] == 0.01
    answer = plan(temperature=1, top_p=0.3, metadata={"a": "b"}, user="u").whole(use)
    assert answer["temperature"] == 1.0 and answer["top_p"] == 0.3
    assert answer["metadata"] == {"a": "b"} and answer["user"] == "u"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"input": "hi"}, None),
        ({"input": [{"role": "user", "content": "hi"}]}, None),
        ({"input": [{"type": "message", "role": "assistant", "status": "completed",
                     "content": [{"type": "output_text", "text": "x", "annotations": []}]},
                    {"role": "user", "content": [{"type": "input_text", "text": "y"}]}]},
         None),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                 {"type": "input_text", "text": "b"}]}]},
         "field"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "media"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]}, "tools"),
        ({"input": [{"type": "reasoning", "content": []}]}, "reasoning"),
        ({"input": [{"role": "developer", "content": "x"}]}, "field"),
        ({"input": [{"role": "assistant", "content": "x", "status": "incomplete"}]}, "field"),
        ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "field"),
    ],
)  # fmt: skip
def test_only_input_rendered_exactly_goes_as_ids(body: dict[str, Any], reason: str | None) -> None:
    assert render_reason(body) == reason


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({}, None),
        ({"store": False, "stream": True, "metadata": {"a": "b"}, "seed": 3, **LOGPROBS}, None),
        ({"tool_choice": "none", "tools": [], "parallel_tool_calls": False}, None),
        ({"previous_response_id": "resp_x"}, "stored"),
        ({"background": True}, "stored"),
        ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
        ({"tool_choice": "required"}, "tools"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"text": {"format": {"type": "json_object"}}}, "structured_output"),
        ({"include": ["reasoning.encrypted_content"]}, "field"),
        ({"truncation": "auto"}, "field"),
        ({"top_logprobs": 30}, "field"),
        ({"metadata": {"a": 1}}, "field"),
        ({"presence_penalty": 3}, "field"),
        ({"max_output_tokens": 0}, "field"),
        ({"min_tokens": 3}, "field"),  # not a Responses field: vLLM ignores it
        ({"vllm_xargs": {"a": 1}}, "field"),
    ],
)
def test_only_fields_the_router_reproduces_go_as_ids(
    extra: dict[str, Any], reason: str | None
) -> None:
    assert request_reason({**BODY, **extra}) == reason


# -- through the router -------------------------------------------------------------------
class FakeVllm:
    """Plays vLLM's captured tokens-in answers back; counts what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, Any]] = []
        routes = [
            Route("/inference/v1/generate", self.generate, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/models", self.models),
        ]
        self.served = Served(Starlette(routes=routes))

    async def models(self, request: Request) -> Response:
        card = {"id": "tiny", "object": "model", "owned_by": "vllm", "max_model_len": 1024}
        return JSONResponse({"object": "list", "data": [card]})

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.asked.append(("generate", body))
        if not body.get("stream"):
            gen = CAPTURED["gen_lp" if "logprobs" in body["sampling_params"] else "gen"]
            return JSONResponse(gen)

        async def stream() -> AsyncIterator[bytes]:
            for event in CAPTURED["gen_stream"]:
                yield event.encode() + b"\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream; charset=utf-8")

    async def responses(self, request: Request) -> Response:
        self.asked.append(("responses", await request.json()))
        return JSONResponse(CAPTURED["resp"])


@pytest.fixture
async def routed() -> AsyncIterator[tuple[FakeVllm, Served, RouterApp]]:
    engine = FakeVllm()
    await engine.served.start()
    app = RouterApp(RouterConfig(block_size=32, workers=[WorkerSpec("w0", engine.served.url,
                                                                    model="tiny")]))  # fmt: skip
    proxy = app.hot["/v1/responses"]
    assert proxy.tokens_in is not None  # type: ignore[attr-defined]
    # the probe's finding, as a vLLM with --enable-scale-out gives it
    proxy.tokens_in.known["w0"] = (engine.served.url, time.monotonic(), CAP)  # type: ignore[attr-defined]
    router = await Served(app).start()
    try:
        yield engine, router, app
    finally:
        await router.stop()
        await engine.served.stop()


async def test_through_the_router_the_client_gets_vllms_answer(
    routed: tuple[FakeVllm, Served, RouterApp],
) -> None:
    engine, router, _ = routed
    async with httpx.AsyncClient(base_url=router.url, timeout=20) as http:
        r = await http.post("/v1/responses", json={**BODY, "request_id": "resp_probe1"})
        assert r.status_code == 200, r.text
        assert comparable(r.json()) == comparable(CAPTURED["resp"])
        r = await http.post("/v1/responses", json={**BODY, **LOGPROBS})
        assert comparable(r.json(), False) == comparable(CAPTURED["resp_lp"], False)
        r = await http.post("/v1/responses", json={**BODY, "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        theirs = events("\n\n".join(CAPTURED["resp_stream"]))
        assert folded(events(r.text)) == folded(theirs)
        assert [k for k, _ in engine.asked] == ["generate"] * 3
        # what needs the engine's own Responses layer goes to it as it came
        tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
        r = await http.post("/v1/responses", json={**BODY, "tools": [tool]})
        assert r.status_code == 200 and engine.asked[-1] == ("responses", {**BODY, "tools": [tool]})


def test_a_responses_prompt_is_encoded_with_special_tokens_as_vllm_does(hf: Any) -> None:
    """vLLM encodes a rendered Responses input with the tokenizer's special tokens (a
    chat's without): the router's ids are those, and a tokenizer that adds none keeps
    the plain chat body (so the prefix and segment caches still serve it)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = prompt_chat(messages, hf)
    ids, text = hf.chat(chat)
    plain, _ = hf.chat({"messages": messages})
    assert list(ids) == list(hf.encode(text, True))
    adds = len(hf.encode("a", True)) != len(hf.encode("a", False))
    assert chat.get("add_special_tokens", False) is adds
    assert (list(ids) != list(plain)) is adds
