"""Router replicas: how fast a late replica rebuilds from the event stream, and how soon a
peer sees a routing decision. Prints one JSON object; asserts nothing.

``rebuild``: ``--workers`` engines' worth of vLLM-shaped batches (one 16-block
``BlockStored`` each, chained per worker) are published into the stream; a fresh
replica's event feed then reads the stream from its start. Reported: batches/s and
blocks/s until it is caught up, and the same batches applied straight to an
``EventIngest`` in-process (``ratio_stream_over_direct`` is the share of ingest speed
the stream path keeps).

``share``: replica A begins one in-flight request per round; the time until replica
B's load counter shows it, per ``share_interval`` (p50/p99 ms).

    python3 bench/replicas.py --quick
    python3 bench/replicas.py --batches 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from index.codec import BlockStored, EventBatch, encode
from index.wire import EPOCH_HEADER, SEQ_HEADER, Subjects
from router.config import RouterConfig, WorkerSpec
from router.events.bus import Bus
from router.events.consumer import EventSync
from router.events.feed import EventFeed
from router.events.jetstream import StreamSpec
from router.events.replicas import ReplicaShare
from router.workers.registry import WorkerRegistry
from sim.mock.natsd import EmbeddedNats

BS = 16


def batches(workers: int, n: int, seed: int) -> list[tuple[str, int, bytes]]:
    """(worker, seq, payload): chains of 16-block stores, new prefix every 8 batches."""
    rng = random.Random(seed)
    out = []
    parents: dict[str, int | None] = {}
    for i in range(n):
        wid = f"w{i % workers}"
        seq = i // workers
        parent = None if seq % 8 == 0 else parents.get(wid)
        hashes = [rng.getrandbits(63) for _ in range(16)]
        tokens = [rng.randrange(32000) for _ in range(16 * BS)]
        event = BlockStored(hashes, parent, tokens, BS, medium="GPU")
        out.append((wid, seq, encode(EventBatch(time.time(), [event], None))))
        parents[wid] = hashes[-1]
    return out


def registry(workers: int) -> WorkerRegistry:
    cfg = RouterConfig(block_size=BS)
    reg = WorkerRegistry(cfg)
    for i in range(workers):
        reg.add(WorkerSpec(f"w{i}", f"http://127.0.0.1:9/{i}", model="m"))
    return reg


async def rebuild(url: str, workers: int, n: int, seed: int) -> dict[str, float]:
    data = batches(workers, n, seed)
    direct = registry(workers)
    ingest = direct.pools["default"].ingest
    t0 = time.perf_counter()
    for wid, seq, payload in data:
        ingest.apply(wid, seq, payload, epoch="e")
    direct_s = time.perf_counter() - t0

    nc = await nats.connect(url)
    spec = StreamSpec(max_bytes=1 << 31)
    await nc.jsm().add_stream(spec.config())
    for wid, seq, payload in data:
        headers = {SEQ_HEADER: str(seq), EPOCH_HEADER: "e"}
        await nc.publish(Subjects().events(wid), payload, headers=headers)
    await nc.flush()
    await nc.close()

    reg = registry(workers)
    events = EventSync(reg)
    feed = EventFeed(events, spec, transport="jetstream")
    bus = Bus(url)
    done = asyncio.Event()
    feed.reader.on_caught_up = done.set  # measure, not resync (no agents here)
    bus.on_connect(feed.on_connect)
    t0 = time.perf_counter()
    bus.start()
    await asyncio.wait_for(done.wait(), 600)
    stream_s = time.perf_counter() - t0
    pool = reg.pools["default"]
    same = pool.index.stats().blocks == direct.pools["default"].index.stats().blocks
    await feed.close()
    await bus.close()
    return {
        "batches": n,
        "blocks": n * 16,
        "direct_batches_per_s": round(n / direct_s),
        "stream_batches_per_s": round(n / stream_s),
        "stream_blocks_per_s": round(16 * n / stream_s),
        "stream_seconds": round(stream_s, 3),
        "ratio_stream_over_direct": round(direct_s / stream_s, 3),
        "same_index": same,
    }


async def share(url: str, interval: float, rounds: int) -> dict[str, float]:
    pair = []
    for name in ("a", "b"):
        bus = Bus(url)
        reg = registry(1)
        rs = ReplicaShare(reg, bus, replica_id=name, interval=interval)
        bus.on_connect(rs.attach)
        bus.start()
        pair.append((bus, reg, rs))
    while not all(b.connected for b, _, _ in pair):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    load_a = pair[0][1].get("w0").load
    load_b = pair[1][1].get("w0").load
    lat = []
    for _ in range(rounds):
        want = load_b.inflight_requests + 1
        t0 = time.perf_counter()
        flight = load_a.begin(100)
        while load_b.inflight_requests < want:
            await asyncio.sleep(0.0002)
        lat.append((time.perf_counter() - t0) * 1000)
        flight.finish()
        while load_b.inflight_requests:
            await asyncio.sleep(0.0005)
    for bus, _, rs in pair:
        await rs.close()
        await bus.close()
    lat.sort()
    return {
        "interval_ms": interval * 1000,
        "p50_ms": round(statistics.median(lat), 2),
        "p99_ms": round(lat[int(0.99 * (len(lat) - 1))], 2),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=20_000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2000 batches, 50 rounds")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.rounds = 2000, 50
    with EmbeddedNats() as server:
        out = {"rebuild": await rebuild(server.url, args.workers, args.batches, args.seed)}
        out["share"] = [await share(server.url, i, args.rounds) for i in (0.001, 0.005, 0.02)]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
