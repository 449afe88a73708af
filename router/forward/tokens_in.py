"""A chat tokenized once: the router's token ids go to the engine, not the chat again.

The router tokenizes every chat to match its blocks (``router.tokens``, the chat template
rendered as the engine renders it); forwarding the chat body made the engine render and
tokenize the whole conversation a second time. Where the engine serves a tokens-in
endpoint, a chat goes there as the router's ids, and the client gets the chat answer the
engine's own chat layer would have given, field for field:

- vLLM (0.32, started with ``--enable-scale-out``): ``POST /inference/v1/generate`` with
  ``output_mode: "text"`` (the engine still detokenizes, applies stop strings and decodes
  logprobs). Its answer carries the text, ``finish_reason``, ``stop_reason``, logprobs in
  the chat shape, and ``usage`` with ``cached_tokens``; the router adds what only the chat
  layer knows: the ``chatcmpl-`` id (the same request id), the role chunk, the model name,
  ``system_fingerprint``, ``created_cache_tokens`` (vLLM's count: the prompt's whole blocks
  less its cached tokens) and the chat's null fields.
- SGLang (since its "TITO" change of April 2026, sgl-project/sglang#23751): the chat body
  itself, to ``POST /v1/chat/completions``, with the router's ids as ``input_ids``. Its chat
  layer then skips rendering and tokenizing (``serving_chat.py``: "When input_ids are
  provided, skip template tokenization entirely") and answers as it always does: every
  field, stream event, parser and error is the engine's own, so nothing is translated.
  (SGLang's ``/generate`` also takes ``input_ids``, but answers in its own shape: text, a
  ``meta_info`` of its own and cumulative text in each streamed event; rebuilding its chat
  layer's answer from it would copy that layer into the router, version by version.)

Responses requests (``/v1/responses``), to vLLM only, go as ids too when the router's
rendering of their input is exactly vLLM's (``router.routing.responses.render_reason``;
vLLM encodes it with the tokenizer's special tokens, as the router hashes it) and their
fields are ones the router reproduces (``router.forward.responses_out.request_reason``);
their answer is shaped as vLLM's Responses layer shapes it (``responses_out``). The
probe (``probe_responses``): ``/v1/responses/render`` gives exactly the router's ids for
an input of every shape let through, no reasoning parser, and a one-token request asked
of ``/v1/responses`` and of the generate endpoint (each with a cache salt of its own)
answers alike once shaped; it also learns, without making a response, whether the
engine keeps responses (``VLLM_ENABLE_RESPONSES_API_STORE``): then one with ``store``
not false goes as it came (``stored``), as do ``previous_response_id`` and
``background``. The Messages API
(``/v1/messages``) is not sent as ids: the router renders it as a chat only approximately.

The router pays for the ids as JSON: ~36 ns a token (0.14 ms at 4K tokens, orjson of a
list); vLLM's front end saves ~5 ms a turn at 1-3K tokens (``bench/tokens_in.py``,
BENCHMARKS.md).

Which engines: each worker is probed once (and again every ``PROBE_EVERY`` seconds) by
``probe``; its ``/v1/models`` names the engine (``owned_by``: ``vllm`` or ``sglang``).
vLLM: its chat rendered by the engine (``POST /v1/chat/completions/render``, which
vLLM serves with ``--enable-scale-out``) must give exactly the router's ids, the engine
must have no reasoning parser (the render says so), and one token asked both ways (chat
and generate) must answer alike; the render also gives the engine's defaults for the
sampling fields a client leaves out (its generation config), which the chat layer applies
and the generate endpoint does not. SGLang (no render endpoint): a one-token chat asked
with ``return_prompt_token_ids`` must echo exactly the router's ids (its own rendering of
a probe conversation of four turns), and a second one sent with another chat's ids as
``input_ids`` must echo those and count them as its ``prompt_tokens`` (an SGLang from
before the change ignores the field and renders the messages). Until a worker's probe
succeeds its chats go as today. ``chat_tokens_in = false`` turns it off.

Which requests go as today (``cache_router_tokens_in{outcome}`` counts each reason):

- ``tools``: ``tools``, ``tool_choice``, ``functions``, ``function_call``,
  ``parallel_tool_calls`` (the engine's tool parser reads the output);
- ``structured_output``: ``response_format`` other than text, ``structured_outputs``,
  ``guided_*`` (the grammar is the chat layer's);
- ``reasoning``: ``reasoning_effort``, ``include_reasoning``, ``thinking_token_budget``,
  or a vLLM with a reasoning parser (``engine``; SGLang's chat layer still parses);
- ``media``: image, audio or video parts (the engine places them);
- ``n``: ``n`` over 1; ``echo``: ``echo``;
- ``stream_options``: anything but ``include_usage`` (``continuous_usage_stats``);
- ``field``: any other field this module does not reproduce (``prompt_logprobs``,
  ``return_token_ids``, ``logprob_token_ids``, ``vllm_xargs``, ``truncate_prompt_tokens``,
  ``documents``, ``chat_template``, ``kv_transfer_params``, ...);
- to SGLang, whose chat layer still does them with ids, ``structured_output``, ``n``,
  ``echo`` and ``stream_options`` go as ids too;
- ``field`` on SGLang also: what its chat layer renders otherwise than the router's
  tokenizer (``sglang_reason``): a last message from the assistant (SGLang makes it a user
  message unless ``continue_final_message``, which it renders its own way),
  ``add_generation_prompt: false`` (SGLang always adds it), ``add_special_tokens`` (SGLang
  ignores it), a ``tool`` message given as content parts (SGLang joins them with spaces);
- ``context`` (vLLM): a prompt at the model's length, or an explicit ``max_tokens`` on an engine
  whose generation config caps it (``max_tokens``): the chat layer's own answer;
- ``engine``: the worker is not (yet) known to take tokens in; ``probing``: its probe
  is under way; ``disaggregated``, ``gateway``: prefill/decode pools and region gateways;
- ``stored`` (Responses): a response the engine's store must see (above).

An engine's error status is passed on as it came (the generate endpoint answers invalid
sampling fields with the chat endpoint's error body). An answer the router cannot read
becomes a 502 (whole) or an ``upstream_broken`` error event (streamed), like an engine
that broke.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from router.forward.responses_out import ResponsesPlan, random_hex
from router.forward.responses_out import request_reason as responses_field_reason
from router.forward.upstream import Response, UpstreamError
from router.http.errors import error_body
from router.routing.responses import as_messages, prompt_chat, render_reason
from router.tokens.media import as_ints
from router.tokens.tokenize import has_media

if TYPE_CHECKING:
    from router.forward.relay import ProxyDeps
    from router.routing.decide import Prepared
    from router.workers.registry import Worker

log = logging.getLogger(__name__)

GENERATE = "/inference/v1/generate"
RENDER = "/v1/chat/completions/render"
PROBE_EVERY = 300.0  # s: an engine restarted with other flags is seen again within this
PROBE_RETRY = 10.0  # s: a probe that failed (no answer, an odd one) is tried again after
PROBE_TIMEOUT = 30.0  # s per probe request (a cold CPU engine's first prefill is slow)
PROBE_MESSAGES = [
    {"role": "system", "content": "You are a probe."},
    {"role": "user", "content": "Say one word."},
]
# SGLang: a conversation (its chat layer renders each message from its own model of it, so
# an earlier assistant turn is checked too), and a chat whose ids, sent as input_ids with
# it, show they are used
PROBE_TURNS = [
    *PROBE_MESSAGES,
    {"role": "assistant", "content": "Cache."},
    {"role": "user", "content": "Another one."},
]
PROBE_OTHER = [{"role": "user", "content": "Name a colour, then a number."}]
CHAT = "/v1/chat/completions"
ANSWER_LIMIT = 64 << 20  # bytes of a whole generate answer read to be translated

# the chat fields taken over as sampling parameters, unchanged
_SAMPLING = (
    "seed", "stop", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "logit_bias",
    "allowed_token_ids", "bad_words",
)  # fmt: skip
# the sampling fields whose default is the engine's (its generation config), else these
_DEFAULTED = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}
# fields that need nothing from the chat layer here (read by the router, or below)
_TAKEN = frozenset(
    (
        "model", "messages", "stream", "stream_options", "user", "n", "max_tokens",
        "max_completion_tokens", "stop_token_ids", "logprobs", "top_logprobs",
        "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
        "add_special_tokens", "cache_salt", "priority", "request_id", "response_format",
        *_SAMPLING, *_DEFAULTED,
    )
)  # fmt: skip
_REASON_OF = {
    "tools": "tools", "tool_choice": "tools", "functions": "tools",
    "function_call": "tools", "parallel_tool_calls": "tools",
    "structured_outputs": "structured_output", "guided_json": "structured_output",
    "guided_regex": "structured_output", "guided_choice": "structured_output",
    "guided_grammar": "structured_output", "guided_decoding_backend": "structured_output",
    "guided_whitespace_pattern": "structured_output",
    "reasoning_effort": "reasoning", "include_reasoning": "reasoning",
    "thinking_token_budget": "reasoning", "echo": "echo",
}  # fmt: skip
OUTCOMES = (
    "sent", "tools", "structured_output", "reasoning", "media", "n", "echo",
    "stream_options", "field", "context", "max_tokens", "engine", "probing",
    "disaggregated", "gateway", "stored",
)  # fmt: skip
RESPONSES_RENDER = "/v1/responses/render"
RESPONSES = "/v1/responses"
# every input shape router.routing.responses.render_reason lets through, rendered by the
# engine and by the router alike
PROBE_RESPONSE = {
    "instructions": "You are a probe.",
    "input": [
        {"role": "user", "content": "Say one word."},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Cache."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Another one."}]},
    ],
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Capability:
    """What a worker's probe learnt: it takes tokens in, and what its chat layer adds
    (vLLM; an SGLang engine's chat layer answers itself, so only ``engine`` matters)."""

    engine: str  # "vllm" (/inference/v1/generate) or "sglang" (input_ids in the chat)
    defaults: dict[str, Any]  # the _DEFAULTED fields as the engine's chat layer fills them
    stop_token_ids: list[int]  # the engine's own, merged with a request's
    max_model_len: int
    capped: bool  # the generation config caps max_tokens (an explicit one goes as today)
    served: str  # the model name the chat layer answers with for the base model
    fingerprint: str | None  # the chat answer's system_fingerprint
    details: bool  # usage has prompt_tokens_details (vLLM --enable-prompt-tokens-details)
    stores: bool = False  # Responses: the engine keeps responses (a store=true one goes as today)


# what SGLang's chat layer still does to a chat sent with input_ids (it renders nothing of
# them, or ignores them: vLLM's names)
_CHAT_LAYER = frozenset(("structured_output", "n", "echo", "stream_options"))


def request_reason(body: Mapping[str, Any], sglang: bool = False) -> str | None:
    """Why this chat body needs the engine's chat layer (None: it can go as ids; to SGLang,
    ``sglang``, which keeps its chat layer: the reasons left)."""
    for key, value in body.items():
        if key in _TAKEN:
            continue
        if value is None or value is False or value == []:
            continue  # an absent feature, spelt out
        reason = _REASON_OF.get(key, "field")
        if not (sglang and reason in _CHAT_LAYER):
            return reason
    if sglang:
        return "media" if has_media(body) else None
    n = body.get("n")
    if n is not None and n != 1:
        return "n"
    fmt = body.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
        return "structured_output"
    options = body.get("stream_options")
    if isinstance(options, Mapping) and any(k != "include_usage" for k in options):
        return "stream_options"
    if has_media(body):
        return "media"
    return None


def sglang_reason(body: Mapping[str, Any]) -> str | None:
    """Why SGLang's chat layer would render this chat to other ids than the router's
    tokenizer does (None: the same ids; ``serving_chat.py``'s ``_apply_jinja_template``)."""
    if body.get("continue_final_message") or body.get("add_generation_prompt") is False:
        return "field"  # SGLang continues its own way; it always adds the generation prompt
    if body.get("add_special_tokens") is not None:
        return "field"  # not a field of SGLang's chat request: it would be ignored there
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "field"
    last = messages[-1]
    if isinstance(last, Mapping) and last.get("role") == "assistant":
        return "field"  # SGLang renders a last assistant message as the user's
    for m in messages:
        if (
            isinstance(m, Mapping)
            and m.get("role") == "tool"
            and isinstance(m.get("content"), list)
        ):
            return "field"  # SGLang joins a tool message's text parts with spaces
    return None


class TokensIn:
    """Per chat (or Responses) proxy: which workers take tokens in, and each request's
    plan."""

    def __init__(self, deps: ProxyDeps, kind: str = "chat") -> None:
        self.deps = deps
        self.kind = kind
        # worker id -> (its url, when probed, what was learnt; None: no tokens-in)
        self.known: dict[str, tuple[str, float, Capability | None]] = {}
        self._probes: dict[str, asyncio.Task[None]] = {}
        self.counts = {o: deps.metrics.tokens_in.labels(o) for o in OUTCOMES}

    def plan(self, prep: Prepared, worker: Worker) -> Plan | WithIds | Shaped | None:
        """The tokens-in request for ``prep`` on ``worker``, or None (counted: why not)."""
        reason, cap = self._check(prep, worker)
        self.counts[reason].inc()
        if cap is None:
            return None
        if cap.engine == "sglang":
            return WithIds(prep)
        lora = self.deps.registry.lora_name(prep.parsed.model) is not None
        gone = lambda: self.known.pop(worker.id, None)  # noqa: E731
        if self.kind == "responses":
            return Shaped(ResponsesPlan.of(prep, cap, lora, gone))
        return Plan(prep, cap, lora, gone)

    def _check(self, prep: Prepared, worker: Worker) -> tuple[str, Capability | None]:
        st = self.deps
        if st.cfg.gateway:
            return "gateway", None
        if st.pd is not None and st.pd.disaggregated(prep):
            return "disaggregated", None
        if self.kind == "responses":
            return self._check_responses(prep, worker)
        body = prep.parsed.body
        reason = request_reason(body)
        if reason is not None:  # what no engine takes as ids
            loose = request_reason(body, sglang=True) if reason in _CHAT_LAYER else reason
            if loose is not None:
                return loose, None
        why, cap = self._engine(prep, worker)
        if cap is None:
            return why, None
        if cap.engine == "sglang":
            reason = sglang_reason(body)
            return ("sent", cap) if reason is None else (reason, None)
        if reason is not None:  # what only SGLang's chat layer does with ids
            return reason, None
        if prep.request.num_tokens >= cap.max_model_len:
            return "context", None
        if cap.capped and _max_tokens(body) is not None:
            return "max_tokens", None
        return "sent", cap

    def _engine(self, prep: Prepared, worker: Worker) -> tuple[str, Capability | None]:
        """What the last probe of ``worker`` learnt (a new one started when it is old),
        or why the request cannot go as ids whatever it learnt: no ids (``field``), the
        first probe under way (``probing``), no tokens-in endpoint found (``engine``)."""
        if prep.ids is None:
            return "field", None
        seen = self.known.get(worker.id)
        if seen is None or seen[0] != worker.url or time.monotonic() - seen[1] > PROBE_EVERY:
            model = prep.parsed.model  # probed as its base model (the chat layer's name)
            self._start_probe(worker, self.deps.registry.adapters.get(model, model))
            if seen is None or seen[0] != worker.url:
                return "probing", None
        cap = seen[2]
        return ("sent", cap) if cap is not None else ("engine", None)

    def _check_responses(self, prep: Prepared, worker: Worker) -> tuple[str, Capability | None]:
        """A Responses request: its input rendered exactly, its fields reproduced, the
        engine a vLLM whose Responses answer the probe matched, no store to keep it in."""
        body = prep.parsed.body
        reason = render_reason(body) or responses_field_reason(body)
        if reason is not None:
            return reason, None
        why, cap = self._engine(prep, worker)
        if cap is None:
            return why, None
        if cap.stores and body.get("store", True):
            return "stored", None  # the engine keeps it for a previous_response_id
        limit = body.get("max_output_tokens")
        if prep.request.num_tokens + (limit if isinstance(limit, int) else 0) > cap.max_model_len:
            return "context", None
        if prep.request.num_tokens >= cap.max_model_len:
            return "context", None
        if cap.capped:
            return "max_tokens", None
        return "sent", cap

    def _start_probe(self, worker: Worker, model: str) -> None:
        running = self._probes.get(worker.id)
        if running is not None and not running.done():
            return
        task = asyncio.get_running_loop().create_task(self._probe(worker, model))
        self._probes[worker.id] = task

    async def _probe(self, worker: Worker, model: str) -> None:
        when = time.monotonic()
        try:
            ask = probe if self.kind == "chat" else probe_responses
            cap = await ask(self.deps, worker.url, model)
        except (UpstreamError, OSError, ValueError, KeyError, TypeError) as exc:
            log.info("tokens-in probe of %s failed: %s", worker.id, exc)
            cap = None
            when -= PROBE_EVERY - PROBE_RETRY  # unreachable or odd: asked again sooner
        if cap is None:
            log.info("worker %s: %s requests go as they came (no tokens-in)", worker.id,
                     self.kind)  # fmt: skip
        self.known[worker.id] = (worker.url, when, cap)


async def _call(
    deps: ProxyDeps, url: str, path: str, body: dict[str, Any] | None
) -> tuple[int, Any]:
    headers = [(b"content-type", b"application/json")]
    raw = b"" if body is None else orjson.dumps(body)
    method = b"GET" if body is None else b"POST"
    resp = await deps.upstream.send(url, path, headers, raw, PROBE_TIMEOUT, method)
    try:
        data = await resp.read(PROBE_TIMEOUT, 1 << 20, path)
    finally:
        resp.close()
    if resp.status != 200:
        return resp.status, None
    return resp.status, orjson.loads(data)


async def probe(deps: ProxyDeps, url: str, model: str) -> Capability | None:
    """What the engine at ``url`` adds to a chat, if it takes the router's ids and answers
    them as its chat endpoint does (None: it does not, or not identically)."""
    status, models = await _call(deps, url, "/v1/models", None)
    if status != 200:
        return None
    cards = [m for m in models["data"] if isinstance(m, dict)]
    card = next((m for m in cards if m.get("id") == model), cards[0] if cards else {})
    if card.get("owned_by") == "sglang":
        return await _probe_sglang(deps, url, model)
    chat = {"model": model, "messages": PROBE_MESSAGES}
    ids = _ids(deps, chat)
    status, rendered = await _call(deps, url, RENDER, chat)
    if status != 200 or not isinstance(rendered, dict):
        return None
    if rendered.get("token_ids") != ids:
        log.warning("engine %s renders chats to other ids than the router's tokenizer", url)
        return None
    if rendered.get("reasoning_parser_kwargs") is not None:
        return None  # a reasoning parser splits the chat answer; generate does not
    sp = rendered["sampling_params"]
    max_len = next(
        (m["max_model_len"] for m in cards if isinstance(m.get("max_model_len"), int)), None
    )
    if max_len is None:
        return None
    one = {"max_tokens": 1, "temperature": 0.0}
    status, answer = await _call(deps, url, "/v1/chat/completions", {**chat, **one})
    if status != 200:
        return None
    gen = {"model": model, "token_ids": ids, "sampling_params": one, "output_mode": "text"}
    status, generated = await _call(deps, url, GENERATE, gen)
    if status != 200:
        return None
    use = answer["usage"]
    if (
        generated["choices"][0]["text"] != answer["choices"][0]["message"]["content"]
        or generated["usage"]["prompt_tokens"] != use["prompt_tokens"]
    ):
        log.warning("engine %s answers generate and chat differently", url)
        return None
    return Capability(
        engine="vllm",
        defaults={k: sp.get(k, d) for k, d in _DEFAULTED.items()},
        stop_token_ids=list(sp.get("stop_token_ids") or []),
        max_model_len=max_len,
        capped=sp.get("max_tokens", max_len - len(ids)) < max_len - len(ids),
        served=answer["model"],
        fingerprint=answer.get("system_fingerprint"),
        details=use.get("prompt_tokens_details") is not None,
    )


def _ids(deps: ProxyDeps, chat: Mapping[str, Any]) -> list[int]:
    return as_ints(deps.router.tokenizers.get(chat["model"]).chat(chat)[0])


async def _probe_sglang(deps: ProxyDeps, url: str, model: str) -> Capability | None:
    """An SGLang engine takes the router's ids if its own rendering of the probe
    conversation is exactly them and it runs ``input_ids`` given beside the messages (none
    of its versions before the change that reads that field do)."""
    chat = {"model": model, "messages": PROBE_TURNS}
    ids = _ids(deps, chat)
    one = {"max_tokens": 1, "temperature": 0.0, "return_prompt_token_ids": True}
    status, answer = await _call(deps, url, CHAT, {**chat, **one})
    if status != 200 or answer["choices"][0].get("prompt_token_ids") != ids:
        if status == 200:
            log.warning("engine %s renders chats to other ids than the router's tokenizer "
                        "(or does not echo them)", url)  # fmt: skip
        return None
    other = _ids(deps, {"model": model, "messages": PROBE_OTHER})
    status, echoed = await _call(deps, url, CHAT, {**chat, **one, "input_ids": other})
    if (
        status != 200
        or echoed["choices"][0].get("prompt_token_ids") != other
        or echoed["usage"]["prompt_tokens"] != len(other)
    ):
        log.info("engine %s does not take input_ids in its chat requests", url)
        return None
    return Capability(
        engine="sglang",
        defaults={},
        stop_token_ids=[],
        max_model_len=0,
        capped=False,
        served=answer["model"],
        fingerprint=None,
        details=False,
    )


async def probe_responses(deps: ProxyDeps, url: str, model: str) -> Capability | None:
    """What the engine at ``url`` adds to a Responses request, if its Responses layer
    renders the probe's input (every shape ``render_reason`` lets through) to exactly the
    router's ids and answers a one-token request field for field as
    ``router.forward.responses_out`` builds it from the tokens-in answer (None: it does
    not). Also whether it keeps responses (``VLLM_ENABLE_RESPONSES_API_STORE``)."""
    status, models = await _call(deps, url, "/v1/models", None)
    if status != 200:
        return None
    cards = [m for m in models["data"] if isinstance(m, dict)]
    card = next((m for m in cards if m.get("id") == model), cards[0] if cards else {})
    max_len = card.get("max_model_len")
    if card.get("owned_by") != "vllm" or not isinstance(max_len, int):
        return None  # SGLang's Responses layer is not translated (it goes as it came)
    body = {"model": model, **PROBE_RESPONSE}
    tok = deps.router.tokenizers.get(model)
    ids = as_ints(tok.chat(prompt_chat(as_messages(body), tok))[0])
    status, rendered = await _call(deps, url, RESPONSES_RENDER, body)
    if status != 200 or not isinstance(rendered, dict):
        return None
    if rendered.get("token_ids") != ids:
        log.warning("engine %s renders Responses input to other ids than the router", url)
        return None
    if rendered.get("reasoning_parser_kwargs") is not None:
        return None  # a reasoning parser splits the answer into items
    sp = rendered["sampling_params"]
    room = max_len - len(ids)
    rid = "resp_cacherouterprobe" + random_hex()
    one = {"max_output_tokens": 2, "temperature": 0.0, "request_id": rid, "store": False}
    # each asked with a salt of its own: both cold, so their usage must be the same
    salted = {**body, **one, "cache_salt": random_hex()}
    status, answer = await _call(deps, url, RESPONSES, salted)
    if status != 200:
        return None
    # whether it keeps responses, asked without making one: a stored background request
    # is refused (400) by an engine without a store, and reaches the lookup of its
    # previous response (404) in one with it (vLLM 0.32's order); anything else: a store
    ask = {"model": model, "input": "x", "store": True, "background": True,
           "previous_response_id": "resp_cacherouterprobe_none"}  # fmt: skip
    status = await _status(deps, url, RESPONSES, ask)
    cap = Capability(
        engine="vllm",
        defaults={k: sp.get(k, d) for k, d in _DEFAULTED.items()},
        stop_token_ids=list(sp.get("stop_token_ids") or []),
        max_model_len=max_len,
        capped=sp.get("max_tokens", room) < room,
        served=answer["model"],
        fingerprint=None,
        details=True,
        stores=status != 400,
    )
    if cap.capped:
        return cap  # every request goes as it came ("max_tokens"): nothing to compare
    block = deps.router.workers_for(model)[0].pool.block_size
    salted = {**body, **one, "cache_salt": random_hex()}
    plan = ResponsesPlan(salted, ids, cap, cap.served, block, lambda: None)
    status, generated = await _call(deps, url, GENERATE, plan.body)
    if status != 200:
        return None
    try:
        mine = plan.whole(generated)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        log.warning("engine %s: its tokens-in answer does not make a Responses answer (%r)",
                    url, exc)  # fmt: skip
        return None
    mine, answer = _comparable(mine), _comparable(answer)
    if mine != answer:
        differ = sorted(k for k in {*mine, *answer} if mine.get(k) != answer.get(k))
        log.warning("engine %s answers Responses otherwise than the router would (%s)",
                    url, ", ".join(differ))  # fmt: skip
        return None
    return cap


async def _status(deps: ProxyDeps, url: str, path: str, body: dict[str, Any]) -> int:
    """The status of a POST (its body read and dropped)."""
    headers = [(b"content-type", b"application/json")]
    resp = await deps.upstream.send(url, path, headers, orjson.dumps(body), PROBE_TIMEOUT)
    try:
        await resp.read(PROBE_TIMEOUT, 1 << 20, path)
    finally:
        resp.close()
    return resp.status


def _comparable(response: Mapping[str, Any]) -> dict[str, Any]:
    """A response object without what differs between two answers to one request."""
    out = {k: v for k, v in response.items() if k != "created_at"}
    out["output"] = [{k: v for k, v in item.items() if k != "id"} for item in out["output"]]
    return out


def _max_tokens(body: Mapping[str, Any]) -> Any:
    value = body.get("max_completion_tokens")
    return body.get("max_tokens") if value is None else value


class WithIds:
    """One chat to SGLang: its own body with the router's ids as ``input_ids``; the answer
    is the engine's chat layer's, passed on as it came."""

    __slots__ = ("body", "path", "raw")

    def __init__(self, prep: Prepared) -> None:
        assert prep.ids is not None
        self.path = CHAT
        self.body: dict[str, Any] = {**prep.parsed.body, "input_ids": as_ints(prep.ids)}
        self.raw = orjson.dumps(self.body)

    async def answer(self, resp: Response, timeout: float) -> Response:
        return resp


class Plan:
    """One chat as a tokens-in request, and the translation of its answer."""

    __slots__ = ("block_size", "body", "cap", "created", "gone", "id", "model", "path",
                 "prompt", "raw", "stream", "top_zero", "usage")  # fmt: skip

    def __init__(
        self, prep: Prepared, cap: Capability, lora: bool, gone: Callable[[], object]
    ) -> None:
        self.gone = gone  # the engine no longer serves the path: probe it again first
        body = prep.parsed.body
        sp: dict[str, Any] = {}
        for key, default in cap.defaults.items():
            value = body.get(key)
            sp[key] = default if value is None else value
        for key in _SAMPLING:
            value = body.get(key)
            if value is not None:
                sp[key] = value
        stop_ids = body.get("stop_token_ids") or []
        if cap.stop_token_ids:
            stop_ids = list(dict.fromkeys([*stop_ids, *cap.stop_token_ids]))
        if stop_ids:
            sp["stop_token_ids"] = stop_ids
        limit = _max_tokens(body)
        if limit is not None:  # the chat layer's clamp to the context left
            sp["max_tokens"] = min(limit, cap.max_model_len - prep.request.num_tokens)
        self.top_zero = False
        if body.get("logprobs"):
            top = body.get("top_logprobs") or 0
            sp["logprobs"] = top
            self.top_zero = top == 0  # the chat layer lists no candidates then
        assert prep.ids is not None
        out: dict[str, Any] = {
            "model": prep.parsed.model,
            "token_ids": as_ints(prep.ids),
            "sampling_params": sp,
            "output_mode": "text",
        }
        self.stream = prep.parsed.stream
        options = body.get("stream_options")
        self.usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
        if self.stream:  # usage always: its cached_tokens count in the router's metrics
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
        for key in ("cache_salt", "priority"):
            if body.get(key) is not None:
                out[key] = body[key]
        self.path = GENERATE
        self.body = out
        self.raw = orjson.dumps(out)
        self.cap = cap
        self.model = prep.parsed.model if lora else cap.served
        self.prompt = prep.request.num_tokens
        self.block_size = prep.pool.block_size
        self.id = ""
        self.created = 0

    async def answer(self, resp: Response, timeout: float) -> Response:
        """The engine's answer as the chat answer (``translate``)."""
        return await translate(self, resp, timeout)

    def start(self) -> bytes:
        return b""  # the role chunk goes with the first event (its id is the engine's)

    # -- the chat layer's answer ------------------------------------------------------
    def _chat_id(self, request_id: str) -> str:
        return "chatcmpl-" + request_id.removeprefix("generate-tokens-")

    def _usage(self, use: Mapping[str, Any], whole: bool) -> dict[str, Any]:
        prompt, completion = use["prompt_tokens"], use["completion_tokens"]
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
        details = use.get("prompt_tokens_details")
        if self.cap.details and isinstance(details, Mapping):
            cached = details.get("cached_tokens")
            d: dict[str, Any] = {"cached_tokens": cached}
            if cached is not None:  # vLLM's: the prompt's whole blocks it wrote
                whole_blocks = min(self.prompt // self.block_size * self.block_size, prompt)
                d["created_cache_tokens"] = max(0, whole_blocks - cached)
            if whole:
                d["multimodal_tokens"] = None
            out["prompt_tokens_details"] = d
        elif whole:
            out["prompt_tokens_details"] = None
        if whole:
            out["completion_tokens_details"] = None
        return out

    def _logprobs(self, lp: Any) -> Any:
        if lp is not None and self.top_zero:
            for entry in lp.get("content") or ():
                entry["top_logprobs"] = []
        return lp

    def whole(self, gen: Mapping[str, Any]) -> dict[str, Any]:
        """A whole chat answer from a whole generate answer."""
        choices = []
        for c in gen["choices"]:
            message = {"role": "assistant", "content": c["text"], "refusal": None,
                       "annotations": None, "audio": None, "function_call": None,
                       "reasoning": None}  # fmt: skip
            choices.append(
                {
                    "index": c["index"],
                    "message": message,
                    "logprobs": self._logprobs(c.get("logprobs")),
                    "finish_reason": c.get("finish_reason") or "stop",
                    "stop_reason": c.get("stop_reason"),
                    "token_ids": None,
                    "routed_experts": None,
                }
            )
        return {
            "id": self._chat_id(gen["request_id"]),
            "object": "chat.completion",
            "created": gen.get("created") or int(time.time()),
            "model": gen.get("model") or self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.cap.fingerprint,
            "usage": self._usage(gen["usage"], True),
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _envelope(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model}  # fmt: skip

    def event(self, data: bytes) -> bytes:
        """One generate SSE event's data as the chat's events (b"": none)."""
        if data == b"[DONE]":
            return b"data: [DONE]\n\n"
        gen = orjson.loads(data)
        if "error" in gen:  # the engine's error event: the chat layer's shape already
            return b"data: " + data + b"\n\n"
        out = b""
        if not self.id:  # the first event: the chat's role chunk first
            self.id = self._chat_id(gen["request_id"])
            self.created = int(time.time())
            delta = {"role": "assistant", "content": ""}
            role = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            first = {**self._envelope(), "choices": [role], "prompt_token_ids": None,
                     "prompt_text": None}  # fmt: skip
            out = b"data: " + orjson.dumps(first) + b"\n\n"
        choices = gen["choices"]
        if not choices:
            use = gen.get("usage")
            if use is None or not self.usage:
                return out
            chunk = {**self._envelope(), "choices": [], "usage": self._usage(use, False)}
            if self.cap.fingerprint is not None:
                chunk["system_fingerprint"] = self.cap.fingerprint
            return out + b"data: " + orjson.dumps(chunk) + b"\n\n"
        for c in choices:
            finish = c.get("finish_reason")
            choice: dict[str, Any] = {
                "index": c["index"],
                "delta": {"content": c["text"]},
                "logprobs": self._logprobs(c.get("logprobs")),
                "finish_reason": finish,
            }
            if finish is not None:
                choice["stop_reason"] = c.get("stop_reason")
            choice["token_ids"] = None
            chunk = {**self._envelope(), "choices": [choice]}
            if finish is not None and not self.usage and self.cap.fingerprint is not None:
                chunk["system_fingerprint"] = self.cap.fingerprint
            out += b"data: " + orjson.dumps(chunk) + b"\n\n"
        return out


class _Shaper(Protocol):
    """What ``Shaped`` and ``Streamed`` need of a request's translation."""

    path: str
    body: dict[str, Any]
    raw: bytes
    stream: bool

    gone: Callable[[], object]

    def whole(self, gen: Mapping[str, Any]) -> dict[str, Any]: ...
    def start(self) -> bytes: ...
    def event(self, data: bytes) -> bytes: ...


class Shaped:
    """A tokens-in request whose answer ``shaper`` translates (a Responses request:
    ``router.forward.responses_out``)."""

    __slots__ = ("body", "path", "raw", "shaper")

    def __init__(self, shaper: _Shaper) -> None:
        self.shaper = shaper
        self.path, self.body, self.raw = shaper.path, shaper.body, shaper.raw

    async def answer(self, resp: Response, timeout: float) -> Response:
        return await translate(self.shaper, resp, timeout)


async def translate(shaper: _Shaper, resp: Response, timeout: float) -> Response:
    """The engine's answer as ``shaper`` shapes it (an error status passes as it came; a
    404 also makes the next request to this engine wait for a new probe)."""
    if resp.status != 200:
        if resp.status == 404:
            shaper.gone()
        return resp
    if shaper.stream:
        return Streamed(resp, shaper)
    try:
        raw = await resp.read(timeout, ANSWER_LIMIT, "the engine's answer")
    finally:
        resp.close()
    try:
        out = orjson.dumps(shaper.whole(orjson.loads(raw)))
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
        message = f"bad answer from the engine's tokens-in endpoint: {exc!r}"
        return Whole(resp, 502, error_body(502, message, "upstream_error"))
    return Whole(resp, 200, out)


class Whole(Response):
    """A whole answer, already read and translated."""

    __slots__ = ("_body", "_inner")

    def __init__(self, inner: Response, status: int, body: bytes) -> None:
        # not Response.__init__: no connection of its own (the inner one is released)
        self._inner = inner
        self.status = status
        self.written_ns = inner.written_ns
        self.headers = [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]  # fmt: skip
        self.complete = True
        self._body = body

    @property
    def drained(self) -> bool:
        return not self._body

    async def chunks(self, timeout: float | Callable[[], float]) -> AsyncIterator[bytes]:
        body, self._body = self._body, b""
        if body:
            yield body

    async def settle(self, timeout: float) -> None:
        return None

    def close(self) -> None:
        return None


class Streamed(Response):
    """A generate stream read as it comes, each event passed on as the chat's (or the
    Responses request's)."""

    __slots__ = ("_inner", "_plan", "_rest")

    def __init__(self, inner: Response, plan: _Shaper) -> None:
        self._inner = inner
        self._plan = plan
        self._rest = b""
        self.status = inner.status
        self.written_ns = inner.written_ns
        self.headers = [(k, v) for k, v in inner.headers if k.lower() != b"content-length"]
        self.complete = inner.complete

    @property
    def drained(self) -> bool:
        return self._inner.drained

    async def chunks(self, timeout: float | Callable[[], float]) -> AsyncIterator[bytes]:
        inner = self._inner
        first = self._plan.start()
        if first:  # what the engine's own layer sends before any token
            yield first
        async for chunk in inner.chunks(timeout):
            self.complete = inner.complete
            out = self._feed(chunk)
            if out:
                yield out
        self.complete = inner.complete

    def _feed(self, chunk: bytes) -> bytes:
        events = (self._rest + chunk).split(b"\n\n")
        self._rest = events.pop()
        out = b""
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # SSE comments and blank lines
                try:
                    out += self._plan.event(line[5:].strip())
                except (orjson.JSONDecodeError, KeyError, IndexError, TypeError,
                        ValueError) as exc:  # fmt: skip
                    message = f"bad event from the engine's tokens-in stream: {exc!r}"
                    raise UpstreamError(message) from exc
        return out

    async def settle(self, timeout: float) -> None:
        await self._inner.settle(timeout)

    def close(self) -> None:
        self._inner.close()
