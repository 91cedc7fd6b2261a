"""The connectors' worker side: KV moved between the device cache and host tensors.

`load_blocks` runs on the runner before a step's forward pass (the loads the scheduler
planned); `read_blocks` copies blocks out for a save or a pull, from any thread, and is
safe beside a running step only for blocks that hold a reference (nothing rewrites them).

With KV cache groups, layers of different groups share a cache tensor pair but not block
ids: a layer's rows are read from, and written to, the blocks of its own group.
"""

from __future__ import annotations

import torch

from pagefleet.engine.kv_transfer.params import KVLoad

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [blocks, ...]


def load_blocks(kv_caches: KVCaches, loads: list[KVLoad]) -> None:
    for load in loads:
        device = kv_caches[0][0].device
        layers = zip(kv_caches, load.block_ids, load.keys, load.values, strict=True)
        for (key_cache, value_cache), block_ids, keys, values in layers:
            index = torch.tensor(block_ids, dtype=torch.long, device=device)
            key_cache[index] = keys.to(key_cache.device, key_cache.dtype)
            value_cache[index] = values.to(value_cache.device, value_cache.dtype)


def read_blocks(kv_caches: KVCaches, layer_groups: tuple[int, ...], block_ids: list[list[int]]) -> KVCaches:
    """Host copies of keys and values, layer by layer: each layer's of `block_ids[g]`, the
    blocks of its group g (`layer_groups[layer]`)."""
    device = kv_caches[0][0].device
    index = [torch.tensor(ids, dtype=torch.long, device=device) for ids in block_ids]
    return [
        (keys[index[group]].cpu(), values[index[group]].cpu())
        for (keys, values), group in zip(kv_caches, layer_groups, strict=True)
    ]
