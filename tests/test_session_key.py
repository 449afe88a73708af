"""Session keys derived from the conversation for clients that send none."""

from __future__ import annotations

import orjson

from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp
from router.routing.session_key import PREFIX, derive, opening

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 40}
FIRST = {"role": "user", "content": "Plan a three-day trip to Kyoto."}


def turns(n: int) -> list[list[dict[str, str]]]:
    """The bodies' messages of one chat's first ``n`` turns (each resends the history)."""
    history = [SYSTEM, FIRST]
    out = [list(history)]
    for i in range(1, n):
        history += [
            {"role": "assistant", "content": f"answer {i} " * 30},
            {"role": "user", "content": f"follow-up question {i}"},
        ]
        out.append(list(history))
    return out


def test_every_turn_of_a_chat_has_its_first_turns_key() -> None:
    keys = {derive("m", messages) for messages in turns(4)}
    assert len(keys) == 1
    (key,) = keys
    assert key is not None and key.startswith(PREFIX)


def test_other_openings_models_or_no_user_message_differ() -> None:
    key = derive("m", [SYSTEM, FIRST])
    assert derive("m", [SYSTEM, {"role": "user", "content": "Plan a trip to Osaka."}]) != key
    assert derive("m", [{"role": "system", "content": "terse"}, FIRST]) != key
    assert derive("other", [SYSTEM, FIRST]) != key
    assert derive("m", [FIRST]) != key  # no system prompt: another opening
    assert derive("m", [SYSTEM]) is None
    assert opening([SYSTEM, FIRST, {"role": "user", "content": "x"}]) == [SYSTEM, FIRST]


def _router(derive_session_key: bool = True) -> RouterApp:
    cfg = RouterConfig(
        block_size=16,
        workers=[WorkerSpec(f"w{i}", f"http://127.0.0.1:{9 + i}") for i in range(2)],
        derive_session_key=derive_session_key,
    )
    return RouterApp(cfg)


def test_the_router_keys_requests_by_header_user_or_conversation() -> None:
    router = _router().state.router

    def key(kind: str, body: dict, headers: dict | None = None) -> str | None:
        return router.parse(kind, orjson.dumps(body), headers or {}).session_key  # type: ignore[arg-type]

    chat = {"model": "m", "messages": [SYSTEM, FIRST]}
    derived = key("chat", chat)
    assert derived is not None and derived.startswith(PREFIX)
    assert key("chat", {**chat, "user": "alice"}) == "alice"
    assert key("chat", chat, {"x-session-id": "s1"}) == "s1"
    # Anthropic Messages: ``system`` beside the messages; the same opening, the same key
    messages = {"model": "m", "system": SYSTEM["content"], "messages": [FIRST], "max_tokens": 8}
    assert key("messages", messages) == derived
    responses = {"model": "m", "instructions": SYSTEM["content"], "input": FIRST["content"]}
    assert key("responses", responses) == derived
    assert key("responses", {**responses, "previous_response_id": "resp_1"}) is None
    assert key("completion", {"model": "m", "prompt": "hello"}) is None
    off = _router(derive_session_key=False).state.router
    assert off.parse("chat", orjson.dumps(chat), {}).session_key is None


async def test_a_chat_without_a_key_gets_the_in_flight_credit() -> None:
    """Turn 2 arrives while turn 1 still waits on its worker: ``cache_aware`` counts turn
    1's prompt as held there (the index shows nothing yet), with the derived key or none:
    the credit goes by the prompts' blocks, not their keys (issue 31)."""
    for derive_on in (True, False):
        state = _router(derive_on).state
        router = state.router
        first, second = turns(2)
        decisions = []
        for messages in (first, second):
            raw = orjson.dumps({"model": "m", "messages": messages})
            prep = await router.prepare(router.parse("chat", raw, {}), len(raw))
            decision, _ = router.decide(prep)
            decisions.append((decision, prep.request))
        (d1, r1), (d2, r2) = decisions
        credit = d2.scores[d1.worker_id]["hit_blocks"]
        if derive_on:
            assert r1.session_key == r2.session_key is not None
        else:
            assert r1.session_key is None and r2.session_key is None
        assert credit >= len(r1.block_hashes) - 1 > 0
        assert d2.worker_id == d1.worker_id
