"""Regression tests for what the first fuzz campaign of the native parsers found (issue 32,
item 4), each through the Python binding (the fuzz targets themselves: fuzz/run.sh).

Work the core must not do is checked by its own count of full scans (``Core.scans``),
never by a clock: a clear of a worker that holds nothing scans nothing, and an eviction
of a chain is one scan, not one per block.
"""

from __future__ import annotations

import asyncio
import ctypes
import subprocess
import sys
import threading

import msgpack
import pytest

from index import (
    AllBlocksCleared,
    BlockHasher,
    BlockStored,
    EventBatch,
    EventIngest,
    PrefixIndex,
    encode,
)
from index.backend import NATIVE, NativePrefixIndex

pytestmark = pytest.mark.skipif(not NATIVE, reason="native core not built")

B = 4
MASK = (1 << 64) - 1


def _chain_events(n: int, start: int, *, size: int = B, per_event: int = 64) -> list[object]:
    """A chain of ``n`` engine blocks of ``size`` tokens, ``per_event`` blocks a store."""
    out: list[object] = []
    parent = None
    for first in range(0, n, per_event):
        hashes = list(range(start + first, start + min(n, first + per_event)))
        tokens = [(start + i) % 50_000 for i in range(len(hashes) * size)]
        out.append(BlockStored(hashes, parent, tokens, size, medium="GPU"))
        parent = hashes[-1]
    return out


def _ingest(index: object, **kw: int) -> EventIngest:
    return EventIngest(index, BlockHasher(B), **kw)  # type: ignore[arg-type]


# -- AllBlocksCleared spam --------------------------------------------------------------


def test_clears_of_a_worker_that_holds_nothing_scan_nothing() -> None:
    """58,000 clears in one batch for an empty worker held the mutex for 47 s at 410K
    blocks (each scanned the whole core); now each costs O(1), and a worker that stored a
    little between clears pays for what it stored, never for the other workers'."""
    index = NativePrefixIndex()
    ingest = _ingest(index)
    for seq, event in enumerate(_chain_events(20_000, 1, per_event=1000)):
        assert ingest.apply("big", seq, encode(EventBatch(0.0, [event], None))).applied == 1
    core, _ = index.locate("big")
    spam = encode(EventBatch(0.0, [AllBlocksCleared()] * 50_000, None))
    assert ingest.apply("idle", 0, spam).applied == 50_000
    # stores and clears in turn: each clear walks the few blocks stored before it
    churn = [e for i in range(500) for e in (*_chain_events(2, 10**6 + 2 * i), AllBlocksCleared())]
    assert ingest.apply("idle", 1, encode(EventBatch(0.0, churn, None))).applied == 1000
    assert core.scans() == (0, 0)
    assert index.match(BlockHasher(B).hash_tokens([i % 50_000 for i in range(1, 9)])) == {
        "big": 2
    }
    assert index.stats().workers["idle"]["gpu"] == 0


def test_a_clear_past_the_log_scans_once_and_equals_the_python_index() -> None:
    """Past 8,192 blocks since its last clear a worker's clear scans the core, once; the
    blocks, holes and matches after it are the Python index's."""
    hasher = BlockHasher(B)
    py_index, nat_index = PrefixIndex(), NativePrefixIndex()
    ingests = [_ingest(py_index), _ingest(nat_index)]
    shared = _chain_events(300, 1)
    own = _chain_events(9_000, 10**6)
    branch = [BlockStored([7 * 10**6], 5, [1, 2, 3, 4], B, medium="GPU")]
    for ing in ingests:
        a = [*shared, *own, *branch, AllBlocksCleared()]
        for worker, events in (("b", shared), ("a", a)):
            for seq, ev in enumerate(events):
                assert ing.apply(worker, seq, encode(EventBatch(0.0, [ev], None))).applied == 1
    core, _ = nat_index.locate("a")
    assert core.scans() == (1, 0)
    queries = [hasher.hash_tokens([(1 + i) % 50_000 for i in range(300 * B)])]
    for index in (py_index, nat_index):
        assert len(index) == 300
        assert index.stats().workers["a"] == {"gpu": 0, "cpu": 0, "disk": 0, "shared": 0}
        assert index.stats().workers_with_holes == 0
    assert [nat_index.match(q) for q in queries] == [py_index.match(q) for q in queries]


# -- eviction and the per-worker quota ------------------------------------------------------


