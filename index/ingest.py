"""Per-worker KV-event ingest: decoded events -> the router's own hashes -> the index.

Engine block hashes are opaque (vLLM's default sha256 with a random seed cannot be
reproduced here), so a ``BlockStored`` is applied by rehashing its ``token_ids`` with
the router's ``BlockHasher``, chained from the router hash of its parent. The engine
hash -> router hash map per worker exists only to resolve parents and removals.

Sequence numbers are tracked per (worker, dp rank), the rank being the one the
transport names (each DP rank is its own ZMQ publisher with its own seq). A batch is
applied only in order: a gap is reported, not applied, so the caller can fetch the
missing batches (replay) or a full dump first; a duplicate is ignored, which makes
re-delivery harmless.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from index.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CodecError,
    DecodedBatch,
    EngineHash,
    Event,
    decode,
)
from index.groups import GroupSpec, group_key, group_kind
from index.hashing import BlockHasher, event_extras, lora_id_root
from index.media import MediaRegistry
from index.prefix_index import TIERS, PrefixIndex, Tier
from index.wire import EPOCH_START_SEQ

if TYPE_CHECKING:
    from index.native_index import NativePrefixIndex

# Every medium the engines name in their ``kv_events`` (checked against their sources,
# December 2026), by the tier a hit there costs; a name not here is counted as
# ``unknown_medium`` and its event skipped, so a new one shows up in the counters.
# - vLLM (``vllm/distributed/kv_events.py``): ``GPU``, ``CPU`` and ``STORAGE`` (the
#   offloading connector's primary tier and its secondary, file-system tier;
#   ``kv_offload``'s own specs name ``CPU``, ``Disk`` and ``FILE``); a block with
#   ``locality: "REMOTE"`` is ``REMOTE`` whatever its medium (``index.codec``).
# - SGLang (``srt/disaggregation/kv_events.py``, HiCache): ``GPU`` (L1), ``CPU_TIER1``
#   (L2, host memory), ``CPU_TIER2`` (L3, its storage backend: file, 3FS, Mooncake);
#   older builds named the host tier ``CPU_PINNED``.
# - Dynamo's KVBM and other publishers: ``DEVICE``, ``HOST``, ``DISK``, ``NVME``,
#   ``LOCAL_DISK``, ``SHARED``, ``EXTERNAL``, ``NETWORK``.
_TIER_OF_MEDIUM: dict[str | None, Tier] = {
    None: "gpu",
    "GPU": "gpu",
    "DEVICE": "gpu",
    "CPU": "cpu",
    "CPU_PINNED": "cpu",
    "CPU_TIER1": "cpu",
    "HOST": "cpu",
    "DISK": "disk",
    "LOCAL_DISK": "disk",
    "NVME": "disk",
    "FILE": "disk",
    "STORAGE": "disk",
    "CPU_TIER2": "disk",
    "SHARED": "shared",
    "REMOTE": "shared",
    "EXTERNAL": "shared",
    "NETWORK": "shared",
}
_TIER_BIT: dict[Tier, int] = {"gpu": 1, "cpu": 2, "disk": 4, "shared": 8}
_TIER_NUM = {name: pos for pos, name in enumerate(TIERS)}


def tier_of_medium(medium: str | None) -> Tier | None:
    """The index tier for an event's ``medium`` (None when unknown)."""
    return _TIER_OF_MEDIUM.get(medium.upper() if medium else None)


class SeqStatus(StrEnum):
    OK = "ok"  # applied
    DUPLICATE = "duplicate"  # seen already; ignored
    GAP = "gap"  # batches before it are missing; not applied, replay from expected_seq
    RESTART = "restart"  # the engine restarted: worker cleared, batch applied
    MALFORMED = "malformed"  # unreadable; not applied, replay from expected_seq
    # a seq more than ``max_seq_jump`` past the last applied one (a forged Kv-Seq, or so
    # much missed that replaying is worse than a dump): not applied, not remembered as
    # seen; rebuild from expected_seq (0: a dump)
    JUMP = "jump"
    REFUSED = "refused"  # a dp rank past ``max_ranks`` for this worker: dropped, counted


# One live batch for ``apply_many``: (worker, seq, msgpack payload, dp rank, epoch).
Batch = tuple[str, int, bytes, int | None, str | None]


@dataclass(slots=True)
class IngestResult:
    status: SeqStatus
    expected_seq: int | None = None
    applied: int = 0
    errors: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True)
