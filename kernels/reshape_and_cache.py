"""Write a step's new keys and values into the paged KV cache.

Token t goes to slot `slot_mapping[t]` = block_id * block_size + offset; a negative slot
skips the token (padding). One program per (token, kv head) moves one head_dim vector.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_cache_pair, check_shape, check_tensor


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    mask = (dims < head_dim) & (slot >= 0)
    safe_slot = tl.maximum(slot, 0)  # a skipped token's address is never formed from -1
    block = safe_slot // block_size
    offset = safe_slot % block_size
    key = tl.load(key_ptr + token * stride_kt + head * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + head * stride_vh + dims, mask=mask)
    target = block * stride_cb + offset * stride_cs + head * stride_ch + dims
    tl.store(key_cache_ptr + target, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + target, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def _check(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_cache_pair(key_cache, value_cache)
    device = key_cache.device
    _, _, num_kv_heads, head_dim = key_cache.shape
    check_tensor("key", key, 3, FLOAT_DTYPES, device)
    check_tensor("value", value, 3, FLOAT_DTYPES, device)
    check_shape("key", key, (key.shape[0], num_kv_heads, head_dim))
    check_shape("value", value, tuple(key.shape))
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES, device)
    check_shape("slot_mapping", slot_mapping, (key.shape[0],))


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size,
    num_kv_heads, head_dim] (any strides with a contiguous head_dim); slot_mapping:
    [num_tokens] int32/int64."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.shape[1],
        head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def reshape_and_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The reference, and the CPU path: same arguments as `reshape_and_cache`."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    slots = slot_mapping.long()
    # Caches index as [num_blocks * block_size] token slots when blocks and slots nest; the
    # head-major layout the engine allocates does (per head), so one index_copy_ per cache.
    for cache, new in ((key_cache, key), (value_cache, value)):
        by_head = cache.permute(2, 0, 1, 3)
        if by_head.is_contiguous():
            by_head.view(num_kv_heads, num_blocks * block_size, head_dim).index_copy_(
                1, slots, new.transpose(0, 1).to(cache.dtype)
            )
        else:
            cache[slots // block_size, slots % block_size] = new.to(cache.dtype)
