"""Requests that survive their engine: a broken answer continues on another engine.

When an engine breaks under a request (its connection lost, a 5xx status, an error event
in the stream, or silence past ``stall_after`` while its health checks fail), the
request moves to another engine, at most ``migrate_max`` times. So does a stream stuck
on an engine that looks healthy (a lost request, a wedged sequence): silent past
``token_stall_after`` (30 s) once its first token came, or, before it, past
``first_token_stall_after`` (60 s) per 8,192 prompt tokens, since a prefill takes time
in proportion to the prompt (a 128K prompt gets 16 min, so the default 10 min
``request_timeout`` bounds it; queueing behind others counts too); without these bounds
it ended only at ``request_timeout``, which bounds each wait. Then:

- a stream continues where it broke. The router re-sends the request with what was
  generated so far: a chat with the partial answer as a final assistant message and
  ``continue_final_message: true``, ``add_generation_prompt: false`` (vLLM and SGLang
  render it without the end-of-turn marker, ``router.tokens.tokenize``), a completion
  with the text so far after its prompt (token ids after token ids), ``max_tokens``
  (and ``min_tokens``) reduced by the tokens sent. The client sees one stream: the new
  engine's events follow the old one's with the first answer's ``id`` and ``created``,
  its role chunk dropped, one ``[DONE]``, and ``usage`` summed (the original prompt's
  tokens, every leg's completion tokens). A broken leg's tokens are counted from the
  text it sent (the router's tokenizer), not from its chunks: vLLM with
  ``--stream-interval 4`` sends up to 4 tokens a chunk, and counting chunks made a
  continuation ask 3x too many tokens. The new engine is the policy's pick for the
  grown prompt, so one that holds most of it (the original prompt's blocks, hinted or
  cached) recomputes least: peers replay to any healthy worker;
- a whole answer (``stream`` false) is sent again, whole, to another engine: the client
  has received nothing of it (its body is held until complete).

Only complete SSE events reach the client (an event cut by the break is dropped and
generated again), so the splice is clean. Each event of a migratable stream is parsed
once (orjson, about 1 us for a token's chunk) to follow the text.

Not migratable (the client gets today's answer: the error event ``upstream_broken`` in
a stream, a 502 for a whole answer; ``cache_router_not_migrated{reason}``), by
``refusal`` when the request comes, or at the break:

- ``api``: the Responses API (its events carry item ids and sequence numbers a second
  answer would restart; with ``store`` the engine keeps the first answer) and Anthropic
  Messages (typed content blocks by index);
- ``n``: ``n`` or ``best_of`` over 1 (interleaved choices, each its own continuation);
- ``logprobs``: ``logprobs``, ``top_logprobs``, ``prompt_logprobs`` (the client would
  get the second engine's view of a prompt it never sent);
- ``echo``, ``suffix``: completions that echo the prompt or fill before a suffix;
- ``structured_output``: ``response_format`` other than text, ``guided_*``,
  ``structured_outputs`` (the grammar would restart at the continuation);
- ``prompts``: a completion of several prompts;
- ``gateway``: a region gateway (its clusters' routers migrate their own engines);
- ``disaggregated``: prefill/decode pools (``router.pd``) keep today's behaviour;
- at the break: ``tool_call`` (a tool call's arguments were streaming), ``reasoning``
  (reasoning content was streamed: the continuation cannot hand it back), ``limit``
  (``migrate_max`` moves used), ``no_worker`` (no other engine could take it),
  ``refused`` (the next engine refused the continuation with a 4xx).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson

from router.forward.relay import ProxySettings, Relay
from router.forward.upstream import Response, UpstreamError, UpstreamTimeout
from router.http.errors import ApiError, sse_error
from router.tokens.media import as_ints
from router.tokens.tokenize import num_tokens
from router.workers.load import WAITING, Flight

if TYPE_CHECKING:
    from router.admission.core import Ticket
    from router.forward.relay import Exchange
    from router.http.asgi import Message
    from router.observe.metrics import Series
    from router.observe.tracing import Trace
    from router.routing.decide import Kind, Parsed, Prepared
    from router.workers.registry import Worker

Cause = Literal["connection", "status", "stall", "error_event"]

_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs")  # fmt: skip
DONE = b"data: [DONE]\n\n"


def refusal(parsed: Parsed, gateway: bool) -> str | None:
    """Why this request cannot move to another engine if its engine breaks (None: it
    can); see the module docstring for each reason."""
    body = parsed.body
    if gateway:
        return "gateway"
    if parsed.kind not in ("chat", "completion"):
        return "api"
    if _over_one(body.get("n")) or _over_one(body.get("best_of")):
        return "n"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return "logprobs"
    if parsed.kind == "completion":
        if body.get("echo"):
            return "echo"
        if body.get("suffix"):
            return "suffix"
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
            return "prompts"
    fmt = body.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
        return "structured_output"
    if any(body.get(key) is not None for key in _STRUCTURED):
        return "structured_output"
    return None


def _over_one(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 1


class Broken(Exception):
    """The engine's stream broke: ``cause`` says how."""

    def __init__(self, cause: Cause, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def cause_of(exc: UpstreamError) -> Cause:
    return "stall" if isinstance(exc, UpstreamTimeout) else "connection"


# The prompt tokens one ``first_token_stall_after`` covers: the bound before the first
# token grows with the prompt past this (a 128K prompt's prefill gets 16 of them).
STALL_PROMPT_UNIT = 8192


def stall_bound(cfg: ProxySettings, prompt_tokens: int, started: bool) -> float:
    """Seconds a stream may be silent before it moves to another engine although its
    engine looks healthy: ``token_stall_after`` once its first token came, else
    ``first_token_stall_after`` per ``STALL_PROMPT_UNIT`` prompt tokens (at least one);
    never past ``request_timeout``, which a setting of 0 leaves alone."""
    if started:
        bound = cfg.token_stall_after
    else:
        bound = cfg.first_token_stall_after * max(1.0, prompt_tokens / STALL_PROMPT_UNIT)
    return min(bound, cfg.request_timeout) if bound else cfg.request_timeout


class Splice:
    """One stream across its engines: what went to the client, how to go on.

    ``feed`` takes an engine's body chunks and gives back the bytes to send: complete
    SSE events only, those of a second engine rewritten to read as the first's.
    """

    __slots__ = (
        "_buf",
        "_created",
        "_id",
        "_model",
        "before",
        "broken",
        "cached",
        "count",
        "done",
        "finished",
        "kind",
        "leg",
        "leg_start",
        "leg_usage",
        "prompt_tokens",
        "reasoning",
        "sent",
        "text",
        "tool_call",
        "usage_sent",
    )

    def __init__(self, kind: Kind, prompt_tokens: int, count: Callable[[str], int]) -> None:
        self.kind = kind
        self.prompt_tokens = prompt_tokens  # the original prompt's (the router's count)
        self.count = count  # text -> its tokens (the router's tokenizer)
        self._buf = b""
        self._id: Any = None
        self._created: Any = None
        self._model: Any = None
        self.text: list[str] = []  # the generated pieces, every leg's
        self.before = 0  # completion tokens of the legs before this one
        self.leg = 0
        self.leg_start = 0  # where this leg's pieces start in ``text``
        self.leg_usage: int | None = None  # this leg's completion tokens, as its engine said
        self.cached: int | None = None  # the first leg's cached_tokens
        self.sent = False  # any event reached the client
        self.finished = False  # a finish_reason went out: the answer is complete
        self.done = False  # ``[DONE]`` went out
        self.usage_sent = False
        self.broken: Broken | None = None  # the error event that ended this leg
        self.tool_call = False
        self.reasoning = False

    @property
    def tokens(self) -> int:
        """Completion tokens sent so far: an engine's own count when it gave one (usage
        in its chunks), else the tokens of the text this leg sent. Not one a chunk: an
        engine may send several tokens in one (vLLM's ``--stream-interval``, SGLang's
        ``--stream-interval``), or none in one (a token that ends inside a character
        is held back and comes with the next). Computed at a break, not per chunk."""
        leg = self.leg_usage
        if leg is None:
            leg = self.count("".join(self.text[self.leg_start :]))
        return self.before + leg

    def next_leg(self) -> None:
        self.before = self.tokens
        self.leg += 1
        self.leg_start = len(self.text)
        self.leg_usage = None
        self.broken = None
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete events in ``chunk`` (with what came before it) to send on. At an
        error event ``broken`` is set and the rest is dropped (generated again by the next
        engine): what the returned bytes hold is exactly what ``text`` and ``tokens``
        count. The first engine's events go on as they came (no copy)."""
        buf = self._buf + chunk if self._buf else chunk
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2 :]
        events = buf[:end].split(b"\n\n")
        out: list[bytes] = []
        for event in events:
            try:
                sent = self._event(event)
            except Broken as exc:
                self.broken = exc
                self._buf = b""
                break
            if sent is not None:
                out.append(sent)
        else:
            if self.leg == 0:  # nothing rewritten: the bytes as they came
                self.sent = True
                return buf[: end + 2]
        if out:
            self.sent = True
            out.append(b"")
        return b"\n\n".join(out)

    def _event(self, event: bytes) -> bytes | None:
        """What to send of one event (None: nothing)."""
        data = event.strip()
        if not data.startswith(b"data:"):
            return event  # a comment or another field: on as it came
        payload = data[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return event
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event
        if not isinstance(obj, dict):
            return event
        error = obj.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else str(error)
            raise Broken("error_event", f"the engine's stream ended in an error: {message}")
        if self._id is None:
            self._id, self._created, self._model = (
                obj.get("id"),
                obj.get("created"),
                obj.get("model"),
            )
        role_only = self._follow(obj)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage_sent = True
            completion = usage.get("completion_tokens")
            if isinstance(completion, int):
                self.leg_usage = completion
            details = usage.get("prompt_tokens_details")
            if self.leg == 0 and isinstance(details, dict):
                cached = details.get("cached_tokens")
                self.cached = cached if isinstance(cached, int) else None
        if self.leg == 0:
            return event
        if role_only:
            return None  # the second engine's role chunk: the client had the first's
        obj["id"], obj["created"] = self._id, self._created
        if isinstance(usage, dict):
            obj["usage"] = self._summed(usage)
        return b"data: " + orjson.dumps(obj)

    def _follow(self, obj: dict[str, Any]) -> bool:
        """Track the text and the end of one chunk; whether it carries only the role."""
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return False
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finished = True
        if self.kind == "chat":
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                return False
            if delta.get("tool_calls"):
                self.tool_call = True
            if delta.get("reasoning_content") or delta.get("reasoning"):
                self.reasoning = True
            piece = delta.get("content")
            role_only = (
                "role" in delta
                and not piece
                and not delta.get("tool_calls")
                and choice.get("finish_reason") is None
            )
        else:
            piece = choice.get("text")
            role_only = False
        if isinstance(piece, str) and piece:
            self.text.append(piece)
        return role_only

    def _summed(self, usage: dict[str, Any]) -> dict[str, Any]:
        completion = self.before + int(usage.get("completion_tokens") or 0)
        out = {**usage, "prompt_tokens": self.prompt_tokens, "completion_tokens": completion}
        out["total_tokens"] = self.prompt_tokens + completion
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = min(int(details.get("cached_tokens") or 0), self.prompt_tokens)
            out["prompt_tokens_details"] = {**details, "cached_tokens": cached}
        return out

    def ending(self, include_usage: bool, reason: str | None) -> bytes:
        """The events that close a stream whose generation is over although its engine
        did not end it (it broke after the last token, or the continuation has no
        tokens left): a finish chunk (``reason``), the usage if asked, ``[DONE]``."""
        out = []
        if reason is not None and not self.finished:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
            if self.kind == "chat":
                choice["delta"] = {}
            else:
                choice["text"] = ""
            out.append(self._chunk({"choices": [choice]}))
        if include_usage and not self.usage_sent:
            usage = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens,
            }
            out.append(self._chunk({"choices": [], "usage": usage}))
        out.append(DONE)
        self.done = True
        return b"".join(out)

    def _chunk(self, fields: dict[str, Any]) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        head = {"id": self._id, "object": obj, "created": self._created, "model": self._model}
        return b"data: " + orjson.dumps({**head, **fields}) + b"\n\n"

    def blocked(self) -> str | None:
        """Why the stream cannot continue from here (None: it can)."""
        if self.tool_call:
            return "tool_call"
        if self.reasoning:
            return "reasoning"
        return None


