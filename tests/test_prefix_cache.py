"""The conversation prefix cache (router/tokens/prefix_cache.py) gives exactly full encoding.

Random conversations (unicode, whitespace runs, special-token text inside messages) go
turn by turn through one cache, with forks from earlier turns and edited messages; every
request's ids must equal the tokenizer's ``encode`` of the whole rendered text, and its
hashes ``request_block_hashes`` of those ids, on real templates (ChatML, Llama-2) and
Llama's SentencePiece model (the real-engine tests' conversion of mistral_common's).
"""

from __future__ import annotations

from array import array
from itertools import islice

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_files import CHATML, _write
from tokenizers import Tokenizer

from index.hashing import BlockHasher, RouterHash, request_block_hashes
from router.tokens.prefix_cache import MAX_PROBES, PrefixCache, cuts_from_end
from router.tokens.tokenize import HFTokenizer, _segments


def tokens_and_hashes(
    cache: PrefixCache,
    tok: HFTokenizer,
    text: str,
    hasher: BlockHasher,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    marks: list[int] | None = None,
) -> tuple[array[int], list[RouterHash]]:
    """A lookup and its finish in one, as the router runs them for a chat on one thread."""
    found = cache.lookup(tok, text, hasher, lora_name=lora_name, cache_salt=cache_salt)
    return cache.finish(found, marks)


def last_cuts(data: bytes, cuts: list[bytes]) -> list[int]:
    """The cut points a lookup probes (``PrefixCache`` takes at most ``MAX_PROBES``)."""
    return list(islice(cuts_from_end(data, cuts), MAX_PROBES))


def full(hf: HFTokenizer, text: str) -> list[int]:
    ids: list[int] = hf._tok.encode(text, add_special_tokens=False).ids
    return ids


PIECES = [
    *"ab cxyz\n\t.,?!'", "数字", "🙂", "ü", "e\u0301", "\u200b", "\u00a0", "  ", "\n\n", " \n",
    "▁", "<s>", "</s>", "[INST]", "<|im_end|>", "<|im_start|>", "<|im", "s>",
]  # fmt: skip
text = st.lists(st.sampled_from(PIECES), max_size=24).map("".join)
# (user, assistant) turns; then a fork: from which turn, and the message sent instead
turns = st.lists(st.tuples(text, text), min_size=1, max_size=6)
hashing = st.sampled_from([(4, False, None, None), (3, True, None, None), (5, False, "s1", "lo")])


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(system=st.none() | text, convo=turns, fork=st.integers(0, 5), edit=text, how=hashing)
def test_every_turn_and_fork_equals_full_encoding_and_hashing(
    hf: HFTokenizer,
    system: str | None,
    convo: list[tuple[str, str]],
    fork: int,
    edit: str,
    how: tuple[int, bool, str | None, str | None],
) -> None:
    block, bigram, salt, lora = how
    hasher = BlockHasher(block, seed=7, bigram=bigram)
    cache = PrefixCache(1 << 20, min_chars=0)

    def check(messages: list[dict[str, str]], gen: bool) -> str:
        rendered = hf.chat_template.render({"messages": messages, "add_generation_prompt": gen})
        marks: list[int] = []
        ids, hashes = tokens_and_hashes(
            cache, hf, rendered, hasher, lora_name=lora, cache_salt=salt, marks=marks
        )
        assert len(marks) == 1
        want = full(hf, rendered)
        assert ids.tolist() == want, rendered
        assert hashes == request_block_hashes(hasher, want, lora_name=lora, cache_salt=salt)
        return rendered

    messages: list[dict[str, str]] = (
        [] if system is None else [{"role": "system", "content": system}]
    )
    history = []
    for user, assistant in convo:
        messages.append({"role": "user", "content": user})
        history.append(list(messages))
        check(messages, True)
        check(messages, False)
        messages.append({"role": "assistant", "content": assistant})
    # a fork from an earlier turn with its last user message edited, sent twice
    branch = [*history[fork % len(history)][:-1], {"role": "user", "content": edit}]
    rendered = check(branch, True)
    hits = cache.hits
    check(branch, True)
    # sent again, it starts with its own cached prefix (the test is not vacuous)
    assert cache.hits == hits + bool(last_cuts(rendered.encode(), hf.cut_bytes))


