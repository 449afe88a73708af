"""``EventIngest`` on the native core: a live batch is checked, decoded and applied in
one native call with the GIL released.

The sequence rules (seq per (worker, dp rank), epochs, gaps, duplicates, jumps, the rank
bound) live in index/native/seq.hpp beside the decoder and the applier, so the only
Python per batch is this wrapper turning the call's tuple into an ``IngestResult``
(measured on 16-block vLLM batches: 36 us a batch with the rules in Python, of which
18 us held the GIL; see BENCHMARKS.md for the fused call). ``index.ingest.EventIngest``
stays the reference: the ingest tests run against both.

Batches the native decoder leaves to Python (LoRA, extra keys, cache salt, EAGLE pairs)
are decoded by ``index.codec``, hashed with ``index.hashing``'s rules and
applied through the same native rules (``Core.ingest_events``). So are all batches of a
hybrid model once its other KV-cache groups showed up (the native decoder keeps group 0):
group 0 goes through the native rules, the other groups' parts (their own index keys,
``index.groups``) through the reference's Python path, after the native seq check.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from index._native import Core
from index.codec import (
    AllBlocksCleared,
    BlockRemoved,
    CodecError,
    DecodedBatch,
    EngineHash,
    Event,
    decode,
)
from index.groups import group_key
from index.hashing import BlockHasher, event_extras, lora_id_root, token_bytes
from index.ingest import (
    _TIER_NUM,
    _TIER_OF_MEDIUM,
    Batch,
    EventIngest,
    IngestResult,
    SeqStatus,
    _Worker,
    tier_of_medium,
)
from index.native_index import NativePrefixIndex

# Core.ingest's status numbers (index/native/seq.hpp), and 7: "Python must decode it".
_STATUS = (
    SeqStatus.OK,
    SeqStatus.DUPLICATE,
    SeqStatus.GAP,
    SeqStatus.RESTART,
    SeqStatus.MALFORMED,
    SeqStatus.JUMP,
    SeqStatus.REFUSED,
)
_SLOW = 7
_RUN = 64  # batches per native call at most: a resync waits for one run (~1 ms)
_APPLIED_BATCH, _RESTARTED, _WAS_RESET = 1, 2, 4
Outcome = tuple[int, int | None, int, dict[str, int] | None, dict[str, int] | None, int]


class NativeEventIngest(EventIngest):
    """``EventIngest`` whose state and per-batch work live in the index's native cores."""

    index: NativePrefixIndex

    def __init__(
        self,
        index: NativePrefixIndex,
        hasher: BlockHasher,
        *,
        max_seq_jump: int = 100_000,
        max_ranks: int = 64,
        max_worker_blocks: int | None = None,
        keep_names: bool = True,
    ) -> None:
        super().__init__(
            index,
            hasher,
            max_seq_jump=max_seq_jump,
            max_ranks=max_ranks,
            max_worker_blocks=max_worker_blocks,
            keep_names=keep_names,
        )
        tiers = {m: _TIER_NUM[t] for m, t in _TIER_OF_MEDIUM.items() if m is not None}

        def setup(core: Core) -> None:
            core.configure_events(hasher.block_size, hasher.bigram, hasher.seed, tiers)
            core.configure_seq(max_seq_jump, max_ranks)
            core.keep_names(keep_names)

        index.configure(setup)

    # -- state -------------------------------------------------------------------
    @property
    def native(self) -> bool:
        return True

    def in_sync(self, worker_id: str) -> bool:
        at = self.index.located(worker_id)
        return at is None or at[0].in_sync(at[1])

    def out_of_sync(self) -> AbstractSet[str]:
        return self.index.out_of_sync()

    def mark_out_of_sync(self, worker_id: str) -> None:
        core, slot = self.index.locate(worker_id)
        core.mark_out_of_sync(slot)

    def _state(
        self, worker_id: str
    ) -> tuple[bool, bool, str | None, dict[int | None, int], dict[int | None, int]] | None:
        at = self.index.located(worker_id)
        return None if at is None else at[0].seq_state(at[1])

    def last_seq(self, worker_id: str, dp_rank: int | None = None) -> int | None:
        state = self._state(worker_id)
        return None if state is None else state[3].get(dp_rank)

    def last_seqs(self, worker_id: str) -> dict[int | None, int]:
        state = self._state(worker_id)
        return {} if state is None else state[3]

    def epoch(self, worker_id: str) -> str | None:
        at = self.index.located(worker_id)
        return None if at is None else at[0].epoch(at[1])

    def forget_unconfirmed(self, worker_id: str) -> None:
        at = self.index.located(worker_id)
        if at is not None:
            at[0].forget_unconfirmed(at[1])

    def engine_blocks(self, worker_id: str) -> dict[EngineHash, int]:
        at = self.index.located(worker_id)
        return {} if at is None else at[0].engine_blocks(at[1])

    def engine_hashes(self, worker_id: str, router_hashes: list[int]) -> list[EngineHash]:
        at = self.index.located(worker_id)
        return [] if at is None else at[0].engine_hashes(at[1], router_hashes)

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
        if self._split_groups:
            return self._decoded(worker_id, seq, payload, dp_rank, epoch)
        core, slot = self.index.locate(worker_id)
        out: Outcome = core.ingest(slot, dp_rank, seq, epoch, payload, self._limit())
        return self.outcome(worker_id, seq, payload, dp_rank, epoch, out)

    def apply_many(self, batches: Sequence[Batch]) -> list[IngestResult]:
        """``apply`` for each batch in order, a run of them per native call: the Python
        and the GIL round trip once per run, not per batch (``Core.ingest_many``)."""
        results: list[IngestResult] = []
        i, n = 0, len(batches)
        while i < n:
            if self._split_groups:
                results += super().apply_many(batches[i:])
                break
            # A run: one core, workers already seen (a new worker changes the quota).
            core, slot = self.index.locate(batches[i][0])
            items = [(slot, batches[i][3], batches[i][1], batches[i][4], batches[i][2])]
            j = i + 1
            while j < n and len(items) < _RUN:
                at = self.index.located(batches[j][0])
                if at is None or at[0] is not core:
                    break
                w, seq, payload, rank, epoch = batches[j]
                items.append((at[1], rank, seq, epoch, payload))
                j += 1
            outs: list[Outcome] = core.ingest_many(items, self._limit())
            for out in outs[:-1]:  # plain applied batches (Core.ingest_many)
                self.events_applied += out[2]
                self.batches_applied += 1
                results.append(IngestResult(SeqStatus.OK, out[1], out[2]))
            w, seq, payload, rank, epoch = batches[i + len(outs) - 1]
            results.append(self.outcome(w, seq, payload, rank, epoch, outs[-1]))
            i += len(outs)
        return results

    def outcome(
        self,
        worker_id: str,
        seq: int,
        payload: bytes,
        dp_rank: int | None,
        epoch: str | None,
        out: Outcome,
    ) -> IngestResult:
        """A native ingest's outcome as ``apply``'s result; a batch it left to Python
        (status 7) decoded here."""
        if out[5] == _APPLIED_BATCH and out[3] is None and out[4] is None:
            # The common case, kept short: everything else is _result's.
            self.events_applied += out[2]
            self.batches_applied += 1
            return IngestResult(SeqStatus.OK, out[1], out[2])
        if out[0] != _SLOW:
            result = self._result(worker_id, out)
            if result.errors.get("other_kv_group") and out[5] & _APPLIED_BATCH:
                self._first_groups(worker_id, payload, result)
            return result
        return self._decoded(worker_id, seq, payload, dp_rank, epoch)

    def _decoded(
        self, worker_id: str, seq: int, payload: bytes, dp_rank: int | None, epoch: str | None
    ) -> IngestResult:
        """A batch through Python's decoder, then the native rules."""
        try:
            batch = decode(payload)
        except CodecError:
            core, slot = self.index.locate(worker_id)
            return self._result(
                worker_id, core.ingest_events(slot, dp_rank, seq, epoch, None, self._limit())
            )
        return self.apply_batch(worker_id, seq, batch, dp_rank=dp_rank, epoch=epoch)

    def _first_groups(self, worker_id: str, payload: bytes, result: IngestResult) -> None:
        """The first events of other KV-cache groups (a hybrid model): the native decoder
        kept group 0 only; the other groups come from Python, now and after."""
        dropped = result.errors.pop("other_kv_group")
        self.errors["other_kv_group"] -= dropped
        if self.errors["other_kv_group"] <= 0:
            del self.errors["other_kv_group"]
        rest = IngestResult(result.status, result.expected_seq)
        w = self._workers.setdefault(worker_id, _Worker())
        self._apply_events(worker_id, w, decode(payload), rest, groups_only=True)
        self.batches_applied -= 1  # one batch, applied in two halves
        self._split_groups = any(g > 0 for g in self._groups)
        zero = self._groups.get(0)
        if zero is not None and zero.kind != "full":
            # group 0 is no full-attention group: the natively applied part belongs under
            # its own group key (applied there just now), not the worker's
            self.index.clear(worker_id)
        result.applied += rest.applied
        result.errors.update(rest.errors)

    def apply_batch(
        self,
        worker_id: str,
        seq: int,
        batch: DecodedBatch,
        *,
        dp_rank: int | None = None,
        epoch: str | None = None,
    ) -> IngestResult:
        core, slot = self.index.locate(worker_id)
        w = self._workers.setdefault(worker_id, _Worker())  # its KV-cache groups' state
        (_, _, first), *groups = self._by_group(worker_id, w, batch, False)
        prepared = [self._prepare(e) for e in first.events]
        out = core.ingest_events(slot, dp_rank, seq, epoch, prepared, self._limit())
        if out[5] & _WAS_RESET:
            self._reset_groups(worker_id, w)
        result = self._result(worker_id, out)
        if out[5] & _APPLIED_BATCH:
            result.errors.update(first.errors)
            self.errors.update(first.errors)
            self._apply_groups(groups, result)
        return result

    def _apply_groups(
        self, groups: list[tuple[str, _Worker, DecodedBatch]], result: IngestResult
    ) -> None:
        """The parts of KV-cache groups past the first, on the reference's Python path."""
        errors: Counter[str] = Counter()
        applied = 0
        for key, state, part in groups:
            errors.update(part.errors)
            for event in part.events:
                error = self._apply_event(key, state, event)
                if error:
                    errors[error] += 1
                else:
                    applied += 1
        if groups:
            self._split_groups = True
        result.applied += applied
        result.errors.update(errors)
        self.errors.update(errors)
        self.events_applied += applied

    def _reset_groups(self, worker_id: str, w: _Worker) -> None:
        for g, state in w.groups.items():
            state.blocks.clear()
            state.spans = 0
            state.engine_of.clear()
            self.index.clear(group_key(worker_id, g))

    def load_dump(
        self,
        worker_id: str,
        seq: int,
        batches: list[DecodedBatch],
        *,
        dp_rank: int | None = None,
        epoch: str | None = None,
    ) -> IngestResult:
        core, slot = self.index.locate(worker_id)
        w = self._workers.setdefault(worker_id, _Worker())
        parts = [self._by_group(worker_id, w, batch, False) for batch in batches]
        prepared = [self._prepare(e) for (_, _, first), *_ in parts for e in first.events]
        applied, errors, cuts = core.load_dump(slot, dp_rank, seq, epoch, prepared, self._limit())
        self._reset_groups(worker_id, w)
        result = IngestResult(SeqStatus.OK, expected_seq=seq + 1, applied=applied)
        for (_, _, first), *_ in parts:
            result.errors.update(first.errors)
        result.errors.update(errors)
        self.errors.update(result.errors)
        if cuts:
            self.errors["worker_quota"] += cuts
        self.events_applied += applied
        self.batches_applied += len(batches)
        self._apply_groups([g for _, *groups in parts for g in groups], result)
        return result

    def _limit(self) -> int:
        quota = self._quota()
        return -1 if quota is None else quota

    def _result(self, worker_id: str, out: Outcome) -> IngestResult:
        """The native call's tuple as an ``IngestResult``, the ingest's counters updated."""
        status, expected, applied, errors, self_errors, flags = out
        result = IngestResult(_STATUS[status], expected, applied)
        if errors:
            result.errors.update(errors)
            self.errors.update(errors)
        if self_errors:
            self.errors.update(self_errors)
        if status == 1:
            self.duplicates += 1
        elif status == 2:
            self.gaps += 1
        if flags & _RESTARTED:
            self.restarts += 1
        if flags & _APPLIED_BATCH:
            self.events_applied += applied
            self.batches_applied += 1
        return result

    def _prepare(self, event: Event) -> tuple[object, ...]:
        """One decoded event as the native applier takes it, hashed by index.hashing's
        rules (LoRA roots, extra keys, cache salt) exactly as ``EventIngest._store`` does.
        Engine hashes go as they came (ints or bytes): the core keys them."""
        if isinstance(event, AllBlocksCleared):
            return ("cleared",)
        tier = tier_of_medium(event.medium)
        tier_num = -1 if tier is None else _TIER_NUM[tier]
        if isinstance(event, BlockRemoved):
            return ("removed", tier_num, bool(event.group_idx), event.block_hashes)
        parent = event.parent_block_hash
        if event.extra_keys:  # multimodal items' placeholder runs (index/media.py)
            self.media.learn(event.token_ids, event.block_size, event.extra_keys)
        # the core checks the block size; a coarse block's keys are renumbered per router block
        ratio, rest = divmod(event.block_size, self.hasher.block_size)
        extras = event_extras(
            event.extra_keys,
            lora_name=event.lora_name,
            cache_salt=event.cache_salt,
            chain_start=parent is None,
            token_ids=event.token_ids,
            block_size=self.hasher.block_size,
            ratio=ratio if not rest else 1,
        )
        try:
            tokens: bytes | None = bytes(token_bytes(event.token_ids))
        except (TypeError, ValueError, OverflowError):
            tokens = None  # not u32 token ids: a bad event, once its earlier checks pass
        root = None
        if parent is None:
            if event.lora_name or event.lora_id is None:
                root = self.hasher.root(event.lora_name)
            else:
                root = lora_id_root(self.hasher, event.lora_id)
        return (
            "stored",
            tier_num,
            bool(event.group_idx),
            event.block_hashes,
            parent,
            tokens,
            len(event.token_ids),
            event.block_size,
            root,
            extras or None,
        )
