"""Paged decode attention compiled for the CPU (csrc/cpu_attention.cpp, built by cpu_ops.py).

Its reference, and the fallback where no compiler is, is `paged_attention_decode_torch`.
"""

from __future__ import annotations

import torch

from pagefleet.kernels.paged_attention_decode import _check


def paged_attention_decode_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode attention -> [num_seqs, num_heads, head_dim], like `paged_attention_decode_torch`.

    query: [num_seqs, num_heads, head_dim] float32 or bfloat16; caches: [num_blocks,
    block_size, num_kv_heads, head_dim] (any strides, head_dim contiguous); block_tables:
    [num_seqs, max_blocks] int32; context_lens: [num_seqs] int32. Call `cpu_ops.load()` first.
    """
    _check(query, key_cache, value_cache, block_tables, context_lens)
    block_tables, context_lens = block_tables.to(torch.int32), context_lens.to(torch.int32)
    return torch.ops.pagefleet.paged_attention_decode(
        query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window or 0
    )
