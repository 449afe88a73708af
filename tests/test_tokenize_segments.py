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

from router.tokens.tokenize import HFTokenizer, SegmentCache

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
