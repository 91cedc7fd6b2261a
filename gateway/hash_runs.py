"""Block hashes for prompts that start as earlier ones did, without walking the whole chain.

A router sees the same long system prompts request after request (llm-d's b2b-saas: 150
tenants' prompts of 6,000 tokens). `block_hash.block_hashes` with its per-link memo still
takes a dictionary lookup per block, 386 of them for such a prompt. This memo keeps, per
first block, the last chain that began with it: a new prompt reuses that chain's hashes for
as many leading blocks as its tokens equal byte for byte (a binary search over slices), and
hashes only the rest. The hashes stay those of `block_hashes`, the one definition.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pagefleet.protocol.block_hash import block_hashes, pack_tokens

_RUNS_KEPT = 4096  # first blocks remembered per model, least recently used forgotten first


class HashRuns:
    def __init__(self, kept: int = _RUNS_KEPT) -> None:
        self.kept = kept
        self._runs: OrderedDict[tuple[int, bytes], tuple[bytes, list[int]]] = OrderedDict()

    def hashes(self, token_ids: Sequence[int], block_size: int, root: int, known: dict[bytes, int]) -> list[int]:
        """`block_hashes(token_ids, block_size, root, known=known)`, reusing the leading
        hashes of the last chain that began with the same block."""
        stride = block_size * 4
        packed = pack_tokens(token_ids[: len(token_ids) // block_size * block_size])
        if not packed:
            return []
        key = (root, packed[:stride])
        run = self._runs.get(key)
        shared = _equal_blocks(packed, run[0], stride) if run is not None else 0
        parents = run[1][:shared] if run is not None else []
        hashes = block_hashes(token_ids, block_size, root, parents=parents, known=known)
        if run is None or len(packed) >= len(run[0]) or shared * stride < len(run[0]):
            self._runs[key] = (packed, hashes)  # the latest chain, unless it is a prefix of the kept one
        self._runs.move_to_end(key)
        if len(self._runs) > self.kept:
            self._runs.popitem(last=False)
        return hashes


def _equal_blocks(a: bytes, b: bytes, stride: int) -> int:
    """How many leading blocks of `stride` bytes `a` and `b` share."""
    low, high = 0, min(len(a), len(b)) // stride  # a[:low * stride] == b[:low * stride] holds
    while low < high:
        middle = (low + high + 1) // 2
        if a[: middle * stride] == b[: middle * stride]:
            low = middle
        else:
            high = middle - 1
    return low
