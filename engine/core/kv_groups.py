"""KV cache groups: which layers share a block table, and which cache tensors each layer uses.

Layers are grouped by the keys they see: full attention, or a sliding window of W keys.
Every group has the same number of layers, so that one block id means the same number of
bytes in every group and all groups draw from one block pool (vLLM's hybrid KV cache
manager). Layer j of every group writes into cache tensor j:

    layers:  0s 1s 2s 3s 4s 5f | 6s 7s 8s 9s 10s 11f       (s: sliding, f: full)
    groups:  full [5 11]  sliding [0 1] [2 3] [4 6] [7 8] [9 10]
    tensors: 2 pairs; layer 5 and layer 0 both write tensor 0, in blocks of their own group

A sequence holds one block table per group. A sliding group's table keeps only the blocks
that a query can still see; those that fall behind the window are freed, and their places
hold `NULL_BLOCK`. With one attention type (Llama, or Mistral's all-sliding layers) there
is one group of every layer, one tensor per layer, as in a plain paged cache.

The layers here are the model's cache layers: a layer that reads another's KV (Gemma 4's
KV-shared layers) has no cache of its own and is not grouped; the runner gives it its
source's cache (`ModelConfig.cache_layers`). Layers whose keys differ in shape (Gemma 4's
global layers: another head size, fewer heads) share a tensor index all the same: its
block id has one page sized for the larger, which each layer views in its own shape
(`padded_view` in worker/model_runner.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

NULL_BLOCK = -1  # a table entry whose block was freed: behind a sliding window, never read


@dataclass(slots=True, frozen=True)
class KVGroups:
    """The grouping of a model's layers. `windows[g]`: the keys group g's layers see (the
    last W; None: all). Full groups come first, so group 0 is a full one where any is."""

    windows: tuple[int | None, ...]
    layer_groups: tuple[int, ...]  # per layer, its group
    layer_tensors: tuple[int, ...]  # per layer, the cache tensor pair it writes
    num_tensors: int  # cache tensor pairs (layers per group)

    @classmethod
    def of(cls, layer_windows: list[int | None], hybrid: bool = True) -> KVGroups:
        """Group layers by window. With `hybrid` off every layer is in one full group (each
        layer still attends over its own window; its cache simply keeps every block)."""
        num_layers = len(layer_windows)
        kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
        if not hybrid or len(kinds) == 1:
            window = kinds[0] if hybrid else None
            return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)
        by_kind = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
        size = min(len(layers) for layers in by_kind.values())
        windows: list[int | None] = []
        layer_groups, layer_tensors = [0] * num_layers, [0] * num_layers
        for kind, layers in by_kind.items():
            for start in range(0, len(layers), size):
                for tensor, layer in enumerate(layers[start : start + size]):
                    layer_groups[layer], layer_tensors[layer] = len(windows), tensor
                windows.append(kind)
        return cls(tuple(windows), tuple(layer_groups), tuple(layer_tensors), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_groups)

    def first_needed_block(self, group: int, position: int, block_size: int) -> int:
        """The first block a query at `position` (or later) reads in `group`."""
        window = self.windows[group]
        return 0 if window is None else max(0, position - window + 1) // block_size

    def blocks_for_tokens(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of `num_tokens` computed tokens holds at most while it decodes:
        every block in full groups, the window's in sliding ones."""
        blocks = -(-num_tokens // block_size)
        return sum(blocks if w is None else min(blocks, window_blocks(w, block_size)) for w in self.windows)

    def admissible_tokens(self, num_free_blocks: int, block_size: int, limit: int) -> int:
        """The longest context (at most `limit` tokens) that `num_free_blocks` hold."""
        low, high = 0, limit
        while low < high:
            middle = (low + high + 1) // 2
            if self.blocks_for_tokens(middle, block_size) <= num_free_blocks:
                low = middle
            else:
                high = middle - 1
        return low


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks a query's window of `window` keys spans (it may start mid-block)."""
    return -(-(window - 1) // block_size) + 1


ONE_GROUP = KVGroups.of([None])  # one full group: a plain paged cache, as the manager's default


def needed_blocks(groups: KVGroups, num_tokens: int, block_size: int) -> list[range]:
    """Per group, the blocks of a `num_tokens`-token prefix that a sequence going on from it
    reads: every block in a full group, the last window's in a sliding one. What a transfer,
    a tier load or a peer pull moves for the prefix, and all it moves."""
    num_blocks = -(-num_tokens // block_size)
    first = [min(groups.first_needed_block(g, num_tokens, block_size), num_blocks) for g in range(groups.num_groups)]
    return [range(start, num_blocks) for start in first]


def longest_prefix(groups: KVGroups, limit: int, block_size: int, has: Callable[[int, int], bool]) -> int:
    """The most blocks (at most `limit`) of a prefix that every group can serve: each has
    the blocks `needed_blocks` names for it. `has(group, index)`: whether it holds one."""
    full = [g for g, window in enumerate(groups.windows) if window is None]
    for index in range(limit):  # nothing past a full group's first miss can be served
        if not all(has(g, index) for g in full):
            limit = index
            break
    for num_blocks in range(limit, 0, -1):
        ranges = needed_blocks(groups, num_blocks * block_size, block_size)
        if all(has(g, index) for g, blocks in enumerate(ranges) for index in blocks):
            return num_blocks
    return 0


def groups_from(windows: tuple[int | None, ...], layer_groups: tuple[int, ...]) -> KVGroups:
    """The grouping another replica describes by its windows and each layer's group (its
    `KVLayout`): layer j of a group writes tensor j, as `KVGroups.of` lays them out."""
    seen: dict[int, int] = {}
    tensors = []
    for group in layer_groups:
        tensors.append(seen.get(group, 0))
        seen[group] = tensors[-1] + 1
    return KVGroups(windows, layer_groups, tuple(tensors), max(seen.values(), default=0))


def group_layers(groups: KVGroups, group: int) -> list[int]:
    """The layers of `group`, in order (layer j writes the group's tensor j)."""
    return [layer for layer, g in enumerate(groups.layer_groups) if g == group]
