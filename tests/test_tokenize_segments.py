"""Chats encoded by segments (router/tokens/tokenize.py ``SegmentCache``) equal full encoding.

A conversation grows turn by turn through one tokenizer, so later turns take their
earlier segments from the cache; every turn's ids must equal ``encode`` of the whole
rendered text. Real chat templates (ChatML, Llama-2's ``[INST]``) on real tokenizers:
Llama's SentencePiece model (the one PyPI's ``mistral_common`` ships, converted as the
real-engine tests do) and a byte-level BPE.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers

from router.tokens.tokenize import (
    HFTokenizer,
    SegmentCache,
    _segments,
    _word_cut_mode,
    _word_pieces,
)

PIECES = [*"ab cxyz\n\t.,?!'", "数字", "🙂", "ü", "  ", "<s>", "</s>", "[INST]", "<|im_end|>"]
text = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)
turns = st.lists(st.tuples(text, text), min_size=1, max_size=6)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(system=st.none() | text, convo=turns)
def test_every_turn_of_a_growing_chat_equals_full_encoding(
    hf: HFTokenizer, system: str | None, convo: list[tuple[str, str]]
) -> None:
    messages: list[dict[str, str]] = (
        [] if system is None else [{"role": "system", "content": system}]
    )
    for user, assistant in convo:
        messages.append({"role": "user", "content": user})
        for gen in (True, False):
            body = {"messages": messages, "add_generation_prompt": gen}
            ids, rendered = hf.chat(body)
            assert ids == hf._tok.encode(rendered, add_special_tokens=False).ids, rendered
        messages.append({"role": "assistant", "content": assistant})


def test_templates_cut_where_they_write_special_tokens(hf: HFTokenizer) -> None:
    assert hf.cuts, "no cut token: the segment path would never run"
    convo = [{"role": "user", "content": "hello there " * 50}]
    hf.chat({"messages": convo})
    hits = hf.segments.hits
    convo += [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "and?"}]
    hf.chat({"messages": convo})
    assert hf.segments.hits > hits  # the second turn reused the first turn's segments


def test_segment_cache_is_bounded_in_tokens() -> None:
    from array import array

    cache = SegmentCache(max_tokens=10)
    for key in range(5):
        cache.put(key, array("I", range(4)))
    assert cache.tokens <= 10 and cache.get(0) is None and cache.get(4) is not None
    cache.put(99, array("I", range(11)))  # larger than the whole cache: not kept
    assert cache.get(99) is None


def test_get_many_counts_and_refreshes_each_key_as_get_does() -> None:
    from array import array

    cache = SegmentCache(max_tokens=8)
    cache.put(1, array("I", [1, 2, 3]))
    cache.put(2, array("I", [4, 5, 6]))
    got = cache.get_many([1, 3, 1])
    assert [None if ids is None else ids.tolist() for ids in got] == [[1, 2, 3], None, [1, 2, 3]]
    assert (cache.hits, cache.misses) == (2, 1)
    cache.put(3, array("I", [7, 8, 9]))  # over 8 tokens: the least recently used (2) goes
    assert cache.get(2) is None and cache.get(1) is not None and cache.get(3) is not None


# Words and the characters a cut must not break around: runs of spaces, tabs and new lines,
# the ``▁`` SentencePiece writes for a space, non-ASCII letters, special tokens.
WORDS = ["a", "cache", "router", "Hello", "b", "数字", "ü", "🙂", "x1", ",", "."]
SEPS = [" ", " ", " ", "  ", "\t", "\n", " \n", "\u2581", "", "<s>", "</s>", "<|im_end|>",
        " <s> ", " </s>", "<|im_end|> ", " <|im_start|>", " <unk> "]  # fmt: skip
long_text = st.lists(st.tuples(st.sampled_from(WORDS), st.sampled_from(SEPS)), max_size=60).map(
    lambda ws: "".join(w + s for w, s in ws)
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=long_text, chunk=st.integers(1, 40))
def test_word_pieces_encode_as_the_whole_text(hf: HFTokenizer, text: str, chunk: int) -> None:
    """Cut at every chunk the rule allows (``chunk`` 1: at every allowed space), the pieces
    encoded alone and joined are the whole text's encoding, on each tokenizer family."""
    assert hf.word_cuts is not None  # both test tokenizers are proven at load
    for segment in _segments(text, hf.cuts):
        pieces = _word_pieces(segment, hf.word_cuts, chunk)
        encoded = hf._tok.encode_batch_fast(pieces, add_special_tokens=False)
        joined = [i for e in encoded for i in e.ids]
        assert joined == hf._tok.encode(segment, add_special_tokens=False).ids, pieces


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shared=st.lists(st.sampled_from(WORDS[:5]), min_size=300, max_size=700).map(" ".join),
    tails=st.lists(long_text, min_size=2, max_size=4),
    system=st.booleans(),
)
def test_conversations_sharing_a_long_prefix_reuse_it_exactly(
    hf: HFTokenizer, shared: str, tails: list[str], system: bool
) -> None:
    """New conversations that begin with the same long text (a system prompt, an agent's
    history sent as one message) take its pieces from the segment cache; every request's
    ids still equal ``encode`` of the whole rendered text."""
    hits = hf.segments.hits
    for tail in tails:
        if system:
            messages = [
                {"role": "system", "content": shared},
                {"role": "user", "content": tail},
            ]
        else:
            messages = [{"role": "user", "content": shared + tail}]
        ids, rendered = hf.chat({"messages": messages})
        assert ids == hf._tok.encode(rendered, add_special_tokens=False).ids, rendered
    assert hf.segments.hits > hits


def test_word_cuts_need_a_proven_tokenizer(spm: Tokenizer, byte_bpe: Tokenizer) -> None:
    """Only the two proven families are cut by words: a normalizer that changes what a
    cut sees (lowercase before the SentencePiece rules), or a byte-level pre-tokenizer
    that adds a space to every piece, turn them off."""
    drop, keep = _word_cut_mode(spm), _word_cut_mode(byte_bpe)
    assert drop is not None and drop.mode == "drop" and keep is not None and keep.mode == "keep"
    other = Tokenizer.from_str(spm.to_str())
    other.normalizer = normalizers.Sequence(
        [normalizers.Lowercase(), normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    assert _word_cut_mode(other) is None
    whole = Tokenizer.from_str(spm.to_str())
    whole.model.ignore_merges = True  # a piece in the vocabulary taken as one token
    assert _word_cut_mode(whole) is None
    spaced = Tokenizer.from_str(byte_bpe.to_str())
    spaced.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert _word_cut_mode(spaced) is None
    stripped = Tokenizer.from_str(byte_bpe.to_str())
    stripped.add_special_tokens([AddedToken("<mask>", special=True, lstrip=True)])
    assert _word_cut_mode(stripped) is None
