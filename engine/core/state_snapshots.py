"""Prefix caching for state layers: copies of a sequence's state at block boundaries of its
prompt, kept by the hash of the block that ends there.

An attention layer's prefix is its cached blocks; a state layer's is one state, after
exactly the prefix's tokens. So when a prompt's chunk ends on a block boundary the engine
copies the sequence's state slot into a snapshot row, and a later prompt that starts with
the same blocks resumes from the longest prefix for which every attention group holds the
blocks and a snapshot holds the state (the scheduler ends a prompt's chunk at its last
block boundary so that there is one). Snapshots are rows of the state cache after the
running slots, kept least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict

from pagefleet.engine.core.state_slots import StateCopy


class StateSnapshots:
    """`num_snapshots` rows, from row `first_row` of the state cache. Written by
    KVCacheManager alone."""

    def __init__(self, num_snapshots: int, first_row: int) -> None:
        self.num_snapshots = num_snapshots
        self._free = list(range(first_row + num_snapshots - 1, first_row - 1, -1))
        self._rows: OrderedDict[int, int] = OrderedDict()  # block hash -> row, oldest use first

    @property
    def num_cached(self) -> int:
        return len(self._rows)

    def try_lookup(self, block_hash: int) -> int | None:
        """The row holding the state after the block of `block_hash`, marked recently used."""
        row = self._rows.get(block_hash)
        if row is not None:
            self._rows.move_to_end(block_hash)
        return row

    def row_for(self, block_hash: int) -> int:
        """A row to copy the state after that block into: its own if it has one, else a free
        row or the least recently used one's."""
        row = self._rows.pop(block_hash, None)
        if row is None:
            row = self._free.pop() if self._free else self._rows.popitem(last=False)[1]
        self._rows[block_hash] = row
        return row

    def longest_hit(self, block_hashes: list[int], num_blocks: int) -> tuple[int, int | None]:
        """Of a prompt's first `num_blocks` blocks (all cached in the attention groups), the
        most whose state is kept, and its row (marked recently used)."""
        while num_blocks and block_hashes[num_blocks - 1] not in self._rows:
            num_blocks -= 1
        return num_blocks, self.try_lookup(block_hashes[num_blocks - 1]) if num_blocks else None

    def keep(self, block_hash: int, slot: int, copies: list[StateCopy]) -> None:
        """Keep slot `slot`'s state as the one after the block of `block_hash` (once: the
        same blocks give the same state)."""
        if block_hash not in self._rows:
            copies.append((slot, self.row_for(block_hash)))

    def reset(self) -> None:
        self._free.extend(self._rows.values())
        self._rows.clear()


def snapshot_chunk_end(num_prompt_tokens: int, block_size: int, start: int, end: int) -> int:
    """Where a prompt's chunk [start, end) ends: at the prompt's last block boundary before
    its last token if it would cross it (the longest prefix a later prompt can take from
    the cache), else at `end`."""
    boundary = (num_prompt_tokens - 1) // block_size * block_size
    return boundary if start < boundary < end else end
