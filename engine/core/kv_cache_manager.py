"""Block tables of sequences on top of the block pool: allocation on demand, prefix
caching, forking with copy-on-write, and swapping to a host-memory pool.

A sequence has one block table per KV cache group (engine/core/kv_groups.py): every table
is indexed by the same token positions, and a sliding-window group's table holds
`NULL_BLOCK` where its blocks fell behind the window and were freed.

The manager only does bookkeeping. Data movement it decides (copy-on-write copies, swap
copies) is returned to the caller, which hands it to the model runner before the step's
forward pass writes anything.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from pagefleet.engine.core.block_pool import BlockPool
from pagefleet.engine.core.kv_groups import NULL_BLOCK, ONE_GROUP, KVGroups, longest_prefix, needed_blocks
from pagefleet.engine.core.request import Request, Sequence
from pagefleet.engine.core.state_slots import StateCopy, StateLoad, StateSlotTable
from pagefleet.engine.core.state_snapshots import StateSnapshots, snapshot_chunk_end
from pagefleet.engine.kv_transfer.params import KVLoad, RemoteKV
from pagefleet.protocol.block_hash import block_hashes

BlockCopy = tuple[int, int]  # (source block id, destination block id)


@dataclass(slots=True)
class SequenceBlocks:
    """One sequence's place in the cache. Written by KVCacheManager alone; others read it
    through `KVCacheManager.block_tables` and `num_computed_tokens`."""

    tables: list[list[int]]  # per group, its device blocks (none while swapped out)
    host_tables: list[list[int]]  # per group, its host copies while swapped out
    num_computed_tokens: int = 0  # tokens whose keys and values are in those blocks
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, chained
    num_registered_blocks: int = 0  # full blocks already published to the prefix cache

    @classmethod
    def empty(cls, num_groups: int) -> SequenceBlocks:
        return cls([[] for _ in range(num_groups)], [[] for _ in range(num_groups)])

    def held(self, on_host: bool = False) -> list[int]:
        """Every block it holds, each table's in order, NULL_BLOCK places left out."""
        tables = self.host_tables if on_host else self.tables
        return [b for table in tables for b in table if b != NULL_BLOCK]


class FullBlock(NamedTuple):
    """A block a step made full and published: where it is, its chain hash, its tokens,
    the KV cache group whose layers it holds."""

    block_id: int
    block_hash: int
    token_ids: tuple[int, ...]
    group: int = 0


class PrefixHit(NamedTuple):
    """What the prefix cache holds of a prompt's start: `num_blocks` blocks' worth of
    tokens, each group's cached blocks for them (NULL_BLOCK where a sliding group needs
    none), and how many free blocks taking them consumes (hits on evictable blocks leave
    the free queue)."""

    tables: list[list[int]]
    num_blocks: int
    cost: int
    state_row: int | None = None  # a model with state layers: the snapshot after those blocks


class SlotAllocation(NamedTuple):
    """What `KVCacheManager.allocate_slots` did for one sequence."""

    new_block_ids: list[int]  # appended to its tables
    copies: list[BlockCopy]  # copy-on-write: (shared block, its private copy), also queued in `pending`


