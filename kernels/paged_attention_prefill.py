"""Prefill attention: each sequence's chunk of new query tokens attends causally to itself
and to the sequence's already-cached prefix, all read from the paged KV cache.

The batch is flat and unpadded: sequence b's queries are rows cu_seqlens[b] to
cu_seqlens[b + 1], and its context (cached prefix + chunk, whose keys and values were
written to the cache first) is context_lens[b] tokens long. This covers whole prompts,
chunked prefill and prefix-cache hits alike. One program per (sequence, tile of `BLOCK_M`
queries, query head) runs an online softmax over `TILE_N` keys at a time, stopping at the
tile's last visible key; float32 throughout. A `softcap` > 0 caps every scaled score as
softcap * tanh(score / softcap) before the mask and the softmax (Gemma 2); `sinks` add one
logit per head to every softmax's denominator (gpt-oss); a `chunk` > 0 shows each query
only the keys of its own chunk of `chunk` positions (Llama 4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.kernels.checks import (
    INDEX_DTYPES,
    KernelArgumentError,
    check_cache_pair,
    check_query,
    check_shape,
    check_sinks,
    check_tensor,
)
from pagefleet.kernels.paged_attention_decode import attend, gather_context, soft_cap

DEFAULT_BLOCK_M = 16
DEFAULT_TILE_N = 32


@triton.jit
def _paged_attention_prefill_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    sinks_ptr,  # [num_heads], read only with HAS_SINKS
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    block_size,
    head_dim,
    group_size,
    sliding_window,  # <= 0: none
    softcap,  # <= 0: none
    chunk,  # <= 0: none
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    tile_m = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // group_size
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)
    prefix = context_len - q_len

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_valid = rows < q_len
    q_mask = row_valid[:, None] & (dims[None, :] < head_dim)
    q_offsets = (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32) * scale
    query_pos = prefix + rows

    # Keys this tile of queries can see: up to its last query, from its first query's window.
    tile_first_pos = prefix + tile_m * BLOCK_M
    hi = tl.where(tile_m * BLOCK_M < q_len, tl.minimum(context_len, tile_first_pos + BLOCK_M), 0)
    lo = tl.where(sliding_window > 0, tl.maximum(tile_first_pos - sliding_window + 1, 0), 0)
    chunk_size = tl.maximum(chunk, 1)  # read only where chunk > 0
    lo = tl.where(chunk > 0, tile_first_pos // chunk_size * chunk_size, lo)
    lo = (lo // TILE_N) * TILE_N

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tokens = tl.arange(0, TILE_N)
    for tile in range(lo, hi, TILE_N):
        key_pos = tile + tokens
        key_valid = key_pos < context_len
        block = tl.load(block_tables_ptr + seq * stride_bt + key_pos // block_size, mask=key_valid, other=0)
        key_rows = block.to(tl.int64) * stride_cb + (key_pos % block_size) * stride_cs + kv_head * stride_ch
        kv_mask = key_valid[:, None] & (dims[None, :] < head_dim)
        k = tl.load(key_cache_ptr + key_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + key_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_M, TILE_N]
        if softcap > 0:
            scores = soft_cap(scores, softcap)
        visible = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        visible = visible & ((sliding_window <= 0) | (key_pos[None, :] > query_pos[:, None] - sliding_window))
        same_chunk = key_pos[None, :] // chunk_size == query_pos[:, None] // chunk_size
        visible = visible & ((chunk <= 0) | same_chunk)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
        correction = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        denom = denom * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new

    if HAS_SINKS:  # one more logit in every row's denominator, with no value
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_new = tl.maximum(m, sink)
        correction = tl.exp(m - m_new)
        denom = denom * correction + tl.exp(sink - m_new)
        acc = acc * correction[:, None]
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    out_offsets = (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    check_cache_pair(key_cache, value_cache)
    check_query(query, key_cache)
    device = key_cache.device
    check_tensor("cu_seqlens", cu_seqlens, 1, INDEX_DTYPES, device)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs < 0:
        raise KernelArgumentError("cu_seqlens: needs at least one entry (0)")
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, device)
    if block_tables.shape[0] != num_seqs:
        raise KernelArgumentError(f"block_tables: {block_tables.shape[0]} rows for {num_seqs} sequences")
    check_tensor("context_lens", context_lens, 1, INDEX_DTYPES, device)
    check_shape("context_lens", context_lens, (num_seqs,))


def paged_attention_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    tile_n: int = DEFAULT_TILE_N,
) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim], the chunks of all sequences back to back;
    cu_seqlens: [num_seqs + 1] chunk boundaries; context_lens: [num_seqs] cached prefix +
    chunk; block_tables: [num_seqs, max_blocks]; max_query_len: the longest chunk (sizes
    the grid without reading the device); softcap: the logit soft-cap (None: none); sinks:
    [num_heads] logits (None: none); chunk: the chunked-attention size (None: none).

    Returns [num_tokens, num_heads, head_dim] in the query's dtype.
    """
    _check(query, key_cache, value_cache, block_tables, cu_seqlens, context_lens)
    check_sinks(sinks, query)
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _paged_attention_prefill_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        cu_seqlens,
        context_lens,
        query if sinks is None else sinks,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        key_cache.shape[1],
        head_dim,
        num_heads // key_cache.shape[2],
        sliding_window or 0,
        float(softcap or 0.0),
        chunk or 0,
        BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        TILE_N=tile_n,
        HAS_SINKS=sinks is not None,
    )
    return out


def paged_attention_prefill_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The reference: each sequence's context gathered through its table, masked softmax."""
    _check(query, key_cache, value_cache, block_tables, cu_seqlens, context_lens)
    check_sinks(sinks, query)
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for seq in range(len(bounds) - 1):
        start, end = bounds[seq], bounds[seq + 1]
        if start == end:
            continue
        length = int(context_lens[seq])
        keys, values = gather_context(key_cache, value_cache, block_tables[seq], length)
        prefix = length - (end - start)
        out[start:end] = attend(query[start:end], keys, values, scale, prefix, sliding_window, softcap, sinks, chunk)
    return out
