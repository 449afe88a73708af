"""The engine cache model against a plain list-based reference, plus its KV events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.backend import make_ingest
from index.codec import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode
from index.hashing import BlockHasher
from index.prefix_index import PrefixIndex
from sim.cache import CacheFullError, PrefixCache, engine_block_hashes

BS = 4


class RefCache:
    """Obviously-correct model: lists in LRU order, linear scans everywhere."""

    def __init__(self, gpu_blocks: int, host_blocks: int) -> None:
        self.cap, self.host_cap = gpu_blocks, host_blocks
        self.gpu: dict[int, int] = {}  # hash -> refs
        self.lru: list[int] = []  # unreferenced gpu hashes, oldest first
        self.host: list[int] = []  # oldest first
        self.private = 0
        self.reqs: dict[str, dict] = {}
        self.parent: dict[int, int | None] = {}  # chained hashes: a block's parent is fixed

    def used(self) -> int:
        return len(self.gpu) + self.private

    def evict(self, n: int) -> None:
        for _ in range(n):
            h = self.lru.pop(0)
            del self.gpu[h]
            p = self.parent[h]
            if (
                self.host_cap
                and h not in self.host
                and (p is None or p in self.gpu or p in self.host)
            ):
                self.put_host(h)

    def put_host(self, h: int) -> None:
        p = self.parent[h]
        if p in self.host:
            self.host.remove(p)
            self.host.append(p)
        if len(self.host) >= self.host_cap:
            self.host.pop(0)
        self.host.append(h)

    def pin(self, h: int) -> None:
        if self.gpu[h] == 0:
            self.lru.remove(h)
        self.gpu[h] += 1

    def learn(self, hashes: list[int]) -> None:
        for i, h in enumerate(hashes):
            self.parent[h] = hashes[i - 1] if i else None

    def allocate(self, rid: str, hashes: list[int], n_tokens: int, reserve: int):
        total = -(-(n_tokens + reserve) // BS)
        if total > self.cap:
            return "full"
        cap = min(len(hashes), max(0, (n_tokens - 1) // BS))
        run = 0
        while run < cap and (hashes[run] in self.gpu or hashes[run] in self.host):
            run += 1
        in_gpu = [h for h in hashes[:run] if h in self.gpu]
        need = total - len(in_gpu)
        free = self.cap - self.used()
        if need > free + len(self.lru) - sum(1 for h in in_gpu if self.gpu[h] == 0):
            return None
        for h in in_gpu:
            self.pin(h)
        self.evict(max(0, need - free))
        loaded = 0
        for h in hashes[:run]:
            if h not in self.gpu:
                self.gpu[h] = 1
                if h in self.host:  # the demotions above may have pushed it out already
                    self.host.remove(h)
                    self.host.append(h)
                loaded += 1
        self.private += total - run
        self.reqs[rid] = {"hashes": hashes, "pinned": list(hashes[:run]), "private": total - run}
        return (run - loaded, loaded, total - run)

    def commit(self, rid: str, n_computed: int) -> None:
        r = self.reqs[rid]
        upto = min(len(r["hashes"]), n_computed // BS)
        for h in r["hashes"][len(r["pinned"]) : upto]:
            if h in self.gpu:
                self.pin(h)
            else:
                self.gpu[h] = 1
            r["pinned"].append(h)
            r["private"] -= 1
            self.private -= 1

    def release(self, rid: str) -> None:
        r = self.reqs.pop(rid)
        for h in reversed(r["pinned"]):
            self.gpu[h] -= 1
            if self.gpu[h] == 0:
                self.lru.append(h)
        self.private -= r["private"]

    def prefetch(self, hashes: list[int], n_tokens: int) -> int:
        placed = 0
        for h in hashes[: n_tokens // BS]:
            if h in self.gpu or h in self.host:
                continue
            if self.host_cap:
                self.put_host(h)
            else:
                p = self.parent[h]
                if p in self.lru:
                    self.lru.remove(p)
                    self.lru.append(p)
                if self.used() >= self.cap:
                    if not self.lru or self.lru[0] == p:
                        break
                    self.evict(1)
                self.gpu[h] = 0
                self.lru.append(h)
            placed += 1
        return placed


def prompt(prefix: int, length: int) -> list[int]:
    """Prompts that share leading tokens when they share ``prefix``."""
    return [prefix * 1000 + i for i in range(length)]


class EventState:
    """What a consumer of the events believes each tier holds."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[int]] = {"GPU": set(), "CPU": set()}

    def apply(self, events: list) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                # A consumer can chain every stored block to one it already knows.
                known = self.tiers["GPU"] | self.tiers["CPU"]
                assert e.parent_block_hash is None or e.parent_block_hash in known
                self.tiers[e.medium].update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.tiers[e.medium]
                self.tiers[e.medium].difference_update(e.block_hashes)
            else:
                assert isinstance(e, AllBlocksCleared)
                for s in self.tiers.values():
                    s.clear()


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "commit", "release", "prefetch"]),
        st.integers(0, 3),  # prompt family
        st.integers(1, 30),  # prompt length
        st.integers(0, 8),  # reserve tokens / request pick
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, gpu=st.integers(2, 12), host=st.sampled_from([0, 3, 8]))
def test_cache_matches_reference_model(ops, gpu, host) -> None:
    cache, ref, seen = PrefixCache(BS, gpu, host), RefCache(gpu, host), EventState()
    live: list[str] = []
    for n, (op, fam, length, extra) in enumerate(ops):
        tokens = prompt(fam, length)
        hashes = cache.hash_blocks(tokens)
        ref.learn(hashes)
        if op == "alloc":
            rid = f"r{n}"
            try:
                got = cache.allocate(rid, tokens, reserve_tokens=extra)
            except CacheFullError:
                got = "full"
            want = ref.allocate(rid, hashes, length, extra)
            if got not in (None, "full"):
                got = (got.gpu_hit_blocks, got.host_hit_blocks, got.new_blocks)
                live.append(rid)
            assert got == want
        elif op == "commit" and live:
            rid = live[extra % len(live)]
            cache.commit(rid, length)
            ref.commit(rid, length)
        elif op == "release" and live:
            rid = live.pop(extra % len(live))
            cache.release(rid)
            ref.release(rid)
        elif op == "prefetch":
            assert cache.prefetch(tokens) == ref.prefetch(hashes, length)
        assert cache.gpu_used == ref.used() <= gpu
        assert cache.host_used == len(ref.host) <= host
        assert cache.gpu_hashes() == set(ref.gpu)
        assert cache.host_hashes() == set(ref.host)
        seen.apply(cache.drain_events())
        assert seen.tiers["GPU"] == cache.gpu_hashes()
        assert seen.tiers["CPU"] == cache.host_hashes()


