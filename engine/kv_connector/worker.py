"""The connectors' worker side: KV moved between the device cache and host tensors.

`load_blocks` runs on the runner before a step's forward pass (the loads the scheduler
planned); `read_blocks` copies blocks out for a save or a pull, from any thread, and is
safe beside a running step only for blocks that hold a reference (nothing rewrites them).
"""

from __future__ import annotations

import torch

from pagefleet.engine.kv_transfer.params import KVLoad

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [blocks, ...]


def load_blocks(kv_caches: KVCaches, loads: list[KVLoad]) -> None:
    for load in loads:
        caches = kv_caches[0][0]
        index = torch.tensor(load.block_ids, dtype=torch.long, device=caches.device)
        for (key_cache, value_cache), keys, values in zip(kv_caches, load.kv.keys, load.kv.values, strict=True):
            key_cache[index] = keys.to(key_cache.device, key_cache.dtype)
            value_cache[index] = values.to(value_cache.device, value_cache.dtype)


def read_blocks(kv_caches: KVCaches, block_ids: list[int]) -> KVCaches:
    """Host copies of the blocks' keys and values, layer by layer."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    return [(keys[index].cpu(), values[index].cpu()) for keys, values in kv_caches]
