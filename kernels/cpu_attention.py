"""Paged attention compiled for the CPU (csrc/cpu_attention.cpp, built by cpu_ops.py), and the
write of a step's keys and values into the cache. Decode and prefill are one operator with one
arithmetic (`paged_attention_rows`): a prompt row is attended exactly as a decode row.

Their references, and the fallbacks where no compiler is, are `paged_attention_decode_torch`,
`paged_attention_prefill_torch` and `reshape_and_cache_torch`.
"""

from __future__ import annotations

import torch

from pagefleet.kernels.checks import check_sinks
from pagefleet.kernels.paged_attention_decode import _check
from pagefleet.kernels.paged_attention_prefill import _check as _check_prefill
from pagefleet.kernels.reshape_and_cache import _check as _check_cache_write


def reshape_and_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Like `reshape_and_cache_torch`: token t's key and value go to slot `slot_mapping[t]`
    (negative: skipped). Call `cpu_ops.load()` first."""
    _check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    dtype = key_cache.dtype
    torch.ops.pagefleet.reshape_and_cache(key.to(dtype), value.to(dtype), key_cache, value_cache, slot_mapping)


def paged_attention_decode_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Decode attention -> [num_seqs, num_heads, head_dim], like `paged_attention_decode_torch`.

    query: [num_seqs, num_heads, head_dim] float32 or bfloat16; caches: [num_blocks,
    block_size, num_kv_heads, head_dim] (any strides, head_dim contiguous); block_tables:
    [num_seqs, max_blocks] int32; context_lens: [num_seqs] int32; softcap: the logit
    soft-cap (None: none, and the same bits as before it existed); sinks: [num_heads]
    logits (gpt-oss; None: none); chunk: each row sees only its own chunk of this many
    positions (Llama 4's chunked attention; None: no chunks). Call `cpu_ops.load()` first.
    """
    _check(query, key_cache, value_cache, block_tables, context_lens)
    check_sinks(sinks, query)
    block_tables, context_lens = block_tables.to(torch.int32), context_lens.to(torch.int32)
    return torch.ops.pagefleet.paged_attention_decode(
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale,
        sliding_window or 0,
        softcap or 0.0,
        sinks,
        chunk or 0,
    )


def paged_attention_prefill_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Prefill attention -> [num_tokens, num_heads, head_dim], like `paged_attention_prefill_torch`.

    query: [num_tokens, num_heads, head_dim], the chunks of all sequences back to back;
    cu_seqlens: [num_seqs + 1] chunk boundaries; context_lens: [num_seqs] cached prefix +
    chunk; block_tables: [num_seqs, max_blocks]. Each query row attends through the rows
    operator with its own length (its position + 1), as a decode of that row would.
    """
    _check_prefill(query, key_cache, value_cache, block_tables, cu_seqlens, context_lens)
    check_sinks(sinks, query)
    chunks = cu_seqlens.diff().long()
    ends = torch.repeat_interleave(context_lens.long(), chunks)
    offsets = torch.arange(query.shape[0]) - torch.repeat_interleave(cu_seqlens[:-1].long(), chunks)
    row_lengths = ends - torch.repeat_interleave(chunks, chunks) + offsets + 1
    return torch.ops.pagefleet.paged_attention_rows(
        query,
        key_cache,
        value_cache,
        block_tables.to(torch.int32),
        row_lengths.to(torch.int32),
        cu_seqlens.to(torch.int32),
        scale,
        sliding_window or 0,
        softcap or 0.0,
        sinks,
        chunk or 0,
    )
