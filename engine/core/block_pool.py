"""The pool of physical KV blocks: reference counts, the prefix-cache index, eviction.

Free blocks live in two queues. Blocks that hold no cached prefix are handed out first;
blocks that still hold a cached prefix (hash registered, no references) are evicted only
when the first queue is empty, least recently freed first. A freed block keeps its hash, so
a later request with the same prefix can take it back (`touch`) until it is reallocated.

The cache is keyed by (KV cache group, chain hash): each group of layers keeps its own copy
of a prefix's blocks (engine/core/kv_groups.py).

With events on, every change to group 0's set of cached hashes is queued as a `KVEvent`
(stored when a block is registered, removed when its hash is forgotten), in order, for the
server to publish to the fleet's prefix index off the step thread (engine/server/kv_events.py).
Group 0 is a full-attention group wherever the model has one: it holds a prompt's every block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple


class KVEvent(NamedTuple):
    block_hash: int
    stored: bool  # True: now cached here; False: no longer


def take_events(events: deque[KVEvent]) -> list[KVEvent]:
    """Everything queued so far, oldest first. Safe against a step thread appending meanwhile
    (deque.popleft and append are atomic): nothing is lost or taken twice."""
    taken = []
    while events:
        taken.append(events.popleft())
    return taken


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # Chained hash of this block's tokens and all before it; None unless full and registered.
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    group: int = 0  # the KV cache group whose layers' keys and values it holds, while cached


class BlockPool:
    """Owns every block id in [0, num_blocks).

    Invariant: a block is in exactly one of {a free queue, referenced (ref_count > 0)}.

    A block's record is made when it is first handed out, not up front: a tiny model's 1 GiB
    cache holds over 100,000 blocks, whose records took a second to build. Untouched ids
    leave the free queue in increasing order (freed blocks rejoin at its back), so the
    records are always those of ids 0 to len(blocks) - 1.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks: list[Block] = []  # every block handed out so far; the rest are untouched and free
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._cached: dict[tuple[int, int], int] = {}  # (group, block hash) -> block id
        self.num_evictions = 0
        self.peak_used_blocks = 0  # high-water mark of blocks taken at once
        self._num_shared = 0  # blocks with ref_count > 1
        self._num_saved = 0  # sum of (ref_count - 1) over those
        self.events: deque[KVEvent] | None = None  # queued only once `enable_events` is called

    def enable_events(self) -> None:
        """Queue a KVEvent for every hash cached or forgotten from now on (the replica
        publishes them); the hashes cached already are reported as stored first."""
        if self.events is None:
            self.events = deque(KVEvent(block_hash, True) for group, block_hash in self._cached if group == 0)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take now (cached ones included: they are evictable)."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def sharing(self) -> tuple[int, int]:
        """(blocks referenced more than once, blocks that sharing saves: the references
        beyond the first, each of which would otherwise be a copy)."""
        return self._num_shared, self._num_saved

    def _add_ref(self, block: Block) -> None:
        if block.ref_count >= 1:
            self._num_saved += 1
            self._num_shared += block.ref_count == 1
        block.ref_count += 1

    def _record(self, block_id: int) -> Block:
        """The block's record, made for an id handed out for the first time."""
        if block_id == len(self.blocks):
            self.blocks.append(Block(block_id))
        return self.blocks[block_id]

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count if block_id < len(self.blocks) else 0

    def try_allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh blocks with ref_count 1, or None if there are not enough."""
        if num_blocks > self.num_free_blocks:
            return None
        allocated = []
        for _ in range(num_blocks):
            if self._free_uncached:
                block = self._record(self._free_uncached.popleft())
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block = self.blocks[block_id]
                self._forget(block)
                self.num_evictions += 1
            assert block.ref_count == 0, f"block {block.block_id} was free with references"
            block.ref_count = 1
            allocated.append(block.block_id)
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - self.num_free_blocks)
        return allocated

    def incref(self, block_ids: list[int]) -> None:
        """Add one reference to blocks already in use (sharing between sequences)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"incref of free block {block_id}: use touch()"
            self._add_ref(block)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. Callers pass a table tail first, so a
        request's deepest blocks are evicted before the prefixes others may share."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            if block.ref_count >= 2:
                self._num_saved -= 1
                self._num_shared -= block.ref_count == 2
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free_uncached.append(block_id)
                else:
                    self._evictable[block_id] = None

    def try_lookup(self, block_hash: int, token_ids: tuple[int, ...], group: int = 0) -> int | None:
        """The group's cached block holding exactly these tokens after this chain, or None."""
        block_id = self._cached.get((group, block_hash))
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def try_hold(self, block_id: int, block_hash: int, group: int = 0) -> bool:
        """A reference on a block that still holds `block_hash`'s contents for `group`: in
        use, or cached and free (its request finished in the step that filled it). False
        for a block freed uncached (a copy of a block cached elsewhere) or never handed out."""
        if block_id >= len(self.blocks):
            return False
        block = self.blocks[block_id]
        if block.ref_count > 0:
            self._add_ref(block)
            return True
        if block.block_hash == block_hash and block.group == group and block_id in self._evictable:
            self.touch(block_id)
            return True
        return False

    def touch(self, block_id: int) -> None:
        """Take a reference on a cached block (a prefix hit), reviving it if it was free."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
            self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - self.num_free_blocks)
        self._add_ref(block)

    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...], group: int = 0) -> None:
        """Publish a full block's contents for prefix reuse (after the step that wrote it).

        A block whose prefix is already cached elsewhere in its group stays unregistered:
        one copy is enough, and this one is freed as an ordinary block.
        """
        block = self.blocks[block_id]
        if block.block_hash is not None or (group, block_hash) in self._cached:
            return
        block.block_hash, block.token_ids, block.group = block_hash, token_ids, group
        self._cached[(group, block_hash)] = block_id
        if self.events is not None and group == 0:
            self.events.append(KVEvent(block_hash, True))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block's contents, if no block is referenced; else False."""
        if self.num_free_blocks < self.num_blocks:
            return False
        for block_id in self._evictable:
            self._forget(self.blocks[block_id])
            self._free_uncached.append(block_id)
        self._evictable.clear()
        return True

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None and self._cached.get((block.group, block.block_hash)) == block.block_id:
            del self._cached[(block.group, block.block_hash)]
            if self.events is not None and block.group == 0:
                self.events.append(KVEvent(block.block_hash, False))
        block.block_hash, block.token_ids, block.group = None, (), 0
