"""Block tables of sequences on top of the block pool: allocation on demand, prefix
caching, forking with copy-on-write, and swapping to a host-memory pool.

The manager only does bookkeeping. Data movement it decides (copy-on-write copies, swap
copies) is returned to the caller, which hands it to the model runner before the step's
forward pass writes anything.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagefleet.engine.block_pool import BlockPool
from pagefleet.engine.request import Request, Sequence

BlockCopy = tuple[int, int]  # (source block id, destination block id)


@dataclass(slots=True)
class CacheStats:
    prefix_queries: int = 0  # prompt tokens looked up
    prefix_hits: int = 0  # of which served from the cache
    cow_copies: int = 0


@dataclass(slots=True)
class PendingCopies:
    """Copies to run before the next forward pass, in this order."""

    swap_out: list[BlockCopy] = field(default_factory=list)  # device -> host
    swap_in: list[BlockCopy] = field(default_factory=list)  # host -> device
    device: list[BlockCopy] = field(default_factory=list)  # copy-on-write

    def take(self) -> PendingCopies:
        taken = PendingCopies(self.swap_out, self.swap_in, self.device)
        self.swap_out, self.swap_in, self.device = [], [], []
        return taken


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_host_blocks: int = 0,
        enable_sharing: bool = True,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        # Off only to measure what sharing saves: a sequence then copies every block it
        # shares before it next writes, so each owns its whole history.
        self.enable_sharing = enable_sharing
        self.num_host_blocks = num_host_blocks
        self._free_host_blocks: deque[int] = deque(range(num_host_blocks))
        self.stats = CacheStats()
        self.pending = PendingCopies()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host_blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks (copy-on-write included) that computing `num_new_tokens` would take."""
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens
        needed = max(0, -(-end // self.block_size) - len(seq.block_ids))
        return needed + len(self._blocks_to_copy(seq, start))

    def try_allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make slots for tokens [num_computed, num_computed + num_new) writable.

        Copies the block the first new token lands in if other sequences share it. Returns
        False, changing nothing, if too few blocks are free.
        """
        if self.blocks_needed(seq, num_new_tokens) > self.pool.num_free_blocks:
            return False
        start = seq.num_computed_tokens
        for index in self._blocks_to_copy(seq, start):
            shared = seq.block_ids[index]
            (copy,) = self.pool.try_allocate(1) or [None]
            assert copy is not None, "blocks_needed counted the copied blocks"
            self.pending.device.append((shared, copy))
            self.pool.free([shared])
            seq.block_ids[index] = copy
            self.stats.cow_copies += 1
        end_blocks = -(-(start + num_new_tokens) // self.block_size)
        new_blocks = self.pool.try_allocate(max(0, end_blocks - len(seq.block_ids)))
        assert new_blocks is not None, "blocks_needed counted these blocks"
        seq.block_ids.extend(new_blocks)
        return True

    def _blocks_to_copy(self, seq: Sequence, start: int) -> list[int]:
        """Table indices to copy before writing from token `start` on: the shared block
        that token lands in (copy-on-write), or with sharing disabled every shared block."""
        if not self.enable_sharing:
            return [i for i, block_id in enumerate(seq.block_ids) if self.pool.ref_count(block_id) > 1]
        index = start // self.block_size
        shared = index < len(seq.block_ids) and self.pool.ref_count(seq.block_ids[index]) > 1
        return [index] if shared and start % self.block_size != 0 else []

    # --- prefix caching ---------------------------------------------------------------

    def find_prefix_hits(self, seq: Sequence, num_tokens: int) -> tuple[list[int], int]:
        """Cached blocks that the sequence's first `num_tokens` tokens start with, and how
        many free blocks taking them would consume (hits on evictable blocks leave the free
        queue). The last of those tokens is never a hit: its logits are needed."""
        hits = self._find_cached_prefix(seq, num_tokens)
        return hits, sum(1 for block_id in hits if self.pool.is_evictable(block_id))

    def take_cached_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Start an empty sequence on `hits`, skipping the prefill of their tokens."""
        assert not seq.block_ids and seq.num_computed_tokens == 0, "prefix reuse needs a fresh sequence"
        for block_id in hits:
            self.pool.touch(block_id)
        seq.block_ids = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)

    def _find_cached_prefix(self, seq: Sequence, num_tokens: int) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        max_blocks = (num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        hits = []
        for index in range(max_blocks):
            block_id = self.pool.try_lookup(seq.block_hashes[index], self._block_tokens(seq, index))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish blocks whose every slot is now computed (call after the step ran)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        self._extend_hashes(seq, num_full)
        for index in range(seq.num_registered_blocks, num_full):
            self.pool.register(seq.block_ids[index], seq.block_hashes[index], self._block_tokens(seq, index))
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        while len(seq.block_hashes) < num_blocks:
            index = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else 0
            seq.block_hashes.append(hash((parent, self._block_tokens(seq, index))))

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    # --- sharing ------------------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (copy-on-write on the first write)."""
        assert not child.block_ids, "fork into a sequence that still holds blocks"
        self.pool.incref(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        # Only hashes of full blocks both share; the parent may have hashed its own outputs.
        child.block_hashes = parent.block_hashes[: parent.num_computed_tokens // self.block_size]
        child.num_registered_blocks = parent.num_registered_blocks

    def free(self, seq: Sequence) -> None:
        """Release every block of the sequence (tail first) and reset its progress."""
        self.pool.free(seq.block_ids[::-1])
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def free_request(self, request: Request) -> None:
        for seq in request.sequences:
            self.free(seq)

    # --- swapping -----------------------------------------------------------------------

    @staticmethod
    def _distinct_blocks(request: Request) -> list[int]:
        """The request's blocks, each once (siblings share), in table order."""
        return list(dict.fromkeys(b for seq in request.sequences for b in seq.block_ids))

    def can_swap_out(self, request: Request) -> bool:
        return len(self._distinct_blocks(request)) <= len(self._free_host_blocks)

    def swap_out(self, request: Request) -> None:
        """Move the request's blocks to host memory; shared blocks are copied once."""
        to_host: dict[int, int] = {}
        for seq in request.sequences:
            host_ids = []
            for block_id in seq.block_ids:
                if block_id not in to_host:
                    to_host[block_id] = self._free_host_blocks.popleft()
                    self.pending.swap_out.append((block_id, to_host[block_id]))
                host_ids.append(to_host[block_id])
            self.pool.free(seq.block_ids[::-1])
            seq.block_ids = host_ids
            seq.num_registered_blocks = 0  # the device copies may be evicted meanwhile

    def swap_in_cost(self, request: Request) -> int:
        return len(self._distinct_blocks(request))

    def try_swap_in(self, request: Request) -> bool:
        """Bring a swapped request's blocks back to the device, keeping them shared."""
        distinct = self._distinct_blocks(request)
        device_ids = self.pool.try_allocate(len(distinct))
        if device_ids is None:
            return False
        to_device = dict(zip(distinct, device_ids, strict=True))
        self.pending.swap_in.extend(to_device.items())
        seen: set[int] = set()
        for seq in request.sequences:
            new_table = [to_device[b] for b in seq.block_ids]
            # try_allocate gave each block one reference; every further sharer adds one.
            self.pool.incref([b for b in new_table if b in seen])
            seen.update(new_table)
            seq.block_ids = new_table
        self._free_host_blocks.extend(distinct)
        return True

    def release_host_blocks(self, request: Request) -> None:
        """Drop a swapped request's host copies (it was aborted while swapped out)."""
        self._free_host_blocks.extend(self._distinct_blocks(request))
        for seq in request.sequences:
            seq.block_ids = []
            seq.num_computed_tokens = 0
