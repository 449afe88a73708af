"""The routing decision for one request: parse, tokenize, hash, match, ask the policy.

Everything before the first byte goes to an engine lives here, shared by the proxy
and ``POST /admin/explain`` (which decides without sending). Bodies are parsed with
orjson and checked by hand: a per-request pydantic model would cost more than the
whole decision.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, cast

import orjson

from index.backend import NativePrefixIndex
from index.groups import clip_matches
from index.hashing import RouterHash, cacheable_blocks, request_block_hashes
from index.prefix_index import TierMatch
from policies.base import (
    NO_MATCH,
    Decision,
    NoWorkerError,
    Policy,
    RouteRequest,
    WorkerView,
    expected_hit_blocks,
)
from policies.experiments import Experiment
from router.config import RouterConfig
from router.http import fields
from router.http.errors import ApiError, ErrorCode
from router.http.fields import check_fields
from router.routing.affinity import ResponseAffinity
from router.routing.messages import as_messages as anthropic_messages
from router.routing.messages import check_messages
from router.routing.prune import AVAILABLE as PRUNING
from router.routing.prune import PRUNE_ABOVE, Pruner, Target
from router.routing.responses import as_messages, check_responses, prompt_chat
from router.routing.session_key import derive
from router.tokens.media import as_ints, block_keys, expand
from router.tokens.pool import TokenizePool
from router.tokens.prefix_cache import Lookup, PrefixCache
from router.tokens.tokenize import (
    HFTokenizer,
    TokenIds,
    Tokenizer,
    TokenizerSet,
    has_media,
    num_tokens,
)
from router.workers.pools import Pool
from router.workers.registry import Worker, WorkerRegistry

if TYPE_CHECKING:
    from router.observe.tracing import Trace

Kind = Literal["chat", "completion", "responses", "messages"]


@dataclass(slots=True)
class Parsed:
    kind: Kind
    body: dict[str, Any]
    model: str
    stream: bool
    session_key: str | None
    request_id: str
    # the conversation as chat messages (None: a completion), converted once for the
    # session key and the tokenizer both
    messages: list[dict[str, Any]] | None


@dataclass(slots=True)
class Prepared:
    """A parsed request with its tokens hashed: everything a decision needs."""

    parsed: Parsed
    pool: Pool
    workers: list[Worker]
    request: RouteRequest
    arm: str
    pinned: str | None = None  # the worker holding ``previous_response_id`` (Responses API)
    # a completions text prompt as the router's token ids, sent in its place
    # (``forward_token_ids``); None: the client's body goes as it came
    prompt_ids: list[int] | None = None
    ids: TokenIds | None = None  # the prompt's token ids (router.forward.tokens_in sends them)

    def engine_body(self, raw: bytes) -> tuple[bytes, dict[str, Any]]:
        """The body the engine gets, as bytes and parsed: the client's, or with ``prompt``
        replaced by ``prompt_ids`` so the engine does not tokenize it again."""
        if self.prompt_ids is None:
            return raw, self.parsed.body
        body = {**self.parsed.body, "prompt": self.prompt_ids}
        return orjson.dumps(body), body


def _bad(message: str, param: str | None = None, code: ErrorCode = "invalid_request") -> ApiError:
    return ApiError(400, message, code, param)


class Router:
    """Turns request bodies into decisions; holds nothing per request."""

    def __init__(
        self,
        cfg: RouterConfig,
        registry: WorkerRegistry,
        tokenizers: TokenizerSet,
        experiment: Experiment,
        tokenize_pool: TokenizePool | None = None,
        *,
        blind: Callable[[float], bool] | None = None,
        on_predict: Callable[[str, Sequence[int], float], None] | None = None,
        affinity: ResponseAffinity | None = None,
        prefixes: PrefixCache | None = None,
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.tokenizers = tokenizers
        self.experiment = experiment
        self.tokenize_pool = tokenize_pool  # large prompts go there (None: the event loop)
        # whether the event feed is down too long to trust the index (None: no feed)
        self.blind = blind
        # who else hears of predict-on-route marks (peer replicas; None: no peers)
        self.on_predict = on_predict
        self.affinity = affinity  # response id -> worker (Responses API; None: no pinning)
        self.prefixes = prefixes  # chats' tokens and hashes by rendered prefix (None: off)
        self._pruners: dict[str, Pruner] = {}  # by pool: its load board (wide pools only)
        self._ids = itertools.count()
        self._id_prefix = f"cr-{os.getpid():x}-{os.urandom(3).hex()}-"

    # -- parse -------------------------------------------------------------------
    def parse(self, kind: Kind, raw: bytes, headers: Mapping[str, str]) -> Parsed:
        """Validate the fields routing needs; the body itself goes to the engine unchanged."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _bad(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(body, dict):
            raise _bad("request body must be a JSON object", code="invalid_json")
        if kind == "chat":
            check_fields(body, fields.CHAT)
        elif kind == "completion":
            check_fields(body, fields.COMPLETION)
        else:
            check_fields(body, fields.MODEL)
            (check_responses if kind == "responses" else check_messages)(body)
            check_fields(body, fields.LENGTHS)
        model: str = body["model"]
        stream: bool = body.get("stream", False)
        messages: list[dict[str, Any]] | None = None
        if kind == "chat":
            messages = body["messages"]
        elif kind == "responses":
            messages = as_messages(body)
        elif kind == "messages":
            messages = anthropic_messages(body)
        session = headers.get("x-session-id") or body.get("user")
        if not (isinstance(session, str) and session):
            session = self._derived_session(kind, body, model, messages)
        return Parsed(
            kind=kind,
            body=body,
            model=model,
            stream=stream,
            session_key=session,
            request_id=headers.get("x-request-id") or self._id_prefix + str(next(self._ids)),
            messages=messages,
        )

    def _derived_session(
        self, kind: Kind, body: dict[str, Any], model: str, messages: list[dict[str, Any]] | None
    ) -> str | None:
        """The conversation's own key when the client names none
        (``router.routing.session_key``)."""
        if not self.cfg.derive_session_key or messages is None:
            return None
        if kind == "responses" and body.get("previous_response_id") is not None:
            return None  # the new turn alone; pinned to the previous response's worker
        return derive(model, messages)

    # -- tokenize + hash ---------------------------------------------------------
    async def prepare(self, parsed: Parsed, size_hint: int, trace: Trace | None = None) -> Prepared:
        """Resolve the model's pool and hash the prompt (on the tokenize pool when large:
        ``ApiError`` 429/503 when that is full or too slow, ``router.tokens.pool``)."""
        workers = self.workers_for(parsed.model)
        pool = workers[0].pool
        t0 = time.time_ns() if trace is not None else 0
        found = self._lookup(parsed, pool)
        # what is left to encode decides: a turn whose conversation is cached encodes only
        # its new messages, and the hop to a thread (~0.15 ms of CPU) would cost more
        work = size_hint if found is None else found.pending
        if work > self.cfg.offload_chars and self.tokenize_pool is not None:
            ids, hashes = await self.tokenize_pool.run(self._hash, parsed, pool, trace, found, t0)
        else:
            ids, hashes = self._hash(parsed, pool, trace, found, t0)
        request = RouteRequest(
            request_id=parsed.request_id,
            model=parsed.model,
            num_tokens=num_tokens(ids),
            block_hashes=cast(list[int], hashes),  # policies see router hashes as ints
            block_size=pool.block_size,
            session_key=parsed.session_key,
            max_tokens=max_tokens(parsed.body),
        )
        prep = self.prepared(parsed, workers, request)
        prep.ids = ids
        if self.cfg.forward_token_ids and not isinstance(ids, bytes) and _text_prompt(parsed):
            # a real tokenizer's ids (a long prompt's come packed), never the fallback's
            prep.prompt_ids = ids if isinstance(ids, list) else ids.tolist()
        previous = parsed.body.get("previous_response_id") if parsed.kind == "responses" else None
        if previous is not None and self.affinity is not None:
            prep.pinned = self.affinity.lookup(previous)
        return prep

    def workers_for(self, model: str) -> list[Worker]:
        """The workers serving ``model``; ``ApiError`` 404 (OpenAI's wording) when none."""
        workers = self.registry.for_model(model)
        if not workers:
            raise ApiError(404, f"The model `{model}` does not exist.", "model_not_found", "model")
        return workers

    def prepared(self, parsed: Parsed, workers: list[Worker], request: RouteRequest) -> Prepared:
        """The request with its experiment arm (sessions keep theirs)."""
        arm = self.experiment.assign(parsed.session_key).name
        return Prepared(parsed, workers[0].pool, workers, request, arm)

    def _lookup(self, parsed: Parsed, pool: Pool) -> Lookup | None:
        """A chat's rendered text looked up in the conversation prefix cache; None when
        the cache does not serve this request (off, a completion, media, a tokenizer
        without cut points, ``add_special_tokens``)."""
        if self.prefixes is None or parsed.kind == "completion":
            return None
        tok = self.tokenizers.get(parsed.model)
        chat = _chat_of(parsed, tok)
        if (
            not isinstance(tok, HFTokenizer)
            or not tok.cuts
            or chat.get("add_special_tokens")
            or has_media(chat)
        ):
            return None
        salt = parsed.body.get("cache_salt")
        return self.prefixes.lookup(
            tok,
            tok.chat_template.render(chat),
            pool.hasher,
            lora_name=self.registry.lora_name(parsed.model) or None,
            cache_salt=salt if isinstance(salt, str) else None,
        )

    def _hash(
        self, parsed: Parsed, pool: Pool, trace: Trace | None, found: Lookup | None, t0: int
    ) -> tuple[TokenIds, list[RouterHash]]:
        """Token ids and block hashes; ``found``: the prefix cache's lookup (``_lookup``),
        which gives them together. ``t0``: when its render began, for a trace."""
        if found is not None:
            assert self.prefixes is not None  # a lookup came from it
            marks: list[int] | None = [] if trace is not None else None
            cached, hashes = self.prefixes.finish(found, marks)
            if trace is not None and marks:
                attrs = {"cache_router.prompt_tokens": len(cached)}
                trace.span("tokenize", t0, marks[0], attrs)
                blocks = {"cache_router.blocks": len(hashes)}
                trace.span("hash", marks[0], time.time_ns(), blocks)
            return cached, hashes
        t0 = time.time_ns() if trace is not None else 0  # as ever: from the thread's start
        body = parsed.body
        tok = self.tokenizers.get(parsed.model)
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        lora_name = self.registry.lora_name(parsed.model)
        if parsed.kind == "completion":
            ids, _ = tok.completion(body["prompt"], bool(body.get("add_special_tokens", True)))
        else:
            ids, _ = tok.chat(_chat_of(parsed, tok))
        hashable: int | None = None
        media: dict[int, list[Any]] | None = None
        keyed = ids  # the tokens hashed (the engine's own, once media items are expanded)
        if parsed.kind == "chat":
            hashable = tok.hashable_tokens(body)
            if hashable is not None:
                # media items: hashed through those whose identifier and placeholder run
                # the engines' events showed (router/tokens/media.py), up to the first other one
                seen = expand(tok, body, pool.ingest.media.placeholder, as_ints)
                if seen.items:
                    media = block_keys(seen.items, pool.block_size)
                    keyed, hashable = seen.tokens, seen.hashable
                    if hashable is None:  # every item keyed: the engine's whole prompt
                        ids = seen.tokens
        elif body.get("prompt_embeds") is not None:
            hashable = 0  # the engine keys these blocks by the embeddings' digest
        t1 = time.time_ns() if trace is not None else 0
        hashes = request_block_hashes(
            pool.hasher,
            keyed,
            lora_name=lora_name,
            cache_salt=salt,
            hashable_tokens=hashable,
            media_keys=media,
        )
        if trace is not None:
            trace.span("tokenize", t0, t1, {"cache_router.prompt_tokens": num_tokens(ids)})
            trace.span("hash", t1, time.time_ns(), {"cache_router.blocks": len(hashes)})
        return ids, hashes

    # -- decide ------------------------------------------------------------------
    def views(
        self,
        prep: Prepared,
        exclude: frozenset[str] | set[str] = frozenset(),
        policy: Policy | None = None,
        *,
        pruned: bool = False,
    ) -> list[WorkerView]:
        """The usable candidates as the policy sees them (index matches and load); in a
        wide pool, with ``policy`` given and willing, only those that can win
        (router/routing/prune.py): for a policy that does not weigh hits
        (``Policy.weighs_hits``), the least loaded, their matches not looked up
        (``NO_MATCH``; ``decide`` looks up the chosen one's). ``pruned``: in a wide pool
        only the candidates the board keeps whatever the policy (each hit class's and the
        non-holders' least loaded, every class kept: admission's prefix holders,
        router/admission/gate.py)."""
        return self._views(prep, exclude, policy, pruned)[0]

    def _pruner(self, pool: Pool, index: NativePrefixIndex) -> Pruner:
        pruner = self._pruners.get(pool.name)
        if pruner is None or pruner.index is not index:
            pruner = self._pruners[pool.name] = Pruner(index)
        return pruner

    def _views(
        self,
        prep: Prepared,
        exclude: frozenset[str] | set[str],
        policy: Policy | None,
        pruned: bool = False,
    ) -> tuple[list[WorkerView], bool]:
        """``views``, and whether their matches were looked up (False: none was, for a
        policy that does not weigh hits in a wide pool)."""
        now = time.monotonic()
        now_ms = now * 1000.0
        pool = prep.pool
        ingest = pool.ingest
        stale = self.cfg.load_stale_after
        groups = ingest.group_specs()
        index = pool.index
        wide = (
            PRUNING
            and isinstance(index, NativePrefixIndex)
            and index.size > PRUNE_ABOVE
            and groups is None
            and (pruned or (policy is not None and policy.prunable(prep.request)))
        )
        if wide and policy is not None and not policy.weighs_hits(prep.request):
            # its choice never reads a hit: the least loaded from the board's min trees,
            # O(log n), no walk of the index's groups and no sync state asked per group
            assert isinstance(index, NativePrefixIndex)
            pruner = self._pruner(pool, index)
            least = pruner.least(prep.workers, exclude, now, policy.must_see(prep.request))
            if least is not None:
                unmatched = [(t, NO_MATCH) for t in least]
                return (
                    _kept_views(unmatched, _NOBODY, False, now, now_ms, stale, pool.block_size),
                    False,
                )
        # the engines never count the block holding the prompt's last token as cached
        hashes = _cacheable(prep.request)
        blind = self.blind is not None and self.blind(now)
        # the workers out of sync, asked once for all candidates (one native call a core:
        # ``in_sync`` per candidate cost 0.21 us each, BENCHMARKS.md session 13)
        behind = ingest.out_of_sync()
        if wide:
            assert isinstance(index, NativePrefixIndex)
            pruner = self._pruner(pool, index)
            must = () if policy is None else policy.must_see(prep.request)
            if behind:  # no hit counts there: each is kept, as one that holds nothing
                must = [*must, *behind]
            kept = pruner.pick(prep.workers, () if blind else hashes, exclude, now, must)
            if kept is not None:
                return _kept_views(kept, behind, blind, now, now_ms, stale, pool.block_size), True
        matches = index.match_tiers(hashes) if hashes else {}
        if groups is not None and matches:
            # a hybrid model: a hit counts only as deep as every KV-cache group reuses it
            matches = clip_matches(matches, hashes, groups, index.holds, pool.block_size)
        match_of = matches.get
        block_size = pool.block_size
        view = WorkerView
        views: list[WorkerView] = []
        append = views.append
        for w in prep.workers:
            if w.id in exclude or not w.usable(now):
                continue
            # a DP rank counts this router's requests on it; the engine reports the sum
            # over its ranks, shared out evenly
            ranks = w.rank_loads
            wload = w.load
            running = waiting = kv_usage = blocks = None
            if now - wload.engine_seen <= stale:  # ``WorkerLoad.engine_fresh``, inlined
                engine = wload.engine
                # its KV cache in the pool's blocks (each rank has one of that size)
                if engine.kv_tokens:
                    blocks = engine.kv_tokens // block_size
                if ranks:
                    share = len(ranks)
                    running = _share(engine.running, share)
                    waiting = _share(engine.waiting, share)
                else:  # nothing to share out: two calls less a worker (0.1 us)
                    running, waiting = engine.running, engine.waiting
                kv_usage = engine.kv_usage
            for tid, load in w.candidates:
                if tid in exclude:
                    continue
                # ``WorkerView.of`` inlined (out of sync: no match), positional, locals bound
                # above: this runs for every candidate (views at 16 workers 34 -> 31 us,
                # BENCHMARKS.md session 11; without ``of``'s frame -0.1 us each, session 13)
                synced = not blind and tid not in behind
                tokens, ran = load.prefills.oldest(now_ms)
                append(
                    view(
                        tid, match_of(tid, NO_MATCH) if synced else NO_MATCH,
                        load.inflight_requests, load.inflight_prefill_tokens,
                        load.decode_streams, running, waiting, kv_usage, True, synced,
                        tokens, ran, blocks,
                    )
                )  # fmt: skip
        return views, True

    def _match_chosen(self, prep: Prepared, views: list[WorkerView], tid: str) -> None:
        """The chosen target's view with its match, where the policy saw none (one
        target's walk of one index group): the hit the router counts for the request
        (``hit_blocks``: its in-flight prefill, ``routed_hit_tokens``, the trace) is the
        one the full views would show. Out of sync or the event feed down: none, as there."""
        i = next((i for i, v in enumerate(views) if v.worker_id == tid), None)
        if i is None:
            return
        pool = prep.pool
        synced = not (self.blind is not None and self.blind(time.monotonic()))
        synced = synced and pool.ingest.in_sync(tid)
        index = pool.index
        hashes = _cacheable(prep.request)
        match = NO_MATCH
        if synced and hashes and isinstance(index, NativePrefixIndex):
            match = index.match_of(tid, hashes)
        views[i] = replace(views[i], match=match, in_sync=synced)

    def decide(
        self,
        prep: Prepared,
        exclude: frozenset[str] | set[str] = frozenset(),
        trace: Trace | None = None,
    ) -> tuple[Decision, list[WorkerView]]:
        """The policy's decision among usable workers; ``ApiError`` 503 when there is none."""
        t0 = time.time_ns() if trace is not None else 0
        policy = self.experiment.policy_for(prep.arm)
        views, matched = self._views(prep, exclude, policy)
        if prep.pinned is not None:
            return self._pinned(prep, prep.pinned, exclude), views
        if trace is not None:
            t1 = time.time_ns()
            trace.span("match", t0, t1, {"cache_router.candidates": len(views)})
        if not views:
            raise ApiError(
                503, f"no healthy worker for model {prep.parsed.model}", "no_healthy_worker"
            )
        try:
            decision = policy.select(prep.request, views)
        except NoWorkerError as exc:
            raise ApiError(503, str(exc), "no_healthy_worker") from exc
        if not matched:
            self._match_chosen(prep, views, decision.worker_id)
        if trace is not None:
            chosen = {"cache_router.worker": decision.worker_id,
                      "cache_router.reason": decision.reason}  # fmt: skip
            trace.span("decide", t1, time.time_ns(), chosen)
        return decision, views

    def _pinned(
        self, prep: Prepared, worker_id: str, exclude: frozenset[str] | set[str]
    ) -> Decision:
        """The engine that stored ``previous_response_id``: no other one can answer."""
        rid = prep.parsed.body.get("previous_response_id")
        worker = self.registry.get(worker_id)
        if worker is None:
            raise ApiError(
                404,
                f"Previous response with id '{rid}' was stored by engine {worker_id}, "
                "which has left the pool: start the conversation again without it.",
                "previous_response_not_found",
                "previous_response_id",
            )
        if worker_id in exclude or not worker.usable(time.monotonic()):
            raise ApiError(
                503,
                f"Previous response with id '{rid}' is stored by engine {worker_id}, "
                "which is not reachable now; retry later.",
                "previous_response_unavailable",
                "previous_response_id",
            )
        return Decision(worker_id=worker_id, reason="response affinity")

    def predict(self, prep: Prepared, worker_id: str) -> None:
        """Predict-on-route: count the prompt's blocks as cached on ``worker_id`` for
        ``predict_ttl`` seconds (here and, through ``on_predict``, on peer replicas)."""
        ttl = self.cfg.predict_ttl
        hashes = prep.request.block_hashes
        if ttl > 0 and hashes:
            prep.pool.index.predict(worker_id, hashes, ttl)
            if self.on_predict is not None:
                self.on_predict(worker_id, hashes, ttl)