def test_evicting_a_chain_is_one_scan_not_one_per_block() -> None:
    """A chain has one leaf: the eviction took the leaves of the moment and rescanned, so
    a worker past the bound with a chain cost O(excess x N)."""
    index = NativePrefixIndex(max_blocks=1000)
    index.store("w", list(range(1, 3001)))
    core, _ = index.locate("w")
    assert core.scans() == (0, 1)
    assert len(index) == 900
    assert index.match(list(range(1, 901))) == {"w": 900}  # the chain's head is kept


@pytest.mark.parametrize("Index", [PrefixIndex, NativePrefixIndex])
def test_eviction_takes_the_least_recently_used_chain_from_its_leaf(Index: type) -> None:
    """A parent left a leaf by the eviction joins the candidates at once: the stale
    chain goes, tail first, and the fresh chains keep their leaves (the rounds took
    every leaf of the moment, the fresh ones' too)."""
    index = Index(max_blocks=100, bisect_min_blocks=10**9)  # a match touches every block
    index.store("a", list(range(1, 51)))
    index.store("b", list(range(1000, 1040)))
    index.match(list(range(1, 51)))  # a's chain is the more recently used
    index.store("c", list(range(2000, 2030)))  # 120 blocks: down to 90
    assert len(index) == 90 and index.stats().workers_with_holes == 0
    stats = index.stats().workers
    assert (stats["a"]["gpu"], stats["b"]["gpu"], stats["c"]["gpu"]) == (50, 10, 30)


def test_the_quota_counts_router_blocks_for_coarse_engine_blocks() -> None:
    """A coarse engine block (vLLM 0.33's coarser KV group) is k router blocks: the quota
    counted it as one, so a worker held k times its share. Native and Python agree."""
    seen = []
    for index in (PrefixIndex(), NativePrefixIndex()):
        ingest = _ingest(index, max_worker_blocks=100)
        coarse = _chain_events(60, 1, size=4 * B, per_event=10)  # 240 router blocks
        results = [
            ingest.apply("w", seq, encode(EventBatch(0.0, [ev], None)))
            for seq, ev in enumerate(coarse)
        ]
        assert index.stats().workers["w"]["gpu"] == 100  # 40 + 40 + a store cut to 20
        seen.append(([(r.applied, dict(r.errors)) for r in results], dict(ingest.errors)))
    assert seen[0] == seen[1]
    assert seen[0][1]["worker_quota"] == 1


# -- the decoder ------------------------------------------------------------------------


def test_a_million_bad_events_are_counted_without_an_exception_each() -> None:
    """1M ``nil`` events in a 1 MB batch: each a bad event, counted (an exception each
    cost 2.65 s of the reader's thread)."""
    core = NativePrefixIndex()._core(0)
    parsed = core.parse(msgpack.packb([0.0, [None] * 1_000_000, None]))
    assert parsed.errors == {"bad_event": 1_000_000} and parsed.num_events == 0


def _rss() -> int:
    """Resident bytes once malloc gave back what is free (only what is kept counts)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_the_parsers_scratch_is_given_back_after_a_huge_batch() -> None:
    """The per-thread scratch grew by ~49 MB for a 1 MB batch of tiny values and kept it
    while the thread lived (the reader's lives as long as the router): parsed here on a
    thread of its own, whose scratch starts empty, and measured while it is alive."""
    core = NativePrefixIndex()._core(0)
    payload = msgpack.packb([0.0, [[0]] * 500_000, None])
    grown: list[int] = []

    def parse() -> None:
        before = _rss()
        core.parse(payload)
        grown.append(_rss() - before)

    thread = threading.Thread(target=parse)
    thread.start()
    thread.join()
    assert grown[0] < 8 << 20  # the scratch was ~24 MB


def test_the_table_hash_is_keyed_per_process() -> None:
    """Engine hashes a publisher picks so that MurmurHash3's finalizer (the tables' old,
    public slot hash) maps them to one home spread like any others now, and another
    process gets another key."""
    from index import _native

    def fmix_inverse(h: int) -> int:  # MurmurHash3 fmix64, run backwards
        h ^= h >> 33
        h = h * 0x9CB4B2F8129337DB & MASK  # inverse of 0xC4CEB9FE1A85EC53
        h ^= h >> 33
        h = h * 0x4F74430C22A54005 & MASK  # inverse of 0xFF51AFD7ED558CCD
        h ^= h >> 33
        return h

    crafted = [fmix_inverse(i) for i in range(40_000)]  # old homes: all slot 0
    slots = 1 << 16
    load: dict[int, int] = {}
    for k in crafted:
        home = (_native.table_hash(k) * slots) >> 64
        load[home] = load.get(home, 0) + 1
    assert max(load.values()) < 12
    other = subprocess.run(
        [sys.executable, "-c", "from index import _native; print(_native.table_hash(1))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(other.stdout) != _native.table_hash(1)
    # and a worker storing them keeps them all, exactly
    index = NativePrefixIndex()
    ingest = _ingest(index)
    tokens = list(range(B))
    events = [BlockStored([k], None, tokens, B, medium="GPU") for k in crafted[:5000]]
    assert ingest.apply("w", 0, encode(EventBatch(0.0, events, None))).applied == 5000
    assert set(ingest.engine_blocks("w")) == set(crafted[:5000])


# -- sequence numbers at the edge of int64 --------------------------------------------------


def test_after_a_dump_at_the_last_int64_seq_both_ingests_expect_two_to_the_63() -> None:
    """``last + 1`` overflowed natively (UBSan); Python's ints go on to 2**63."""
    got = []
    for index in (PrefixIndex(), NativePrefixIndex()):
        ingest = _ingest(index)
        dump = ingest.load_dump("w", 2**63 - 1, [])
        live = ingest.apply("w", 5, encode(EventBatch(0.0, [AllBlocksCleared()], None)))
        got.append((dump.expected_seq, live.status, live.expected_seq, ingest.in_sync("w")))
    assert got[0] == got[1]
    assert got[0][2] == 2**63