def continuation(parsed: Parsed, generated: str, tokens: int, encode: Any) -> dict[str, Any] | None:
    """The request that goes on from ``generated`` (``tokens`` of it sent), or None
    when nothing is left to generate (``max_tokens`` reached). ``encode``: text -> the
    model's token ids, for a prompt given as token ids."""
    body = dict(parsed.body)
    for key in ("max_completion_tokens", "max_tokens"):
        limit = body.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - tokens <= 0:
                return None
            body[key] = limit - tokens
    floor = body.get("min_tokens")
    if isinstance(floor, int) and not isinstance(floor, bool) and floor:
        body["min_tokens"] = max(0, floor - tokens)
    if not generated:
        return body  # nothing came yet: the same request again
    if parsed.kind == "chat":
        messages = list(body["messages"])
        last = messages[-1] if messages else None
        if (
            body.get("continue_final_message")
            and isinstance(last, dict)
            and last.get("role") == "assistant"
            and isinstance(last.get("content"), str)
        ):  # the client continued a message already: it grows
            messages[-1] = {**last, "content": last["content"] + generated}
        else:
            messages.append({"role": "assistant", "content": generated})
        body["messages"] = messages
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
        return body
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str):
        body["prompt"] = prompt + generated
    else:
        body["prompt"] = [*prompt, *encode(generated)]
    return body