def test_engine_hashes_are_a_seeded_chain() -> None:
    tokens = list(range(12))
    a = engine_block_hashes(tokens, 4, seed=1)
    assert len(a) == 3
    assert engine_block_hashes(tokens[:8], 4, seed=1) == a[:2]
    assert engine_block_hashes(tokens[8:], 4, seed=1, parent=a[1]) == a[2:]
    assert engine_block_hashes(tokens, 4, seed=2) != a
    # Not the router's xxh3 chain.
    assert set(a).isdisjoint(BlockHasher(4, seed=1).hash_tokens(tokens))


def test_hit_never_covers_the_last_token_and_too_big_raises() -> None:
    cache = PrefixCache(BS, 8)
    tokens = prompt(0, 8)
    cache.allocate("a", tokens)
    cache.commit("a", 8)
    cache.release("a")
    again = cache.allocate("b", tokens)
    assert again is not None and again.gpu_hit_blocks == 1  # (8 - 1) // 4
    with pytest.raises(CacheFullError):
        cache.allocate("c", prompt(1, 40))
    with pytest.raises(ValueError):
        cache.allocate("b", tokens)


def test_host_tier_demotes_and_reloads() -> None:
    cache = PrefixCache(BS, 3, host_blocks=4)
    first = prompt(0, 9)  # 2 full blocks + 1 partial page
    cache.allocate("a", first)
    cache.commit("a", 9)
    cache.release("a")
    other = prompt(1, 9)
    assert cache.allocate("b", other) is not None  # evicts both blocks of "a" to host
    assert cache.lookup(cache.hash_blocks(first)) == (0, 2)
    cache.commit("b", 9)
    cache.release("b")
    back = cache.allocate("c", first)
    assert back is not None and (back.gpu_hit_blocks, back.host_hit_blocks) == (0, 2)


def test_events_through_codec_and_ingest_match_the_cache() -> None:
    """The real path: cache events -> msgpack -> EventIngest -> PrefixIndex."""
    cache = PrefixCache(BS, 10, host_blocks=6, seed=7)
    index = PrefixIndex()
    hasher = BlockHasher(BS)
    ingest = make_ingest(index, hasher)
    seq = 0
    prompts = [prompt(f % 3, 6 + 4 * f) for f in range(8)]
    for n, tokens in enumerate(prompts):
        rid = f"r{n}"
        if cache.allocate(rid, tokens) is None:
            continue
        cache.commit(rid, len(tokens))
        cache.release(rid)
        payload = encode(EventBatch(ts=float(n), events=cache.drain_events()))
        result = ingest.apply("w0", seq, payload)
        seq += 1
        assert not result.errors
    for tokens in prompts:
        gpu, host = cache.lookup(cache.hash_blocks(tokens))
        match = index.match_tiers(hasher.hash_tokens(tokens)).get("w0")
        got = (match.gpu, match.cpu - match.gpu) if match else (0, 0)
        assert got == (gpu, host)


def test_clear_drops_everything_once_no_request_holds_pages() -> None:
    cache = PrefixCache(BS, 8, host_blocks=4)
    tokens = prompt(0, 12)
    cache.allocate("a", tokens)
    cache.commit("a", 12)
    with pytest.raises(RuntimeError):
        cache.clear()
    cache.release("a")
    cache.prefetch(prompt(1, 8))
    cache.drain_events()
    cache.clear()
    assert cache.drain_events() == [AllBlocksCleared()]
    assert cache.gpu_used == cache.host_used == 0
    assert cache.lookup(cache.hash_blocks(tokens)) == (0, 0)