def _chat_of(parsed: Parsed, tok: Tokenizer) -> dict[str, Any]:
    """The chat body the engine renders for a chat, Responses or Messages request (a
    Responses request's with the tokenizer's special tokens, as vLLM encodes it)."""
    assert parsed.messages is not None
    if parsed.kind == "chat":
        return parsed.body
    if parsed.kind == "responses":
        return prompt_chat(parsed.messages, tok)
    return {"messages": parsed.messages}


def _text_prompt(parsed: Parsed) -> bool:
    """A completions request whose one text prompt the engine would tokenize itself
    (a batch of prompts, token ids or embeddings are sent as they are)."""
    body = parsed.body
    return (
        parsed.kind == "completion"
        and isinstance(body.get("prompt"), str)
        and body.get("prompt_embeds") is None
    )


def max_tokens(body: dict[str, Any]) -> Any:
    """The completion budget: the newer field wins, as in the OpenAI API."""
    return body.get("max_completion_tokens") or body.get("max_tokens")


def _cacheable(request: RouteRequest) -> Sequence[int]:
    """The request's hashes an engine can serve from cache: never the block holding the
    prompt's last token."""
    hashes = request.block_hashes
    cap = cacheable_blocks(request.num_tokens, request.block_size)
    return hashes[:cap] if cap < len(hashes) else hashes