class _Worker:
    # engine hash -> [router hash, tier bits held]
    blocks: dict[EngineHash, list[int]] = field(default_factory=dict)
    engine_of: dict[int, EngineHash] = field(default_factory=dict)  # router -> engine hash
    last_seq: dict[int | None, int] = field(default_factory=dict)
    seen: dict[int | None, int] = field(default_factory=dict)  # highest seq seen per rank
    epoch: str | None = None
    in_sync: bool = True
    # KV-cache groups past the first (hybrid models): each its own blocks, under its own
    # index key (``group_key``); sequence numbers stay the worker's
    groups: dict[int, _Worker] = field(default_factory=dict)
    # engine hash -> router hash of blocks any group stored, kept after removal: a
    # group's event chains to a parent its own group may never have held (a Mamba group
    # saves states only here and there; a sliding-window group drops old blocks)
    chain: dict[EngineHash, int] = field(default_factory=dict)
    base: _Worker | None = None  # a group's worker (whose ``chain`` it shares)


_FULL = GroupSpec("full")
_MAX_CHAIN = 1 << 18  # parents remembered per worker for its groups' events


class EventIngest:
    """Applies event batches from many workers to one ``PrefixIndex``.

    This class is the reference: plain Python, sequence rules and per-block work alike.
    ``index.native_ingest.NativeEventIngest`` is the same rules in native code, for a
    ``NativePrefixIndex``; ``index.backend.make_ingest`` picks the one that fits an index
    (the ingest tests run against both).
    """

    def __init__(
        self,
        index: PrefixIndex | NativePrefixIndex,
        hasher: BlockHasher,
        *,
        max_seq_jump: int = 100_000,
        max_ranks: int = 64,
        max_worker_blocks: int | None = None,
        keep_names: bool = True,
    ) -> None:
        """The bounds are per source, against forged event headers (issue 10): a seq may
        run ``max_seq_jump`` ahead, a worker may name ``max_ranks`` dp ranks, and hold
        ``max_worker_blocks`` blocks (default: an even share of the index's bound, so one
        worker cannot evict everyone else's; none when the index is unbounded).

        ``keep_names``: whether the bytes engines name blocks by (vLLM's sha256) are kept
        for prefetch hints, the only reader of them; without them ``engine_hashes`` stops
        at the first block named by bytes (natively: 24 B a block less)."""
        self.index = index
        self.hasher = hasher
        self.max_seq_jump = max_seq_jump
        self.max_ranks = max_ranks
        self.max_worker_blocks = max_worker_blocks
        self.keep_names = keep_names
        self.errors: Counter[str] = Counter()
        self.events_applied = 0
        self.batches_applied = 0
        self.gaps = 0
        self.restarts = 0
        self.duplicates = 0
        self._workers: dict[str, _Worker] = {}
        # multimodal items' placeholder runs, as the events show them (index/media.py)
        self.media = MediaRegistry()
        # KV-cache groups by group_idx: declared (``declare_groups``), completed by what
        # events say of themselves (kind, window, block size)
        self._groups: dict[int, GroupSpec] = {}
        self._declared: dict[int, GroupSpec] = {}
        # once a batch had events of other groups (index.native_ingest: the native decoder
        # keeps group 0 only, so from then on every batch is decoded in Python)
        self._split_groups = False

    # -- KV-cache groups ------------------------------------------------------------
    def declare_groups(self, specs: list[GroupSpec]) -> None:
        """The pool's groups for engines whose events do not describe them (``kv_groups``)."""
        self._declared = dict(enumerate(specs))
        self._groups = {**self._declared, **self._groups}
        if len(specs) > 1:
            self._split_groups = True

    def declared_groups(self) -> list[GroupSpec]:
        return [self._declared[g] for g in sorted(self._declared)]

    def group_specs(self) -> list[GroupSpec] | None:
        """The groups in ``group_idx`` order when the model is hybrid (None: one
        full-attention group, or a group of unknown kind: then group 0 is matched alone)."""
        groups = {0: _FULL, **self._groups}  # group 0 unnamed: full attention, as before
        if len(groups) == 1 and groups[0].kind == "full":
            return None
        if len(groups) != max(groups) + 1:
            return None  # a group of no known kind: group 0 is matched alone, as before
        return [groups[g] for g in range(len(groups))]

    def _learn(self, event: BlockStored) -> None:
        kind = group_kind(event.kv_cache_spec_kind)
        g = event.group_idx or 0
        known = self._groups.get(g)
        if kind is None:
            if known is None and g in self._declared:
                self._groups[g] = self._declared[g]
            return
        ratio = max(1, event.block_size // self.hasher.block_size)
        window = event.kv_cache_spec_sliding_window or (known.window if known else 0)
        spec = GroupSpec(kind, window if kind == "sliding_window" else 0, ratio)
        if known != spec:
            self._groups[g] = spec

    # -- state -------------------------------------------------------------------
    def in_sync(self, worker_id: str) -> bool:
        """False between a detected gap and the replay or dump that closes it."""
        w = self._workers.get(worker_id)
        return w is None or w.in_sync

    def out_of_sync(self) -> AbstractSet[str]:
        """The workers ``in_sync`` is false for, all at once: the router's views ask for
        every candidate of every request (natively one call a core, 0.6 us at 16 workers,
        where ``in_sync`` was one a candidate, 0.21 us each, under the core's lock)."""
        return {wid for wid, w in self._workers.items() if not w.in_sync}

    @property
    def native(self) -> bool:
        """Whether batches are applied by the native core (GIL released, whole batch
        under the index's lock: safe to run on a thread beside matches)."""
        return False

    def mark_out_of_sync(self, worker_id: str) -> None:
        """Batches of ``worker_id`` were lost in transport (detected outside the seq
        numbers): untrusted until the next replay or dump brings it up to date."""
        self._workers.setdefault(worker_id, _Worker()).in_sync = False

    def last_seq(self, worker_id: str, dp_rank: int | None = None) -> int | None:
        w = self._workers.get(worker_id)
        return None if w is None else w.last_seq.get(dp_rank)

    def last_seqs(self, worker_id: str) -> dict[int | None, int]:
        """Last applied seq per dp rank (the rank may come from the batch, not the caller)."""
        w = self._workers.get(worker_id)
        return {} if w is None else dict(w.last_seq)

    def engine_blocks(self, worker_id: str) -> dict[EngineHash, int]:
        """Engine hash -> router hash for every block the worker is known to hold."""
        w = self._workers.get(worker_id)
        if w is None:
            return {}
        keep = self.keep_names
        return {e: v[0] for e, v in w.blocks.items() if keep or not isinstance(e, bytes)}

    def engine_hashes(self, worker_id: str, router_hashes: list[int]) -> list[EngineHash]:
        """The worker's own hashes for the leading ``router_hashes`` it holds.

        Prefetch hints name blocks in the source engine's terms; this stops at the
        first block the worker is not known to hold (an engine hash a router hash still
        names after its block was re-stored under another chain and then removed, too),
        or whose bytes name was not kept (``keep_names``).
        """
        w = self._workers.get(worker_id)
        out: list[EngineHash] = []
        if w is None:
            return out
        for rh in router_hashes:
            eh = w.engine_of.get(rh)
            if eh is None or eh not in w.blocks or (isinstance(eh, bytes) and not self.keep_names):
                break
            out.append(eh)
        return out

    def epoch(self, worker_id: str) -> str | None:
        """The engine life the applied batches belong to (None: unknown)."""
        w = self._workers.get(worker_id)
        return None if w is None else w.epoch

    def forget_unconfirmed(self, worker_id: str) -> None:
        """Drop ranks seen only in gaps after a replay round the agent answered: the agent
        replays every batch it has, so a rank it left empty named batches that never
        existed (forged ``Kv-Dp-Rank``), and must not hold the worker out of sync."""
        w = self._workers.get(worker_id)
        if w is not None:
            for rank in [r for r in w.seen if r not in w.last_seq]:
                del w.seen[rank]
            w.in_sync = all(w.last_seq.get(r, -1) >= s for r, s in w.seen.items())

    def remove_worker(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        self.index.remove_worker(worker_id)
        for g in w.groups if w is not None else ():
            self.index.remove_worker(group_key(worker_id, g))

    # -- ingest ------------------------------------------------------------------
    def apply(
        self,
        worker_id: str,
        seq: int,
        payload: bytes,
        *,
        dp_rank: int | None = None,
        epoch: str | None = None,
    ) -> IngestResult:
        """Decode and apply one msgpack batch with the engine's sequence number ``seq``.

        ``epoch`` identifies one life of the engine (the agent bumps it on restart);
        a new epoch clears the worker before the batch is applied.
        """
        try:
            batch = decode(payload)
        except CodecError:
            self.errors["malformed_batch"] += 1
            w = self._workers.setdefault(worker_id, _Worker())
            last = w.last_seq.get(dp_rank)
            if last is not None and seq <= last and (epoch is None or epoch == w.epoch):
                # A damaged copy of a batch already applied: nothing is missing.
                self.duplicates += 1
                return IngestResult(SeqStatus.DUPLICATE, expected_seq=last + 1)
            w.in_sync = False
            result = IngestResult(SeqStatus.MALFORMED, expected_seq=seq)
            result.errors["malformed_batch"] += 1
            return result
        return self.apply_batch(worker_id, seq, batch, dp_rank=dp_rank, epoch=epoch)

    def apply_many(self, batches: Sequence[Batch]) -> list[IngestResult]:
        """``apply`` for each batch in order (the native ingest takes a run in one call)."""
        return [self.apply(w, seq, p, dp_rank=rank, epoch=e) for w, seq, p, rank, e in batches]

    def apply_batch(
        self,
        worker_id: str,
        seq: int,
        batch: DecodedBatch,
        *,
        dp_rank: int | None = None,
        epoch: str | None = None,
    ) -> IngestResult:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker(epoch=epoch)
        rank = dp_rank
        if seq == EPOCH_START_SEQ and epoch is not None:
            return self._epoch_start(worker_id, w, rank, epoch)
        last = w.last_seq.get(rank)
        if rank not in w.seen and rank not in w.last_seq and len(w.seen) >= self.max_ranks:
            self.errors["too_many_ranks"] += 1
            return IngestResult(SeqStatus.REFUSED, expected_seq=None if last is None else last + 1)
        if seq - (-1 if last is None else last) > self.max_seq_jump:
            self.errors["seq_jump"] += 1
            w.in_sync = False
            return IngestResult(SeqStatus.JUMP, expected_seq=0)
        w.seen[rank] = max(seq, w.seen.get(rank, seq))
        status = SeqStatus.OK
        if epoch is not None and w.epoch is not None and epoch != w.epoch:
            # A new life of the engine (or of its agent): nothing known still holds.
            self._restart(worker_id, w, rank, seq)
            w.epoch = epoch
            if seq != 0:  # its start is not in hand: ask for it (the agent dumps)
                return self._gap(w, 0)
            status = SeqStatus.RESTART
        elif last is None:
            if seq != 0:  # joined mid-stream: everything before this batch is unknown
                return self._gap(w, 0)
        elif seq == 0 and last > 0 and epoch is None:
            # Without an epoch from the transport, seq 0 again is the only restart sign;
            # with one, a late seq 0 is just a duplicate.
            self._restart(worker_id, w, rank, seq)
            status = SeqStatus.RESTART
        elif seq <= last:
            self.duplicates += 1
            return IngestResult(SeqStatus.DUPLICATE, expected_seq=last + 1)
        elif seq != last + 1:
            return self._gap(w, last + 1)
        if epoch is not None:
            w.epoch = epoch
        result = IngestResult(status, expected_seq=seq + 1)
        try:
            self._apply_events(worker_id, w, batch, result)
        finally:
            # After the events: a reader on another thread that sees this seq applied
            # also sees its blocks (the native path applies off the event loop).
            w.last_seq[rank] = seq
        w.in_sync = all(w.last_seq.get(r, -1) >= s for r, s in w.seen.items())
        return result

    def load_dump(
        self,
        worker_id: str,
        seq: int,
        batches: list[DecodedBatch],
        *,
        dp_rank: int | None = None,
        epoch: str | None = None,
    ) -> IngestResult:
        """Replace everything known of ``worker_id`` with a full dump taken at ``seq``."""
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker()
        high = w.seen.get(dp_rank, seq) if epoch is None or epoch == w.epoch else seq
        self._reset(worker_id, w)
        w.epoch = epoch
        w.last_seq[dp_rank] = seq
        w.seen[dp_rank] = max(seq, high)
        result = IngestResult(SeqStatus.OK, expected_seq=seq + 1)
        for batch in batches:
            self._apply_events(worker_id, w, batch, result)
        # Batches newer than the dump that arrived meanwhile still need a replay.
        w.in_sync = seq >= high
        return result

    def _epoch_start(
        self, worker_id: str, w: _Worker, rank: int | None, epoch: str | None
    ) -> IngestResult:
        """The agent saw the engine restart before any batch of its new life: whatever
        the worker held is gone now, and its next batch is seq 0."""
        if epoch == w.epoch and w.last_seq.get(rank) is not None:
            self.duplicates += 1
            return IngestResult(SeqStatus.DUPLICATE, expected_seq=w.last_seq[rank] + 1)
        if w.epoch is not None and epoch != w.epoch:
            self.restarts += 1
        self._reset(worker_id, w)
        w.epoch = epoch
        w.last_seq[rank] = w.seen[rank] = EPOCH_START_SEQ
        w.in_sync = True
        return IngestResult(SeqStatus.RESTART, expected_seq=0)

    def _gap(self, w: _Worker, expected: int) -> IngestResult:
        self.gaps += 1
        w.in_sync = False
        return IngestResult(SeqStatus.GAP, expected_seq=expected)

    def _restart(self, worker_id: str, w: _Worker, rank: int | None, seq: int) -> None:
        self.restarts += 1
        self._reset(worker_id, w)
        w.seen[rank] = seq

    def _reset(self, worker_id: str, w: _Worker) -> None:
        w.last_seq.clear()
        w.seen.clear()
        for key, state in [(worker_id, w), *self._group_states(worker_id, w)]:
            state.blocks.clear()
            state.engine_of.clear()
            self.index.clear(key)

    @staticmethod
    def _group_states(worker_id: str, w: _Worker) -> list[tuple[str, _Worker]]:
        return [(group_key(worker_id, g), state) for g, state in w.groups.items()]

    def _by_group(
        self, worker_id: str, w: _Worker, batch: DecodedBatch, groups_only: bool
    ) -> list[tuple[str, _Worker, DecodedBatch]]:
        """The batch split by KV-cache group, each part for its own index key, the
        worker's own key first; a clear goes to every group. The worker's key holds group
        0 when it is full attention (or of unknown kind, as before groups were known);
        a group 0 of another kind (vLLM orders groups by their first layer: Gemma-3 and
        gpt-oss start with sliding-window layers) gets its own key like the others, and
        the worker's key stays empty. ``groups_only``: the worker key's part was applied
        already (natively)."""
        if not (w.groups or any(getattr(e, "group_idx", None) for e in batch.events)):
            return [(worker_id, w, batch)]
        parts: dict[int | None, list[Event]] = {None: []} | {g: [] for g in w.groups}
        unknown: Counter[str] = Counter()
        cleared = False
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                cleared = True
                for events in parts.values():
                    events.append(event)
                continue
            if isinstance(event, BlockStored):
                self._learn(event)
            g = event.group_idx or 0
            if g and g not in self._groups:
                unknown["other_kv_group"] += 1  # a group of no known kind: no rule matches it
                continue
            p = None if g == 0 and self._groups.get(0, _FULL).kind == "full" else g
            if p not in parts:  # a group new in this batch: after a clear, it starts clear
                parts[p] = [AllBlocksCleared()] if cleared else []
            # within its group's key the event is an ordinary group-0 one
            parts[p].append(dataclasses.replace(event, group_idx=None) if g else event)
        out: list[tuple[str, _Worker, DecodedBatch]] = []
        for p, events in parts.items():
            if p is None:
                own = [] if groups_only else events
                errors = unknown if groups_only else batch.errors + unknown
                out.append((worker_id, w, DecodedBatch(batch.ts, own, batch.dp_rank, errors)))
                continue
            state = w.groups.setdefault(p, _Worker(base=w))
            part = DecodedBatch(batch.ts, events, batch.dp_rank, Counter())
            out.append((group_key(worker_id, p), state, part))
        return out

    def _apply_events(
        self,
        worker_id: str,
        w: _Worker,
        batch: DecodedBatch,
        result: IngestResult,
        *,
        groups_only: bool = False,
    ) -> None:
        for key, state, part in self._by_group(worker_id, w, batch, groups_only):
            result.errors.update(part.errors)
            for event in part.events:
                error = self._apply_event(key, state, event)
                if error:
                    result.errors[error] += 1
                else:
                    result.applied += 1
        self.errors.update(result.errors)
        self.events_applied += result.applied
        self.batches_applied += 1

    def _apply_event(self, worker_id: str, w: _Worker, event: Event) -> str | None:
        """Apply one event; the name of what was wrong with it, or None."""
        if isinstance(event, AllBlocksCleared):
            w.blocks.clear()
            w.engine_of.clear()
            self.index.clear(worker_id)
            return None
        if event.group_idx:
            return "other_kv_group"  # only the full-attention group 0 is indexed
        tier = tier_of_medium(event.medium)
        if tier is None:
            return "unknown_medium"
        bit = _TIER_BIT[tier]
        if isinstance(event, BlockRemoved):
            gone = []
            for eh in event.block_hashes:
                entry = w.blocks.get(eh)
                if entry is None or not entry[1] & bit:
                    continue
                gone.append(entry[0])
                gone.extend(entry[2:])  # a coarse block's other router blocks
                entry[1] &= ~bit
                if not entry[1]:
                    del w.blocks[eh]
                    w.engine_of.pop(entry[0], None)
            self.index.remove(worker_id, gone, tier)
            return None
        return self._store(worker_id, w, event, tier, bit)

    def _quota(self) -> int | None:
        if self.max_worker_blocks is not None:
            return self.max_worker_blocks
        bound = self.index.max_blocks
        return None if bound is None else max(1, bound // max(1, len(self.index.workers)))

    def _store(
        self, worker_id: str, w: _Worker, event: BlockStored, tier: Tier, bit: int
    ) -> str | None:
        hasher = self.hasher
        # A block k times the router's (vLLM 0.33 reports a coarser KV group's blocks,
        # one hash per span) is k router blocks; its hash names the last of them.
        k, rest = divmod(event.block_size, hasher.block_size)
        if rest or not k:
            return "block_size_mismatch"
        n = len(event.block_hashes)
        # Bigram (EAGLE) blocks cover one token past their end: n blocks need n*B + 1.
        m, over = divmod(len(event.token_ids) - hasher.bigram, event.block_size)
        if n == 0 or over or m < n or (m > n and w.base is None):
            return "token_count_mismatch"
        # m > n: a sparse store of another KV-cache group (vLLM's sliding-window group
        # caches only the blocks a hit can use: ``reachable_block_mask``): the tokens run
        # from the chain's parent, the hashes name the last n blocks
        skip = m - n
        parent: int | None = None
        if event.parent_block_hash is not None:
            p = w.blocks.get(event.parent_block_hash)
            if p is not None:
                parent = p[0]
            elif w.base is not None and event.parent_block_hash in w.base.chain:
                parent = w.base.chain[event.parent_block_hash]
            elif w.base is not None and event.parent_block_hash in w.base.blocks:
                parent = w.base.blocks[event.parent_block_hash][0]
            else:
                return "unknown_parent"
        keys = (
            [None] * skip + list(event.extra_keys)
            if event.extra_keys and skip
            else event.extra_keys
        )
        if keys:
            self.media.learn(event.token_ids, event.block_size, keys)
        extras = event_extras(
            keys,
            lora_name=event.lora_name,
            cache_salt=event.cache_salt,
            chain_start=event.parent_block_hash is None,
            token_ids=event.token_ids,
            block_size=hasher.block_size,
            ratio=k,
        )
        start = parent
        if start is None:
            if event.lora_name or event.lora_id is None:
                start = hasher.root(event.lora_name)
            else:
                start = lora_id_root(hasher, event.lora_id)
        router = hasher.hash_tokens(event.token_ids, parent=start, block_extras=extras)
        if skip:
            parent, router = router[skip * k - 1], router[skip * k :]
        quota = self._quota()
        if quota is not None and len(w.blocks) + n > quota:
            # keep the leading blocks that fit: a chain's prefix is still a true prefix
            room = 0
            fresh = 0
            for eh in event.block_hashes:
                fresh += eh not in w.blocks
                if len(w.blocks) + fresh > quota:
                    break
                room += 1
            if room < n:
                self.errors["worker_quota"] += 1
                if room == 0:
                    return "worker_quota"
                router = router[: room * k]
                event = dataclasses.replace(event, block_hashes=event.block_hashes[:room])
        if k == 1:
            for eh, rh in zip(event.block_hashes, router, strict=True):
                entry = w.blocks.get(eh)
                if entry is None:
                    w.blocks[eh] = [rh, bit]
                else:
                    entry[0] = rh
                    entry[1] |= bit
                w.engine_of[rh] = eh
        else:
            for i, eh in enumerate(event.block_hashes):
                span = router[i * k : (i + 1) * k]
                entry = w.blocks.get(eh)
                # [last router hash, tier bits, the span's other router hashes...]
                w.blocks[eh] = [span[-1], bit | (entry[1] if entry else 0), *span[:-1]]
                w.engine_of[span[-1]] = eh
        self.index.store(worker_id, router, tier, parent=parent)
        if w.base is not None:
            chain = w.base.chain
            for i, eh in enumerate(event.block_hashes):
                chain.pop(eh, None)
                chain[eh] = router[(i + 1) * k - 1]
            while len(chain) > _MAX_CHAIN:
                del chain[next(iter(chain))]
        return None