def test_a_growing_chat_encodes_only_its_new_turns(hf: HFTokenizer) -> None:
    cache = PrefixCache(1 << 24, min_chars=0)
    hasher = BlockHasher(4)
    messages = [{"role": "system", "content": "be brief " * 40}]
    previous, hits = "", 0
    for turn in range(6):
        messages.append({"role": "user", "content": f"question {turn} " * 30})
        rendered = hf.chat_template.render({"messages": messages})
        reused, encoded = cache.tokens_reused, cache.tokens_encoded
        ids, _ = tokens_and_hashes(cache, hf, rendered, hasher)
        assert ids.tolist() == full(hf, rendered)
        cuts = last_cuts(previous.encode(), hf.cut_bytes)
        if cuts:  # the previous turn's text up to its last cut point came from the cache
            kept = len(full(hf, previous.encode()[: cuts[0]].decode()))
            assert cache.tokens_reused - reused == kept > 0
            assert cache.tokens_encoded - encoded == len(ids) - kept
            hits += 1
        assert cache.hits == hits
        previous = rendered
        messages.append({"role": "assistant", "content": f"answer {turn} " * 30})
    assert hits >= 4 and cache.misses == 6 - hits  # Llama-2's first turn has no cut point


def chat(hf: HFTokenizer, first: str, *more: str) -> str:
    """A rendered chat of user/assistant turns (two at least: Llama-2 writes its first
    cut point after the first reply)."""
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": t} for i, t in enumerate((first, "fine", *more))]
    return hf.chat_template.render({"messages": messages})


def test_bounded_in_bytes_and_superseded_prefixes_go_first(hf: HFTokenizer) -> None:
    hasher = BlockHasher(4)
    probe = PrefixCache(1 << 30, min_chars=0)
    tokens_and_hashes(probe, hf, chat(hf, "hello there " * 20, "ok"), hasher)
    size = probe.bytes  # one turn's entry
    cache = PrefixCache(size * 3, min_chars=0)
    for i in range(10):  # distinct conversations: the oldest are dropped
        tokens_and_hashes(cache, hf, chat(hf, f"hello there {i} " * 20, "ok"), hasher)
        assert cache.bytes <= cache.max_bytes
    assert cache.evictions > 0 and 0 < len(cache) <= 3
    # a conversation's second turn extends its first: the first is next to go, before
    # another conversation's newer entry
    cache = PrefixCache(size * 10, min_chars=0)
    tokens_and_hashes(cache, hf, chat(hf, "hello there " * 20, "ok"), hasher)
    tokens_and_hashes(cache, hf, chat(hf, "another one " * 20, "ok"), hasher)
    tokens_and_hashes(cache, hf, chat(hf, "hello there " * 20, "ok", "fine", "and?"), hasher)
    assert cache.hits == 1 and len(cache) == 3
    oldest, *_, newest = cache._lru.values()
    assert len(oldest.ids) < len(newest.ids)
    assert oldest.ids.tolist() == newest.ids[: len(oldest.ids)].tolist()  # its prefix


def test_a_prefix_larger_than_the_cache_is_not_kept(hf: HFTokenizer) -> None:
    cache = PrefixCache(64, min_chars=0)
    rendered = chat(hf, "hello there " * 20, "ok")
    ids, _ = tokens_and_hashes(cache, hf, rendered, BlockHasher(4))
    assert ids.tolist() == full(hf, rendered) and len(cache) == 0 and cache.bytes == 0


@given(st.lists(st.sampled_from(["a", "数", "<s>", "</s>", "<|im_start|>", " "]), max_size=40))
def test_last_cuts_are_the_segment_starts_in_bytes(parts: list[str]) -> None:
    cuts = ["<s>", "</s>", "<|im_start|>"]
    s = "".join(parts)
    starts = [len(p.encode()) for p in _segments(s, cuts)]
    bounds = [sum(starts[:i]) for i in range(1, len(starts))]
    found = last_cuts(s.encode(), [t.encode() for t in cuts])
    assert found == sorted(bounds, reverse=True)[: len(found)]
    assert len(found) == min(len(bounds), 64)


def test_metrics_count_hits_misses_and_tokens(hf: HFTokenizer) -> None:
    cache = PrefixCache(1 << 20, min_chars=0)
    for _ in range(2):
        tokens_and_hashes(cache, hf, chat(hf, "hello there", "ok"), BlockHasher(4))
    got = {m.name: m.samples[0].value for m in cache.collect()}
    assert got["cache_router_prefix_cache_hits"] == 1
    assert got["cache_router_prefix_cache_misses"] == 1
    assert got["cache_router_prefix_cache_tokens_reused"] > 0
    assert got["cache_router_prefix_cache_entries"] == 1
    assert got["cache_router_prefix_cache_bytes"] == cache.bytes > 0