def _share(count: int | None, ranks: int) -> int | None:
    return count if count is None or ranks == 1 else -(-count // ranks)


_NOBODY: frozenset[str] = frozenset()


def _kept_views(
    kept: Iterable[tuple[Target, TierMatch]],
    behind: AbstractSet[str],
    blind: bool,
    now: float,
    now_ms: float,
    stale: float,
    block_size: int,
) -> list[WorkerView]:
    """The kept candidates' views (in candidate order), as the loop over every candidate
    in ``Router._views`` builds each: out of sync (``behind``, or the feed down:
    ``blind``), no match. A worker's engine numbers are read once for its ranks, which
    come one after another (a view cost ~1.2 us in a function of its own, 20 a request
    at 1,024 targets)."""
    views: list[WorkerView] = []
    append = views.append
    last = None
    running = waiting = kv_usage = blocks = None
    for (w, tid, load), match in kept:
        if w is not last:
            last = w
            wload = w.load
            if now - wload.engine_seen <= stale:
                engine = wload.engine
                running, waiting = engine.running, engine.waiting
                ranks = len(w.rank_loads)
                if ranks > 1:  # ``_share``, inlined (a call less each)
                    if running is not None:
                        running = -(-running // ranks)
                    if waiting is not None:
                        waiting = -(-waiting // ranks)
                kv_usage = engine.kv_usage
                blocks = engine.kv_tokens // block_size if engine.kv_tokens else None
            else:
                running = waiting = kv_usage = blocks = None
        synced = not blind and tid not in behind
        tokens, ran = load.prefills.oldest(now_ms)
        append(
            WorkerView(
                tid, match if synced else NO_MATCH, load.inflight_requests,
                load.inflight_prefill_tokens, load.decode_streams, running, waiting, kv_usage,
                True, synced, tokens, ran, blocks,
            )
        )  # fmt: skip
    return views


def hit_blocks(views: list[WorkerView], decision: Decision) -> int:
    """Blocks the chosen worker is expected to serve from cache (the rest is in-flight
    prefill): the policy's estimate where it knows more than the index."""
    chosen = next((v for v in views if v.worker_id == decision.worker_id), None)
    return 0 if chosen is None else expected_hit_blocks(decision, chosen)
