"""Copy whole KV blocks inside a cache: the data side of copy-on-write.

`block_mapping` is [num_copies, 2] (source, destination). One program per (copy, kv head)
moves one head's block_size x head_dim tile of keys and of values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.kernels.checks import INDEX_DTYPES, KernelArgumentError, check_cache_pair, check_tensor


@triton.jit
def _copy_blocks_kernel(
    key_cache_ptr,
    value_cache_ptr,
    block_mapping_ptr,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pair = tl.program_id(0)
    head = tl.program_id(1)
    source = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    target = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    slots = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    mask = (slots[:, None] < block_size) & (dims[None, :] < head_dim)
    within = slots[:, None] * stride_cs + head * stride_ch + dims[None, :]
    keys = tl.load(key_cache_ptr + source * stride_cb + within, mask=mask)
    tl.store(key_cache_ptr + target * stride_cb + within, keys, mask=mask)
    values = tl.load(value_cache_ptr + source * stride_cb + within, mask=mask)
    tl.store(value_cache_ptr + target * stride_cb + within, values, mask=mask)


def _check(key_cache: torch.Tensor, value_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    check_cache_pair(key_cache, value_cache)
    check_tensor("block_mapping", block_mapping, 2, INDEX_DTYPES, key_cache.device)
    if block_mapping.shape[1] != 2 or not block_mapping.is_contiguous():
        raise KernelArgumentError(
            f"block_mapping: expected a contiguous [num_copies, 2] tensor, got {tuple(block_mapping.shape)}"
        )


def copy_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy block `block_mapping[i, 0]` onto block `block_mapping[i, 1]` in both caches
    ([num_blocks, block_size, num_kv_heads, head_dim], any strides with contiguous head_dim).
    Destinations must be distinct and never a source."""
    _check(key_cache, value_cache, block_mapping)
    if block_mapping.shape[0] == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    _copy_blocks_kernel[(block_mapping.shape[0], num_kv_heads)](
        key_cache,
        value_cache,
        block_mapping,
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_size,
        head_dim,
        BLOCK_S=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def copy_blocks_torch(key_cache: torch.Tensor, value_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """The reference, and the CPU path: same arguments as `copy_blocks`."""
    _check(key_cache, value_cache, block_mapping)
    if block_mapping.shape[0] == 0:
        return
    sources, targets = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    key_cache[targets] = key_cache[sources]
    value_cache[targets] = value_cache[sources]