@dataclass(slots=True, frozen=True)
class CacheUsage:
    """The pool's state at one moment, for the engine's statistics."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_shared_blocks: int  # referenced by more than one sequence
    num_blocks_saved_by_sharing: int
    peak_used_blocks: int


@dataclass(slots=True)
class CacheStats:
    prefix_queries: int = 0  # prompt tokens looked up
    prefix_hits: int = 0  # of which served from the cache
    cow_copies: int = 0


class KeptSnapshot(NamedTuple):
    """A state snapshot for a KV tier to save: the block hash it follows and its row."""

    block_hash: int
    token_ids: tuple[int, ...]  # the block's
    row: int


@dataclass(slots=True)
class PendingCopies:
    """Copies to run before the next forward pass, in this order."""

    swap_out: list[BlockCopy] = field(default_factory=list)  # device -> host
    swap_in: list[BlockCopy] = field(default_factory=list)  # host -> device
    device: list[BlockCopy] = field(default_factory=list)  # copy-on-write
    loads: list[KVLoad] = field(default_factory=list)  # KV from outside (the connectors') -> these blocks
    # State slots (models with state layers): device -> host, host -> device, then forks'.
    state_swap_out: list[StateCopy] = field(default_factory=list)
    state_swap_in: list[StateCopy] = field(default_factory=list)
    state: list[StateCopy] = field(default_factory=list)
    state_loads: list[StateLoad] = field(default_factory=list)  # a remote prefix's state -> its slot

    def take(self) -> PendingCopies:
        taken = PendingCopies(
            self.swap_out,
            self.swap_in,
            self.device,
            self.loads,
            self.state_swap_out,
            self.state_swap_in,
            self.state,
            self.state_loads,
        )
        self.swap_out, self.swap_in, self.device, self.loads = [], [], [], []
        self.state_swap_out, self.state_swap_in, self.state, self.state_loads = [], [], [], []
        return taken


class KVCacheManager:
    """Owns every sequence's block tables and computed-token count (`SequenceBlocks`), on
    top of the reference-counted `BlockPool` that all KV cache groups share.

    Contract:
    - Only this class writes a sequence's blocks and progress; `block_tables(seq)` and
      `num_computed_tokens(seq)` read them (an unknown sequence has none).
    - `allocate_slots` either makes every slot of the asked tokens writable in every group
      and returns what it did, or returns None and changes nothing. A block shared by
      several sequences is copied before one of them writes into it (copy-on-write); the
      copies, like swap copies, queue in `pending` until the scheduler takes them.
    - `commit(seq, n)` records that a forward pass wrote n more tokens, publishes blocks
      that became full to the prefix cache, and frees the blocks of sliding-window groups
      that no later query can see.
    - `free(seq)` returns every block the sequence holds (tail first, so a prefix-cached
      chain is evicted from its end) and forgets it; a freed block whose reference count
      reaches zero becomes free (or evictable, if it is in the prefix cache).
    - Invariant: each of a sequence's tables covers exactly ceil(tokens written /
      block_size) positions after `allocate_slots`, so only its last block can be
      part-empty; a sliding group holds real blocks from the first its next query reads.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_host_blocks: int = 0,
        enable_sharing: bool = True,
        groups: KVGroups = ONE_GROUP,
        num_state_slots: int = 0,
        num_host_state_slots: int = 0,
        num_state_snapshots: int = 0,
        state_chunk_size: int = 0,
        cache_generated_blocks: bool = True,
    ) -> None:
        self.block_size = block_size
        # Off for latent attention with expanded prompt rows (engine/layers/latent_prefill.py):
        # generated tokens' KV is computed another way than a prompt's, so only blocks of
        # prompt tokens serve later prompts.
        self.cache_generated_blocks = cache_generated_blocks
        self.groups = groups
        # The runner's chunked state kernel (kernels/chunked_gated_delta_rule.py): a prompt's
        # chunks end at its multiples, so every path cuts a prompt at the same places.
        self.state_chunk_size = state_chunk_size
        # Models with state layers: a slot per running sequence beside its blocks.
        self.states = StateSlotTable(num_state_slots, num_host_state_slots) if num_state_slots else None
        # Their prefix cache: states at block boundaries, in the rows after the running slots.
        self.snapshots = None
        if self.states is not None and enable_prefix_caching and num_state_snapshots:
            self.snapshots = StateSnapshots(num_state_snapshots, num_state_slots)
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        # Off only to measure what sharing saves: a sequence then copies every block it
        # shares before it next writes, so each owns its whole history.
        self.enable_sharing = enable_sharing
        self.num_host_blocks = num_host_blocks
        self._free_host_blocks: deque[int] = deque(range(num_host_blocks))
        self._sequences: dict[int, SequenceBlocks] = {}  # by Sequence.seq_id
        self.stats = CacheStats()
        self.pending = PendingCopies()
        # Blocks made full since the last `take_full_blocks`, kept only for a KV tier.
        self.collect_full_blocks = False
        self._full_blocks: list[FullBlock] = []
        self._kept_snapshots: list[KeptSnapshot] = []  # for a KV tier, until their copy ran

    # --- reading ------------------------------------------------------------------------

    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's blocks in order, one table per group (do not modify)."""
        record = self._sequences.get(seq.seq_id)
        return record.tables if record is not None else [[] for _ in self.groups.windows]

    def block_table(self, seq: Sequence) -> list[int]:
        """Group 0's table: with one group, the sequence's blocks in order (do not modify)."""
        return self.block_tables(seq)[0]

    def holds_blocks(self, seq: Sequence) -> bool:
        record = self._sequences.get(seq.seq_id)
        return record is not None and any(record.tables)

    def num_computed_tokens(self, seq: Sequence) -> int:
        record = self._sequences.get(seq.seq_id)
        return record.num_computed_tokens if record is not None else 0

    def state_slot(self, seq: Sequence) -> int | None:
        """The sequence's state-cache slot: its state after its computed tokens (None
        before it computes any, or for a model without state layers)."""
        return self.states.slot(seq.seq_id) if self.states is not None else None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def admissible_tokens(self, limit: int) -> int:
        """The longest context (at most `limit` tokens) the free blocks hold: what a new
        request can still be admitted with, in every group."""
        return self.groups.admissible_tokens(self.pool.num_free_blocks, self.block_size, limit)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only while no block is in use (False otherwise)."""
        reset = self.pool.reset_prefix_cache()
        if reset and self.snapshots is not None:
            self.snapshots.reset()
        return reset

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host_blocks)

    def enable_events(self) -> None:
        """Queue the prefix cache's changes for the fleet's index: the pool's blocks and, for
        a model with state layers, its snapshots (engine/core/block_pool.py)."""
        self.pool.enable_events()
        if self.snapshots is not None and self.snapshots.events is None:
            assert self.pool.events is not None, "enabled just above"
            self.snapshots.enable_events(self.pool.events)

    def state_usage(self) -> dict[str, int]:
        """The state cache's slots, free slots and kept snapshots (EngineStats' fields)."""
        if self.states is None:
            return {}
        return {
            "num_state_slots": self.states.device.num_slots,
            "num_free_state_slots": self.states.device.num_free_slots,
            "num_state_snapshots": self.snapshots.num_cached if self.snapshots is not None else 0,
        }

    def usage(self) -> CacheUsage:
        pool = self.pool
        num_shared, num_saved = pool.sharing
        return CacheUsage(
            pool.num_blocks, pool.num_free_blocks, pool.num_cached_blocks, num_shared, num_saved, pool.peak_used_blocks
        )

    def _record(self, seq: Sequence) -> SequenceBlocks:
        record = self._sequences.get(seq.seq_id)
        if record is None:
            record = self._sequences[seq.seq_id] = SequenceBlocks.empty(self.groups.num_groups)
        return record

    # --- allocation ---------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks (copy-on-write included) that computing `num_new_tokens` would take."""
        start = self.num_computed_tokens(seq)
        end_blocks = -(-(start + num_new_tokens) // self.block_size)
        needed = 0
        for table in self.block_tables(seq):
            needed += max(0, end_blocks - len(table)) + len(self._blocks_to_copy(table, start))
        return needed

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> SlotAllocation | None:
        """Make slots for tokens [num_computed, num_computed + num_new) writable.

        Copies the block the first new token lands in if other sequences share it. Returns
        None, changing nothing, if too few blocks are free.
        """
        if self.blocks_needed(seq, num_new_tokens) > self.pool.num_free_blocks:
            return None
        if self.states is not None and not self.states.try_take(seq.seq_id):
            return None
        record = self._record(seq)
        start = record.num_computed_tokens
        end_blocks = -(-(start + num_new_tokens) // self.block_size)
        copies, new_blocks = [], []
        for table in record.tables:
            for index in self._blocks_to_copy(table, start):
                shared = table[index]
                (copy,) = self.pool.try_allocate(1) or [None]
                assert copy is not None, "blocks_needed counted the copied blocks"
                copies.append((shared, copy))
                self.pool.free([shared])
                table[index] = copy
                self.stats.cow_copies += 1
            added = self.pool.try_allocate(max(0, end_blocks - len(table)))
            assert added is not None, "blocks_needed counted these blocks"
            table.extend(added)
            new_blocks += added
        self.pending.device.extend(copies)
        return SlotAllocation(new_blocks, copies)

    def _blocks_to_copy(self, table: list[int], start: int) -> list[int]:
        """Table indices to copy before writing from token `start` on: the shared block
        that token lands in (copy-on-write), or with sharing disabled every shared block."""
        if not self.enable_sharing:
            return [i for i, b in enumerate(table) if b != NULL_BLOCK and self.pool.ref_count(b) > 1]
        index = start // self.block_size
        shared = index < len(table) and table[index] != NULL_BLOCK and self.pool.ref_count(table[index]) > 1
        return [index] if shared and start % self.block_size != 0 else []

    def commit(self, seq: Sequence, num_new_tokens: int, keep_last_query: bool = False) -> int:
        """The forward pass wrote `num_new_tokens` more of the sequence's tokens; returns its
        computed-token count. Blocks that became full join the prefix cache; blocks behind
        a sliding window are freed. `keep_last_query`: keep too the window of the last
        computed token's query (a prefill replica's prompt: its decode replica computes
        that token again, on the blocks it pulls)."""
        record = self._record(seq)
        record.num_computed_tokens += num_new_tokens
        self._register_full_blocks(seq, record)
        self._snapshot_state(seq, record)
        self._free_behind_windows(record, record.num_computed_tokens - keep_last_query)
        return record.num_computed_tokens

    def chunk_end(self, seq: Sequence, start: int, end: int) -> int:
        """Where a chunk of the sequence's tokens [start, end) ends: `end`, or with state
        snapshots its prompt's last block boundary if it crosses it; with a chunked state
        kernel, inside the prompt, a multiple of its chunk (`start`, no token, if none fits)."""
        if self.snapshots is not None:
            end = snapshot_chunk_end(seq.num_prompt_tokens, self.block_size, start, end)
        size = self.state_chunk_size
        if size and end < seq.num_prompt_tokens:
            end = max(start, end // size * size)
        return end

    def _snapshot_state(self, seq: Sequence, record: SequenceBlocks) -> None:
        """A prompt's chunk that ended on a block boundary: its state kept by that block's hash."""
        computed, size = record.num_computed_tokens, self.block_size
        slot = self.states.slot(seq.seq_id) if self.states is not None else None
        if self.snapshots is None or slot is None or computed % size or not 0 < computed <= seq.num_prompt_tokens:
            return
        self._extend_hashes(seq, record, computed // size)
        block_hash = record.block_hashes[computed // size - 1]
        row = self.snapshots.keep(block_hash, slot, self.pending.state)
        if row is not None and self.collect_full_blocks:  # for the file tier, once copied
            self.snapshots.hold_row(row)
            self._kept_snapshots.append(KeptSnapshot(block_hash, self._block_tokens(seq, computed // size - 1), row))

    def state_copies_ran(self, copies: PendingCopies) -> list[KeptSnapshot]:
        """The runner ran a step's copies (`copies`): the snapshots they filled may be read
        from another thread now. Returns those kept for a KV tier, each held until
        `release_snapshot`."""
        copied_rows = {row for _, row in copies.state}
        if self.snapshots is not None and copied_rows:
            self.snapshots.mark_copied(copied_rows)
        copied = [kept for kept in self._kept_snapshots if kept.row in copied_rows]
        self._kept_snapshots = [kept for kept in self._kept_snapshots if kept.row not in copied_rows]
        return copied

    def hold_snapshot(self, block_hash: int) -> int | None:
        """The row of the state after the block of `block_hash`, held (never reused) until
        `release_snapshot`; None if no snapshot is kept for it."""
        return self.snapshots.hold(block_hash) if self.snapshots is not None else None

    def release_snapshot(self, row: int) -> None:
        assert self.snapshots is not None, "a row comes from hold_snapshot"
        self.snapshots.release(row)

    def _free_behind_windows(self, record: SequenceBlocks, position: int) -> None:
        """Free the blocks that a query at `position` (or later) cannot see."""
        groups = self.groups
        for group, table in enumerate(record.tables):
            # Freed places form a prefix of the table: walk back from the window to it.
            index = min(groups.first_needed_block(group, position, self.block_size), len(table)) - 1
            while index >= 0 and table[index] != NULL_BLOCK:
                self.pool.free([table[index]])
                table[index] = NULL_BLOCK
                index -= 1

    # --- prefix caching ---------------------------------------------------------------

    def find_prefix_hits(self, seq: Sequence, num_tokens: int) -> PrefixHit:
        """The cached blocks that the sequence's first `num_tokens` tokens start with: the
        longest prefix every group can serve (full groups: every block; sliding groups: the
        blocks of the window before the first token to compute). The last of those tokens
        is never a hit: its logits are needed."""
        num_groups = self.groups.num_groups
        if not self.enable_prefix_caching or (self.states is not None and self.snapshots is None):
            return PrefixHit([[] for _ in range(num_groups)], 0, 0)
        max_blocks = (num_tokens - 1) // self.block_size
        record = self._record(seq)
        self._extend_hashes(seq, record, max_blocks)
        cached = self._cached_blocks(record.block_hashes[:max_blocks], lambda index: self._block_tokens(seq, index))
        num_blocks = self._longest_hit(cached)
        state_row = None
        if self.snapshots is not None:  # the longest of those prefixes whose state is kept too
            num_blocks, state_row = self.snapshots.longest_hit(record.block_hashes, num_blocks)
        tables = []
        for group, blocks in enumerate(cached):
            first = self.groups.first_needed_block(group, num_blocks * self.block_size, self.block_size)
            tables.append([NULL_BLOCK] * first + [b for b in blocks[first:num_blocks] if b is not None])
        cost = sum(1 for table in tables for b in table if b != NULL_BLOCK and self.pool.is_evictable(b))
        return PrefixHit(tables, num_blocks, cost, state_row)

    def longest_cached_prefix(self, hashes: list[int], token_ids: list[int]) -> tuple[int, list[list[int]]]:
        """How many blocks of the chain `hashes` (of `token_ids`) the prefix cache can serve
        in every group, and per group its cached blocks of them that a sequence going on
        from there needs (`needed_blocks`). Only reads."""
        size = self.block_size
        if self.states is not None and self.snapshots is None:
            return 0, [[] for _ in self.groups.windows]
        cached = self._cached_blocks(hashes, lambda index: tuple(token_ids[index * size : (index + 1) * size]))
        num_blocks = self._longest_hit(cached)
        if self.snapshots is not None:  # and whose state is kept
            num_blocks = self.snapshots.longest_kept(hashes, num_blocks)
        ranges = needed_blocks(self.groups, num_blocks * size, size)
        tables = [
            [b for b in blocks[r.start : r.stop] if b is not None] for blocks, r in zip(cached, ranges, strict=True)
        ]
        return num_blocks, tables

    def _cached_blocks(
        self, hashes: list[int], block_tokens: Callable[[int], tuple[int, ...]]
    ) -> list[list[int | None]]:
        """Per group, per block of the chain `hashes`, the group's cached copy (None where a
        sliding group has none), up to the first block a full group misses: nothing after
        it can be used. `block_tokens(index)`: the tokens of block `index`."""
        windows = self.groups.windows
        cached: list[list[int | None]] = [[] for _ in windows]
        for index, block_hash in enumerate(hashes):
            tokens = block_tokens(index)
            found = [self.pool.try_lookup(block_hash, tokens, group) for group in range(len(windows))]
            if any(block_id is None and window is None for block_id, window in zip(found, windows, strict=True)):
                break
            for blocks, block_id in zip(cached, found, strict=True):
                blocks.append(block_id)
        return cached

    def _longest_hit(self, cached: list[list[int | None]]) -> int:
        """The most blocks of the prompt that every group holds what it needs for."""
        return longest_prefix(self.groups, len(cached[0]), self.block_size, lambda g, i: cached[g][i] is not None)

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count one request's prompt in the prefix-cache statistics (once per request)."""
        self.stats.prefix_queries += num_prompt_tokens
        self.stats.prefix_hits += num_hit_tokens

    def take_cached_prefix(self, seq: Sequence, hit: PrefixHit) -> None:
        """Start an empty sequence on a prefix hit, skipping the prefill of its tokens."""
        record = self._record(seq)
        assert not any(record.tables) and record.num_computed_tokens == 0, "prefix reuse needs a fresh sequence"
        for table in hit.tables:
            for block_id in table:
                if block_id != NULL_BLOCK:
                    self.pool.touch(block_id)
        record.tables = [list(table) for table in hit.tables]
        record.num_computed_tokens = hit.num_blocks * self.block_size
        record.num_registered_blocks = hit.num_blocks
        if self.states is not None:
            assert hit.state_row is not None, "a state model's hit comes with its snapshot"
            taken = self.states.try_take(seq.seq_id)
            assert taken, "a slot per sequence: admission counted this one"
            self.pending.state.append((hit.state_row, self.states.slot(seq.seq_id)))  # type: ignore[arg-type]

    def take_remote_prefix(self, seq: Sequence, remote: RemoteKV) -> bool:
        """Start an empty sequence on fresh blocks for the `remote.num_tokens` tokens another
        replica or a tier computed: in each group, the blocks it needs to go on from there
        (`needed_blocks`: a sliding group's last window), `NULL_BLOCK` before them. Their
        KV is loaded by `queue_load` once the request is scheduled. False (nothing changed)
        if too few blocks are free."""
        record = self._record(seq)
        assert not any(record.tables) and record.num_computed_tokens == 0, "a remote prefix needs a fresh sequence"
        assert (self.states is None) == (remote.state is None), "a state model's prefix comes with its state"
        ranges = needed_blocks(self.groups, remote.num_tokens, self.block_size)
        if self.pool.num_free_blocks < sum(len(r) for r in ranges):
            return False
        if self.states is not None and not self.states.try_take(seq.seq_id):
            return False
        blocks = self.pool.try_allocate(sum(len(r) for r in ranges))
        assert blocks is not None, "counted above"
        record.tables = []
        for blocks_needed in ranges:
            record.tables.append([NULL_BLOCK] * blocks_needed.start + blocks[: len(blocks_needed)])
            blocks = blocks[len(blocks_needed) :]
        record.num_computed_tokens = remote.num_tokens
        return True

    def queue_load(self, seq: Sequence, remote: RemoteKV) -> None:
        """Copy `remote` into the blocks `take_remote_prefix` gave the sequence, before the
        next forward pass: each layer the rows of its group's blocks."""
        tables = self.block_tables(seq)
        ranges = needed_blocks(self.groups, remote.num_tokens, self.block_size)
        load = KVLoad([], [], [])
        for layer, group in enumerate(self.groups.layer_groups):
            blocks = ranges[group]
            first = blocks.start - remote.first_block(layer)  # the remote's row of the first block
            assert first >= 0, "the remote KV lacks blocks this group needs (request_checks let it through)"
            load.block_ids.append(tables[group][blocks.start : blocks.stop])
            load.keys.append(remote.keys[layer][first : first + len(blocks)])
            load.values.append(remote.values[layer][first : first + len(blocks)])
        self.pending.loads.append(load)
        if self.states is not None:
            self.pending.state_loads.append((self.states.slot(seq.seq_id), remote.state))

    def prompt_blocks(self, seq: Sequence, num_prompt_tokens: int) -> list[list[int]]:
        """Per group, the blocks holding the sequence's prompt (a connector may keep them),
        `NULL_BLOCK` where a sliding group freed them."""
        num_blocks = -(-num_prompt_tokens // self.block_size)
        return [list(table[:num_blocks]) for table in self.block_tables(seq)]

    def _register_full_blocks(self, seq: Sequence, record: SequenceBlocks) -> None:
        """Publish blocks whose every slot is now computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(record.num_computed_tokens // self.block_size, min(len(t) for t in record.tables))
        if not self.cache_generated_blocks:
            num_full = min(num_full, seq.num_prompt_tokens // self.block_size)
        self._extend_hashes(seq, record, num_full)
        for index in range(record.num_registered_blocks, num_full):
            tokens = self._block_tokens(seq, index)
            for group, table in enumerate(record.tables):
                if table[index] == NULL_BLOCK:
                    continue
                block = FullBlock(table[index], record.block_hashes[index], tokens, group)
                self.pool.register(*block)
                if self.collect_full_blocks:
                    self._full_blocks.append(block)
        record.num_registered_blocks = max(record.num_registered_blocks, num_full)

    def take_full_blocks(self) -> list[FullBlock]:
        """The blocks made full since the last call (with `collect_full_blocks` on)."""
        taken, self._full_blocks = self._full_blocks, []
        return taken

    def _extend_hashes(self, seq: Sequence, record: SequenceBlocks, num_blocks: int) -> None:
        if len(record.block_hashes) < num_blocks:
            tokens = seq.token_ids[: num_blocks * self.block_size]
            record.block_hashes = block_hashes(tokens, self.block_size, seq.hash_root, record.block_hashes)

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    # --- sharing ------------------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (copy-on-write on the first write)."""
        assert not self.holds_blocks(child), "fork into a sequence that still holds blocks"
        source = self._record(parent)
        self.pool.incref(source.held())
        if self.states is not None:
            self.states.fork(parent.seq_id, child.seq_id, self.pending.state)
        self._sequences[child.seq_id] = SequenceBlocks(
            tables=[list(table) for table in source.tables],
            host_tables=[[] for _ in source.tables],
            num_computed_tokens=source.num_computed_tokens,
            # Only hashes of full blocks both share; the parent may have hashed its own outputs.
            block_hashes=source.block_hashes[: source.num_computed_tokens // self.block_size],
            num_registered_blocks=source.num_registered_blocks,
        )

    def free(self, seq: Sequence) -> None:
        """Release every block of the sequence and forget its progress."""
        record = self._sequences.pop(seq.seq_id, None)
        if record is not None:
            self._release(record.tables)
        if self.states is not None:
            slot = self.states.slot(seq.seq_id)
            # A prefix hit taken back (its request did not fit after all) leaves no copy behind.
            self.pending.state = [copy for copy in self.pending.state if copy[1] != slot]
            self.pending.state_loads = [load for load in self.pending.state_loads if load[0] != slot]
            self.states.free(seq.seq_id)

    def _release(self, tables: list[list[int]]) -> None:
        """Drop one reference from every block of `tables`, each table tail first (so a
        prefix-cached chain is evicted from its end)."""
        for table in tables:
            self.pool.free([b for b in reversed(table) if b != NULL_BLOCK])

    def free_request(self, request: Request) -> None:
        for seq in request.sequences:
            self.free(seq)

    # --- swapping -----------------------------------------------------------------------

    def _distinct_blocks(self, request: Request, on_host: bool = False) -> list[int]:
        """The request's device blocks (or, swapped out, its host copies), each once
        (siblings share), in table order."""
        records = [self._sequences.get(seq.seq_id) for seq in request.sequences]
        return list(dict.fromkeys(b for r in records if r is not None for b in r.held(on_host)))

    def can_swap_out(self, request: Request) -> bool:
        if self.states is not None and not self.states.can_swap_out(s.seq_id for s in request.sequences):
            return False
        return len(self._distinct_blocks(request)) <= len(self._free_host_blocks)

    def swap_out(self, request: Request) -> None:
        """Move the request's blocks to host memory; shared blocks are copied once."""
        to_host: dict[int, int] = {NULL_BLOCK: NULL_BLOCK}
        for seq in request.sequences:
            record = self._record(seq)
            for block_id in record.held():
                if block_id not in to_host:
                    to_host[block_id] = self._free_host_blocks.popleft()
                    self.pending.swap_out.append((block_id, to_host[block_id]))
            self._release(record.tables)
            record.host_tables = [[to_host[b] for b in table] for table in record.tables]
            record.tables = [[] for _ in record.tables]
            record.num_registered_blocks = 0  # the device copies may be evicted meanwhile
        if self.states is not None:
            self.states.swap_out((s.seq_id for s in request.sequences), self.pending.state_swap_out)

    def swap_in_cost(self, request: Request) -> int:
        return len(self._distinct_blocks(request, on_host=True))

    def swap_in(self, request: Request) -> None:
        """Bring a swapped request's blocks back to the device, keeping them shared. The
        caller has checked that `swap_in_cost(request)` blocks are free."""
        distinct = self._distinct_blocks(request, on_host=True)
        device_ids = self.pool.try_allocate(len(distinct))
        assert device_ids is not None, "swap_in without the free blocks swap_in_cost asked for"
        to_device = dict(zip(distinct, device_ids, strict=True))
        self.pending.swap_in.extend(to_device.items())
        to_device[NULL_BLOCK] = NULL_BLOCK
        seen: set[int] = set()
        for seq in request.sequences:
            record = self._record(seq)
            record.tables = [[to_device[b] for b in table] for table in record.host_tables]
            record.host_tables = [[] for _ in record.tables]
            # try_allocate gave each block one reference; every further sharer adds one.
            held = record.held()
            self.pool.incref([b for b in held if b in seen])
            seen.update(held)
        self._free_host_blocks.extend(distinct)
        if self.states is not None:
            self.states.swap_in((s.seq_id for s in request.sequences), self.pending.state_swap_in)

    def release_host_blocks(self, request: Request) -> None:
        """Drop a swapped request's host copies (it was aborted while swapped out)."""
        self._free_host_blocks.extend(self._distinct_blocks(request, on_host=True))
        for seq in request.sequences:
            self._sequences.pop(seq.seq_id, None)
            if self.states is not None:
                self.states.free(seq.seq_id)
