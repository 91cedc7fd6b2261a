"""Launcher checks shared by the kernels: a wrong tensor fails here with a clear message,
not inside a kernel as a wrong answer or an illegal memory access."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


class KernelArgumentError(ValueError):
    """A kernel was called with a tensor of the wrong shape, dtype, device or layout."""


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    unit_last_stride: bool = True,
) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise KernelArgumentError(f"{name}: expected a tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise KernelArgumentError(f"{name}: expected {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise KernelArgumentError(f"{name}: dtype {str(tensor.dtype).removeprefix('torch.')} is not one of {allowed}")
    if device is not None and tensor.device != device:
        raise KernelArgumentError(f"{name}: on {tensor.device}, but the other tensors are on {device}")
    if unit_last_stride and tensor.numel() and tensor.stride(-1) != 1:
        raise KernelArgumentError(f"{name}: the last dimension must be contiguous (stride 1), got {tensor.stride()}")


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise KernelArgumentError(f"{name}: expected shape {expected}, got {tuple(tensor.shape)}")


def check_query(query: torch.Tensor, key_cache: torch.Tensor) -> None:
    """query: [tokens, num_heads, head_dim] in the cache's dtype, heads a multiple of kv heads."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    check_tensor("query", query, 3, FLOAT_DTYPES, key_cache.device)
    if query.dtype != key_cache.dtype:
        raise KernelArgumentError(f"query dtype {query.dtype} differs from the cache's {key_cache.dtype}")
    check_shape("query", query, (query.shape[0], query.shape[1], head_dim))
    if query.shape[1] % num_kv_heads:
        raise KernelArgumentError(f"num_heads ({query.shape[1]}) must be a multiple of num_kv_heads ({num_kv_heads})")


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Caches are [num_blocks, block_size, num_kv_heads, head_dim], any strides but a
    contiguous head_dim, and key and value alike."""
    check_tensor("key_cache", key_cache, 4, FLOAT_DTYPES)
    check_tensor("value_cache", value_cache, 4, (key_cache.dtype,), key_cache.device)
    check_shape("value_cache", value_cache, tuple(key_cache.shape))
    if key_cache.stride() != value_cache.stride():
        raise KernelArgumentError(
            f"key_cache and value_cache strides differ: {key_cache.stride()} vs {value_cache.stride()}"
        )


def check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    """sinks: None, or one logit per query head (any float dtype), on the query's device."""
    if sinks is None:
        return
    check_tensor("sinks", sinks, 1, FLOAT_DTYPES, query.device)
    check_shape("sinks", sinks, (query.shape[1],))


def check_chunk_arguments(
    start_positions: torch.Tensor,
    chunk_limits: torch.Tensor | None,
    chunk_size: int,
    slots: torch.Tensor,
    device: torch.device,
) -> None:
    """The chunked kernels' chunk arguments: start_positions and chunk_limits (None: no
    limits) one int32/int64 per sequence of `slots`, on `device`; chunk_size a power of two."""
    check_tensor("start_positions", start_positions, 1, INDEX_DTYPES, device)
    check_shape("start_positions", start_positions, tuple(slots.shape))
    if chunk_limits is not None:
        check_tensor("chunk_limits", chunk_limits, 1, INDEX_DTYPES, device)
        check_shape("chunk_limits", chunk_limits, tuple(slots.shape))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise KernelArgumentError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    if chunk_size & (chunk_size - 1):
        raise KernelArgumentError(f"chunk_size: {chunk_size} is not a power of two")