def broken_event(message: str) -> bytes:
    """The error event a stream ends with when it cannot go on (today's)."""
    return sse_error(message, "upstream_broken")


@dataclass(slots=True)
class Leg:
    """One engine's part of a request: its response and what it counts into."""

    resp: Response
    worker: Worker
    tid: str  # the target: the worker or one of its DP ranks
    hit: int  # prompt tokens the index predicted cached there
    flight: Flight
    series: Series
    t_head: int = 0  # when its headers came (a trace's clock; 0: no trace)


class Legs(Relay, Protocol):
    """What a migration uses of the proxy that took the request (``Proxy`` has it):
    the relay's methods, and its legs."""

    async def open(
        self,
        prep: Prepared,
        headers: list[tuple[bytes, bytes]],
        raw: bytes,
        exclude: set[str],
        trace: Trace | None,
        resend: Callable[[Cause], bool] | None = None,
        ticket: Ticket | None = None,
    ) -> Leg: ...

    def close(self, leg: Leg, prep: Prepared, trace: Trace | None) -> None: ...

    def head(self, resp: Response, worker_id: str, hit: int) -> Message: ...

    def first_token(self, prep: Prepared, tid: str) -> Callable[[float], None]: ...


class Migration:
    """One migratable request through its engines (the module docstring)."""

    def __init__(
        self,
        proxy: Legs,
        prep: Prepared,
        headers: list[tuple[bytes, bytes]],
        raw: bytes,
        ex: Exchange,
        trace: Trace | None,
        ticket: Ticket | None = None,
    ) -> None:
        self.proxy = proxy
        self.ticket = ticket  # admission's binding, for the first leg only
        self.st = proxy.deps
        self.first = prep  # the client's request
        self.prep = prep  # the one being sent (a continuation after a break)
        self.headers = headers
        self.raw = raw
        self.ex = ex
        self.trace = trace
        self.exclude: set[str] = set()
        self.moves = 0

    def _take_ticket(self) -> Ticket | None:
        ticket, self.ticket = self.ticket, None
        return ticket

    def _move(self, cause: Cause) -> bool:
        """Take one of the ``migrate_max`` moves for ``cause`` (False: none left)."""
        if self.moves >= self.st.cfg.migrate_max:
            return False
        self.moves += 1
        self.st.metrics.migrations.labels(cause).inc()
        return True

    def _broke(self, leg: Leg, why: str) -> None:
        st = self.st
        st.metrics.error(self.prep.arm, leg.tid, "upstream_broken")
        st.registry.request_failed(leg.worker, why)
        st.registry.suspect(leg.worker)
        self.exclude.add(leg.worker.id)

    async def run(self) -> None:
        if self.first.parsed.stream:
            await self._stream()
        else:
            await self._whole()

    # -- a whole answer -----------------------------------------------------------
    async def _whole(self) -> None:
        """Sent again, whole, while its engine breaks before the answer's end."""
        proxy, st = self.proxy, self.st
        timeout = st.cfg.request_timeout
        broke: UpstreamError | None = None  # the last engine's break, once one broke
        while True:
            try:
                leg = await proxy.open(self.prep, self.headers, self.raw, self.exclude,
                                       self.trace, self._move, self._take_ticket())  # fmt: skip
            except ApiError as err:
                if broke is None:
                    raise  # no engine broke under it: the router's own answer, as ever
                st.metrics.not_migrated.labels("no_worker").inc()
                raise ApiError(502, str(broke), "upstream_error") from err
            try:
                try:
                    await leg.resp.settle(timeout)
                except UpstreamError as exc:
                    self._broke(leg, "broken answer")
                    broke = exc
                    if not self._move(cause_of(exc)):
                        st.metrics.not_migrated.labels("limit").inc()
                        raise ApiError(502, str(exc), "upstream_error") from exc
                    continue
                if leg.resp.status >= 500 and self._move("status"):
                    self._broke(leg, f"status {leg.resp.status}")
                    continue
                await proxy.stream(
                    self.ex, leg.resp, leg.tid, leg.flight, leg.series, self.prep.arm, leg.hit
                )
                return
            finally:
                proxy.close(leg, self.prep, self.trace)

    # -- a stream -----------------------------------------------------------------
    async def _stream(self) -> None:
        """Continued on another engine while its engine breaks before its end."""
        proxy, st, ex = self.proxy, self.st, self.ex
        parsed = self.first.parsed
        options = parsed.body.get("stream_options")
        usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
        tokenizer = st.router.tokenizers.get(parsed.model)
        splice = Splice(
            parsed.kind,
            self.first.request.num_tokens,
            lambda text: num_tokens(tokenizer.encode(text, False)),
        )
        while True:
            try:
                leg = await proxy.open(self.prep, self.headers, self.raw, self.exclude,
                                       self.trace, self._move, self._take_ticket())  # fmt: skip
            except ApiError as err:
                if not ex.started:
                    raise  # nothing reached the client: the error as a status, as ever
                st.metrics.not_migrated.labels("no_worker").inc()
                await self._end(broken_event(f"the engine broke; none could go on: {err}"))
                return
            try:
                cause = await self._leg(leg, splice)
            finally:
                proxy.close(leg, self.prep, self.trace)
                ex.output_tokens = splice.tokens  # settles admission's estimate
            if cause is None:
                return
            if splice.finished:  # it broke after the last token: only the end is missing
                await self._end(splice.ending(usage, None))
                return
            why = splice.blocked() or (None if self._move(cause) else "limit")
            if why is not None:
                st.metrics.not_migrated.labels(why).inc()
                await self._end(
                    broken_event(f"the engine broke and the stream cannot move ({why})")
                )
                return
            if not await self._continue(splice):
                await self._end(splice.ending(usage, "length"))
                return

    async def _continue(self, splice: Splice) -> bool:
        """The request from where the stream is (False: no tokens are left for it)."""
        parsed = self.first.parsed
        tokenizer = self.st.router.tokenizers.get(parsed.model)
        body = continuation(
            parsed,
            "".join(splice.text),
            splice.tokens,
            lambda text: as_ints(tokenizer.encode(text, False)),
        )
        if body is None:
            return False
        messages = body["messages"] if parsed.kind == "chat" else parsed.messages
        grown = replace(parsed, body=body, messages=messages)
        self.raw = orjson.dumps(body)
        self.prep = await self.st.router.prepare(grown, len(self.raw), self.trace)
        splice.next_leg()
        return True

    async def _leg(self, leg: Leg, splice: Splice) -> Cause | None:
        """Relay one engine's stream into the client's; how it broke (None: it ended)."""
        proxy, st, ex = self.proxy, self.st, self.ex
        resp = leg.resp
        sse = (resp.header(b"content-type") or b"").startswith(b"text/event-stream")
        if resp.status >= 500 or (resp.status >= 400 and ex.started):
            self._broke(leg, f"status {resp.status}")
            if resp.status >= 500:
                return "status"
            st.metrics.not_migrated.labels("refused").inc()
            await self._end(
                broken_event(f"the next engine refused the continuation ({resp.status})")
            )
            return None
        if not sse or resp.status >= 400:  # the client's error, or no stream: as ever
            await proxy.stream(ex, resp, leg.tid, leg.flight, leg.series, self.prep.arm, leg.hit)
            return None
        st.registry.request_succeeded(leg.worker)
        if not ex.started:
            ex.started = True
            await ex.send(proxy.head(resp, leg.tid, leg.hit))
        first_token = proxy.first_token(self.prep, leg.tid) if splice.leg == 0 else None
        prompt = self.prep.request.num_tokens

        def bound() -> float:  # before each wait: has this leg sent a token yet?
            return stall_bound(st.cfg, prompt, len(splice.text) > splice.leg_start)

        try:
            async for chunk in resp.chunks(bound):
                if leg.flight.state is WAITING:
                    elapsed = time.perf_counter() - ex.t0
                    if first_token is not None:
                        leg.series.ttft.observe(elapsed)
                        first_token(elapsed * 1000.0)
                    leg.flight.first_byte()
                out = splice.feed(chunk)
                if out:
                    await ex.send({"type": "http.response.body", "body": out, "more_body": True})
                if splice.broken is not None:
                    self._broke(leg, "error event")
                    return splice.broken.cause
                if splice.done:
                    break
        except UpstreamError as exc:
            self._broke(leg, "broken stream")
            return cause_of(exc)
        if not splice.done:  # the engine ended its answer without [DONE]
            self._broke(leg, "stream cut")
            return "connection"
        await self._end(b"")
        if splice.leg == 0 and splice.cached is not None:  # the audit's as for any stream
            leg.series.hit_tokens.inc(splice.cached)
            if not st.cfg.gateway:
                st.audit.record(leg.tid, leg.hit, splice.cached)
        return None

    async def _end(self, body: bytes) -> None:
        self.ex.done = True
        await self.ex.send({"type": "http.response.body", "body": body, "more_body": False})
