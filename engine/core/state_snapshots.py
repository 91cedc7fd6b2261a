"""Prefix caching for state layers: copies of a sequence's state at block boundaries of its
prompt, kept by the hash of the block that ends there.

An attention layer's prefix is its cached blocks; a state layer's is one state, after
exactly the prefix's tokens. So when a prompt's chunk ends on a block boundary the engine
copies the sequence's state slot into a snapshot row, and a later prompt that starts with
the same blocks resumes from the longest prefix for which every attention group holds the
blocks and a snapshot holds the state (the scheduler ends a prompt's chunk at its last
block boundary so that there is one). Snapshots are rows of the state cache after the
running slots, kept least recently used first out.

A connector moving a prefix out of the replica (a prefill replica's pinned prompt, a peer's
pull, the file tier's writer) holds its snapshot row while it copies it: a held row is
never reused for another snapshot, so it keeps its bits under a reader on another thread.
A row is held only once the copy that fills it has run (the step after it was kept): a
reader beside that step would read it half written.

With events on, keeping and forgetting a snapshot queue a `KVEvent` of its name in the
fleet's index (`state_snapshot_hash` of its block's), beside the block pool's events.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque

from pagefleet.engine.core.block_pool import KVEvent
from pagefleet.engine.core.state_slots import StateCopy
from pagefleet.protocol.block_hash import state_snapshot_hash


class StateSnapshots:
    """`num_snapshots` rows, from row `first_row` of the state cache. Written by
    KVCacheManager alone."""

    def __init__(self, num_snapshots: int, first_row: int) -> None:
        self.num_snapshots = num_snapshots
        self._free = list(range(first_row + num_snapshots - 1, first_row - 1, -1))
        self._rows: OrderedDict[int, int] = OrderedDict()  # block hash -> row, oldest use first
        self._held: Counter[int] = Counter()  # row -> holds (never reused while held)
        self._uncopied: set[int] = set()  # rows whose filling copy has not run yet
        self.events: deque[KVEvent] | None = None  # the block pool's queue, once events are on

    def enable_events(self, events: deque[KVEvent]) -> None:
        """Queue events into `events` from now on, the snapshots kept already first."""
        events.extend(KVEvent(state_snapshot_hash(block_hash), True) for block_hash in self._rows)
        self.events = events

    def _event(self, block_hash: int, stored: bool) -> None:
        if self.events is not None:
            self.events.append(KVEvent(state_snapshot_hash(block_hash), stored))

    @property
    def num_cached(self) -> int:
        return len(self._rows)

    @property
    def num_held(self) -> int:
        """Rows a connector holds now (a pin, a pull's or a save's copy)."""
        return len(self._held)

    def try_lookup(self, block_hash: int) -> int | None:
        """The row holding the state after the block of `block_hash`, marked recently used."""
        row = self._rows.get(block_hash)
        if row is not None:
            self._rows.move_to_end(block_hash)
        return row

    def _row_for(self, block_hash: int) -> int | None:
        """A row to copy the state after that block into: a free row, else the least
        recently used unheld one's; None if every row is held."""
        if self._free:
            row = self._free.pop()
        else:
            evicted = next((h for h, r in self._rows.items() if not self._held[r]), None)
            if evicted is None:
                return None
            row = self._rows.pop(evicted)
            self._event(evicted, False)
        self._rows[block_hash] = row
        self._event(block_hash, True)
        return row

    def hold(self, block_hash: int) -> int | None:
        """The row of the state after that block, held until `release` (None: not kept, or
        its copy has not run yet)."""
        row = self._rows.get(block_hash)
        if row is None or row in self._uncopied:
            return None
        self._rows.move_to_end(block_hash)
        self._held[row] += 1
        return row

    def hold_row(self, row: int) -> None:
        """Hold a row just kept, for a reader that waits for its copy (the file tier's)."""
        self._held[row] += 1

    def mark_copied(self, rows: set[int]) -> None:
        """The copies into `rows` ran: they may be held."""
        self._uncopied -= rows

    def release(self, row: int) -> None:
        assert self._held[row] > 0, f"snapshot row {row} released more than held"
        self._held[row] -= 1
        if not self._held[row]:
            del self._held[row]
            if row not in self._rows.values():  # forgotten by a reset while held
                self._free.append(row)

    def longest_hit(self, block_hashes: list[int], num_blocks: int) -> tuple[int, int | None]:
        """Of a prompt's first `num_blocks` blocks (all cached in the attention groups), the
        most whose state is kept, and its row (marked recently used)."""
        num_blocks = self.longest_kept(block_hashes, num_blocks)
        return num_blocks, self.try_lookup(block_hashes[num_blocks - 1]) if num_blocks else None

    def longest_kept(self, block_hashes: list[int], num_blocks: int) -> int:
        """The most of the first `num_blocks` blocks whose state is kept (only reads)."""
        while num_blocks and block_hashes[num_blocks - 1] not in self._rows:
            num_blocks -= 1
        return num_blocks

    def keep(self, block_hash: int, slot: int, copies: list[StateCopy]) -> int | None:
        """Keep slot `slot`'s state as the one after the block of `block_hash` (once: the
        same blocks give the same state); the new row, or None if none was taken."""
        if block_hash in self._rows:
            self._rows.move_to_end(block_hash)
            return None
        row = self._row_for(block_hash)
        if row is not None:
            copies.append((slot, row))
            self._uncopied.add(row)
        return row

    def reset(self) -> None:
        """Forget every snapshot (a held one stays until released, unnamed)."""
        for block_hash, row in list(self._rows.items()):
            if not self._held[row]:
                self._free.append(row)
            del self._rows[block_hash]
            self._event(block_hash, False)


def snapshot_chunk_end(num_prompt_tokens: int, block_size: int, start: int, end: int) -> int:
    """Where a prompt's chunk [start, end) ends: at the prompt's last block boundary before
    its last token if it would cross it (the longest prefix a later prompt can take from
    the cache), else at `end`."""
    boundary = (num_prompt_tokens - 1) // block_size * block_size
    return boundary if start < boundary < end else end