# -- the native reader against a real nats-server -------------------------------------------


async def _publish_raw(port: int, line: bytes, payload: bytes) -> bool:
    """One PUB on its own connection: whether nats-server took it (PONG, not -ERR)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await reader.readline()  # INFO
        writer.write(b'CONNECT {"verbose":false,"pedantic":false}\r\n' + line + payload)
        writer.write(b"\r\nPING\r\n")
        await writer.drain()
        reply = await asyncio.wait_for(reader.readline(), 5)
        return reply.startswith(b"PONG")
    finally:
        writer.close()


async def test_a_pub_line_at_the_servers_limit_does_not_disconnect_the_reader(
    nats_url: str,
) -> None:
    """A PUB line of 4,091-4,096 bytes passes nats-server's max_control_line; the MSG
    line it forwards is longer by the sid: the reader called it a protocol error,
    reconnected and put every worker out of sync (79 times in 5 s from one publisher)."""
    from test_native_events import has, reader, records

    port = int(nats_url.rsplit(":", 1)[1])
    r = reader(port)
    r.start()
    try:
        await records(r, has(2))  # subscribed
        taken = []
        for length in range(4080, 4101):
            subject = b"kv.events." + b"w" * (length - len("PUB kv.events.") - len(" 2\r\n"))
            line = b"PUB %s 2\r\n" % subject
            assert len(line) == length
            if await _publish_raw(port, line, b"hi"):
                taken.append(subject.decode())
        assert len(taken) >= 10  # the server took lines up to its limit
        assert await _publish_raw(port, b"PUB kv.events.after 2\r\n", b"ok")
        got = await records(r, lambda got: any(rec[1] == "kv.events.after" for rec in got))
        assert not any(rec[0] in (3, 4) for rec in got)  # no lost session, no failure
        assert {rec[1] for rec in got if rec[0] == 0} == {*taken, "kv.events.after"}
        assert r.up and r.stats()["oversized"] == 0
    finally:
        r.close()


async def test_a_msg_line_past_the_readers_bound_is_skipped_not_a_disconnect(
    nats_url: str,
) -> None:
    """A MSG line longer than max_control plus the framing (a server configured with a
    larger max_control_line) still says its size: the message is skipped, its worker
    named for a resync, and the connection and every other worker stay as they were."""
    from test_native_events import has, records

    from index import _native

    port = int(nats_url.rsplit(":", 1)[1])
    r = _native.EventReader(
        [("127.0.0.1", port)],
        "kv.events.>",
        "kv.events.",
        "",
        "",
        "",
        "test",
        connect_timeout=2.0,
        ping_interval=0.5,
        max_control=256,
        max_payload=1 << 20,
        max_queued=100,
        max_queued_bytes=1 << 22,
    )
    r.start()
    try:
        await records(r, has(2))
        long_worker = "w" * 400
        assert await _publish_raw(port, b"PUB kv.events.%s 2\r\n" % long_worker.encode(), b"hi")
        assert await _publish_raw(port, b"PUB kv.events.after 2\r\n", b"ok")
        got = await records(r, lambda got: any(rec[1] == "kv.events.after" for rec in got))
        assert (5, long_worker) in got
        assert not any(rec[0] in (3, 4) for rec in got)
        assert r.up and r.stats()["oversized"] == 1
    finally:
        r.close()
