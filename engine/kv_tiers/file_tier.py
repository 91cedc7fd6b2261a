"""The file tier of one engine: full blocks written to a shared directory in the background,
and a prompt's longest stored prefix read back when that beats computing it.

Writing: after each step the engine offers the blocks that step made full (`offer`, engine
thread). The tier takes a reference on each (so no step frees or rewrites it meanwhile) and
a writer thread copies it out and stores it; the engine drops those references before its
next step (`release_written`). The queue is bounded: when the writer falls behind, blocks
are skipped, never waited for, so writing never slows a step.

Reading: `read_prefix` (the file-tier connector's reader thread, engine/kv_connector/
file_tier.py) is given how many of the prompt's full blocks the local prefix cache held when
the request came (the scheduler compares again before loading) and finds how many the
directory holds; if the directory holds more and the cost model says reading them beats
computing the difference, it reads them into a `RemoteKV` that the scheduler loads into
fresh blocks like a pulled prompt.

KV cache groups: every group's full blocks are written, each to its own file; a prefix is
stored as far as every group has the blocks it needs (a sliding group, only the last
window's before the prefix end), and only those are read.

State layers: the snapshots of state the engine keeps at a prompt's block boundaries are
offered once their copy has run (`offer_snapshots`), held while the writer copies them, and
written by the hash of the block they follow; a prefix is read only as far as the state
after its last block is stored, and comes with that state.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

from pagefleet.engine.core.block_pool import BlockPool
from pagefleet.engine.core.kv_cache_manager import FullBlock, KeptSnapshot
from pagefleet.engine.core.kv_groups import group_layers, needed_blocks
from pagefleet.engine.kv_tiers.file_store import STATE, FileStore, StoredBlock, UnusableBlockError
from pagefleet.engine.kv_transfer.cost import TierCost
from pagefleet.engine.kv_transfer.params import RemoteKV, StateRows

logger = logging.getLogger(__name__)

MAX_QUEUED_BLOCKS = 512  # blocks held for the writer at most; more are skipped

ReadBlocks = Callable[[list[list[int]]], list[tuple[torch.Tensor, torch.Tensor]]]  # per group -> per layer


@dataclass(slots=True)
class TierStats:
    """Counters of one tier (each written under the tier's lock)."""

    lookups: int = 0  # prompts looked up
    lookup_tokens: int = 0  # their full-block tokens
    hits: int = 0  # prompts that read a prefix
    hit_tokens: int = 0  # prompt tokens read instead of computed
    read_bytes: int = 0
    refused: int = 0  # reads the cost model turned down
    bad_files: int = 0  # files found unusable (another layout, torn, corrupted)
    written_blocks: int = 0
    written_bytes: int = 0
    skipped_blocks: int = 0  # offered while the writer was behind
    seconds_saved: float = 0.0  # estimated recompute time minus the measured read time


@dataclass(slots=True)
class _Pending:
    blocks: queue.SimpleQueue[list[FullBlock] | list[KeptSnapshot] | None] = field(default_factory=queue.SimpleQueue)
    written: collections.deque[list[int]] = field(default_factory=collections.deque)
    written_states: collections.deque[int] = field(default_factory=collections.deque)  # snapshot rows
    queued: int = 0  # blocks and snapshots offered and not yet released (engine thread only)


@dataclass(slots=True)
class StateAccess:
    """A model with state layers: the worker side's copy of a held snapshot row (any
    thread), and the KV cache's release of the hold (engine thread)."""

    read: Callable[[int], StateRows]
    release: Callable[[int], None]


class FileTier:
    """One engine's side of the file tier: its writer thread and its reads (module docstring)."""

    def __init__(
        self,
        store: FileStore,
        pool: BlockPool,
        read_blocks: ReadBlocks,
        cost: TierCost,
        state: StateAccess | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.read_blocks = read_blocks
        self.state = state
        self.cost = cost
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._pending = _Pending()
        self._writer = threading.Thread(target=self._write_loop, name="pagefleet-kv-writer", daemon=True)
        self._writer.start()

    @property
    def block_size(self) -> int:
        return self.store.layout.block_size

    # --- writing (engine thread) ------------------------------------------------------------

    def offer(self, blocks: list[FullBlock]) -> None:
        """Queue the blocks a step made full for writing, holding a reference on each."""
        fresh = [block for block in blocks if not self.store.contains(block.block_hash, block.group)]
        if not fresh:
            return
        room = MAX_QUEUED_BLOCKS - self._pending.queued
        if len(fresh) > room:
            with self._lock:
                self.stats.skipped_blocks += len(fresh) - max(room, 0)
            fresh = fresh[: max(room, 0)]
        held = [block for block in fresh if self.pool.try_hold(block.block_id, block.block_hash, block.group)]
        if held:
            self._pending.queued += len(held)
            self._pending.blocks.put(held)

    def offer_snapshots(self, snapshots: list[KeptSnapshot]) -> None:
        """Queue state snapshots (each held by the KV cache for this) for writing; those
        stored already, or past the queue's room, are released at once."""
        assert self.state is not None, "a model with state layers"
        room = MAX_QUEUED_BLOCKS - self._pending.queued
        fresh = [kept for kept in snapshots if not self.store.contains(kept.block_hash, STATE)][: max(room, 0)]
        for kept in snapshots:
            if kept not in fresh:
                self.state.release(kept.row)
        if fresh:
            self._pending.queued += len(fresh)
            self._pending.blocks.put(fresh)

    def release_written(self) -> None:
        """Drop the references of blocks (and holds of snapshots) the writer is done with
        (before a step)."""
        written, rows = self._pending.written, self._pending.written_states
        while written:
            block_ids = written.popleft()
            self._pending.queued -= len(block_ids)
            self.pool.free(block_ids[::-1])
        while rows:
            self._pending.queued -= 1
            self.state.release(rows.popleft())  # type: ignore[union-attr]

    @property
    def has_pending_writes(self) -> bool:
        return self._pending.queued > 0

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued block is copied out, releasing them (engine thread)."""
        deadline = time.monotonic() + timeout
        while self._pending.queued > 0 and time.monotonic() < deadline:
            self.release_written()
            if self._pending.queued > 0:
                time.sleep(0.002)

    def close(self) -> None:
        self._pending.blocks.put(None)
        self._writer.join(timeout=30)
        self.release_written()

    def _write_loop(self) -> None:
        while (item := self._pending.blocks.get()) is not None:
            if isinstance(item[0], KeptSnapshot):
                self._write_snapshots(cast(list[KeptSnapshot], item))
            else:
                self._write_blocks(cast(list[FullBlock], item))

    def _write_blocks(self, blocks: list[FullBlock]) -> None:
        block_ids = [block.block_id for block in blocks]
        groups = self.store.groups
        by_group = [[block for block in blocks if block.group == g] for g in range(groups.num_groups)]
        try:
            # Copies (the references keep the blocks intact), each layer of its group's blocks.
            layers = self.read_blocks([[block.block_id for block in group] for group in by_group])
        except Exception:  # a task boundary: a failed copy loses these blocks, not the engine
            logger.exception("kv file tier: could not copy %d blocks out", len(blocks))
            self._pending.written.append(block_ids)
            return
        self._pending.written.append(block_ids)  # copied: the engine may free them
        for group, group_blocks in enumerate(by_group):
            own = [layers[layer] for layer in group_layers(groups, group)]
            for index, block in enumerate(group_blocks):
                self._write(block, [keys[index] for keys, _ in own], [values[index] for _, values in own])

    def _write_snapshots(self, snapshots: list[KeptSnapshot]) -> None:
        assert self.state is not None, "offer_snapshots checked"
        for kept in snapshots:
            try:
                state = self.state.read(kept.row)  # held: no step rewrites the row
            except Exception:  # a task boundary: a failed copy loses this snapshot, not the engine
                logger.exception("kv file tier: could not copy a state snapshot out")
                self._pending.written_states.append(kept.row)
                continue
            self._pending.written_states.append(kept.row)
            try:
                written = self.store.write_state(kept.block_hash, kept.token_ids, state)
            except OSError as error:
                logger.warning("kv file tier: writing a state snapshot failed: %s", error)
                continue
            with self._lock:
                self.stats.written_bytes += written

    def _write(self, block: FullBlock, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        try:
            written = self.store.write(block.block_hash, block.token_ids, keys, values, block.group)
        except OSError as error:
            logger.warning("kv file tier: writing a block failed: %s", error)
            return
        if written:
            with self._lock:
                self.stats.written_blocks += 1
                self.stats.written_bytes += written

    # --- reading (any thread but the engine's) ------------------------------------------------

    def read_prefix(self, hashes: list[int], token_ids: list[int], local: int) -> RemoteKV | None:
        """The KV of the prompt's longest stored prefix of full blocks (`hashes`, excluding
        the block of the last prompt token), each group's blocks it needs, or None: nothing
        stored beyond the `local` blocks this replica caches, or computing it is estimated
        faster than reading it. A file found unusable or gone shortens the prefix."""
        size = self.block_size
        stored = self.store.longest_prefix(hashes)
        with self._lock:
            self.stats.lookups += 1
            self.stats.lookup_tokens += len(hashes) * size
        if stored <= local:
            return None
        if not self.cost.worth_reading(self._num_files(stored), (stored - local) * size):
            with self._lock:
                self.stats.refused += 1
            return None
        started = time.perf_counter()
        read: dict[tuple[int, int], StoredBlock] = {}
        num_blocks = stored
        state: StateRows | None = None
        while num_blocks > local:
            missing = self._read_needed(hashes, token_ids, num_blocks, read)
            if missing is None and self.state is not None:
                state = self._read_state(hashes, token_ids, num_blocks)
                missing = None if state is not None else num_blocks - 1
            if missing is None:
                break
            num_blocks = self.store.longest_prefix(hashes[:missing])
        elapsed = time.perf_counter() - started
        self.cost.observe_read(len(read), elapsed)
        if num_blocks <= local:
            return None
        remote = self._assemble(num_blocks, read)
        remote.state = state
        with self._lock:
            self.stats.hits += 1
            self.stats.hit_tokens += (num_blocks - local) * size
            self.stats.read_bytes += sum(block.num_bytes for block in read.values())
            self.stats.seconds_saved += self.cost.recompute_seconds((num_blocks - local) * size) - elapsed
        return remote

    def _num_files(self, num_blocks: int) -> int:
        size = self.block_size
        return sum(len(blocks) for blocks in needed_blocks(self.store.groups, num_blocks * size, size))

    def _read_needed(
        self, hashes: list[int], token_ids: list[int], num_blocks: int, read: dict[tuple[int, int], StoredBlock]
    ) -> int | None:
        """Read into `read` (by group and block index) every block a prefix of `num_blocks`
        needs; the index of the first that is gone or unusable, or None."""
        size = self.block_size
        for group, blocks in enumerate(needed_blocks(self.store.groups, num_blocks * size, size)):
            for index in blocks:
                if (group, index) in read:
                    continue
                tokens = tuple(token_ids[index * size : (index + 1) * size])
                try:
                    block = self.store.read(hashes[index], tokens, group)
                except UnusableBlockError:
                    with self._lock:
                        self.stats.bad_files += 1
                    return index
                if block is None:  # evicted since the look
                    return index
                read[group, index] = block
        return None

    def _read_state(self, hashes: list[int], token_ids: list[int], num_blocks: int) -> StateRows | None:
        """The stored state after the prefix's last block; None if it is gone or unusable."""
        size = self.block_size
        tokens = tuple(token_ids[(num_blocks - 1) * size : num_blocks * size])
        try:
            return self.store.read_state(hashes[num_blocks - 1], tokens)
        except UnusableBlockError:
            with self._lock:
                self.stats.bad_files += 1
            return None

    def _assemble(self, num_blocks: int, read: dict[tuple[int, int], StoredBlock]) -> RemoteKV:
        """The read blocks as a prefix's KV: each layer's rows, its group's needed blocks."""
        groups, size = self.store.groups, self.block_size
        ranges = needed_blocks(groups, num_blocks * size, size)
        keys, values = [], []
        for group, tensor in zip(groups.layer_groups, groups.layer_tensors, strict=True):
            keys.append(torch.stack([read[group, index].keys[tensor] for index in ranges[group]]))
            values.append(torch.stack([read[group, index].values[tensor] for index in ranges[group]]))
        first_blocks = tuple(ranges[group].start for group in groups.layer_groups)
        return RemoteKV(num_blocks * size, keys, values, origin="file", first_blocks=first_blocks)

    def snapshot(self) -> TierStats:
        with self._lock:
            return TierStats(**{name: getattr(self.stats, name) for name in TierStats.__slots__})  # type: ignore[attr-defined]