def test_an_added_token_that_could_overlap_a_cut_disables_it(tmp_path) -> None:
    from tokenizers import AddedToken, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "x<|im")]
    )
    hf = HFTokenizer(_write(tmp_path, tok, CHATML))
    assert "<|im_start|>" not in hf.cuts  # "x<|im" would take the cut's first bytes
    rendered = "x<|im_start|>a"
    ids, _ = tokens_and_hashes(PrefixCache(1 << 20, min_chars=0), hf, rendered, BlockHasher(1))
    assert ids.tolist() == full(hf, rendered)


def test_ids_array_is_a_copy_the_cache_does_not_share(hf: HFTokenizer) -> None:
    cache = PrefixCache(1 << 20, min_chars=0)
    rendered = chat(hf, "hi " * 30, "ok")
    ids, _ = tokens_and_hashes(cache, hf, rendered, BlockHasher(4))
    assert isinstance(ids, array)
    ids[0] = 0  # a caller changing its ids must not change the next request's
    again, _ = tokens_and_hashes(cache, hf, rendered, BlockHasher(4))
    assert again.tolist() == full(hf, rendered)


def test_short_chats_skip_the_cache(hf: HFTokenizer) -> None:
    cache = PrefixCache(1 << 20)  # the default min_chars
    rendered = chat(hf, "hello there", "ok")
    assert len(rendered) < cache.min_chars
    for _ in range(2):
        marks: list[int] = []
        ids, hashes = tokens_and_hashes(cache, hf, rendered, BlockHasher(4), marks=marks)
        assert len(marks) == 1  # when the tokens were ready (a trace's tokenize span)
        assert ids.tolist() == full(hf, rendered)
        assert hashes == request_block_hashes(BlockHasher(4), full(hf, rendered))
    assert cache.hits == cache.misses == len(cache) == 0


async def test_the_router_serves_turn_two_from_the_cache_and_matches_the_engine(
    request, tmp_path, nats_url
) -> None:
    """End to end: the engine (same tokenizer) reports turn one's blocks; turn two's
    hashes, built on turn one's cached prefix, match them; the metrics count it."""
    import httpx
    from stack import EngineDouble, Served, until

    from router.config import RouterConfig, WorkerSpec
    from router.http.app import RouterApp

    folder = _write(tmp_path / "tok", request.getfixturevalue("spm"), CHATML)
    tok = HFTokenizer(folder)
    engine = await EngineDouble("w0", nats_url=nats_url, tokenizer=tok).start()
    cfg = RouterConfig(
        nats_url=nats_url,
        block_size=4,
        tokenizer=str(folder),
        admin_token="t",
        workers=[WorkerSpec("w0", engine.url, model="m")],
    )
    app = RouterApp(cfg)
    served = await Served(app).start()
    one = [
        {"role": "system", "content": "you route requests to engines. " * 80},
        {"role": "user", "content": "which engine holds my prefix? 数字 🙂"},
    ]
    two = [*one, {"role": "assistant", "content": "the first"}, {"role": "user", "content": "ok"}]
    try:
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
            r = await http.post("/v1/chat/completions", json={"model": "m", "messages": one})
            assert r.status_code == 200
            ingest = app.state.registry.pools["default"].ingest
            await until(lambda: ingest.last_seq("w0") == engine.seq, what="events applied")
            r = await http.post("/v1/chat/completions", json={"model": "m", "messages": two})
            assert r.status_code == 200
            r = await http.post(
                "/admin/explain",
                json={"model": "m", "messages": two},
                headers={"authorization": "Bearer t"},
            )
            out = r.json()
            metrics = (await http.get("/metrics")).text
    finally:
        await served.stop()
        await engine.stop()
    text_one = tok.chat_template.render({"messages": one})
    text_two = tok.chat_template.render({"messages": two})
    assert out["num_tokens"] == len(full(tok, text_two))
    cut = last_cuts(text_one.encode(), tok.cut_bytes)[0]
    common = len(full(tok, text_one.encode()[:cut].decode()))
    assert out["workers"][0]["match"]["total"] >= common // 4 > 0
    assert "cache_router_prefix_cache_hits_total 2.0" in metrics
    assert "cache_router_prefix_cache_misses_total 1.0" in metrics
