"""Decode attention: one query token per sequence over its whole context, read from the
paged KV cache through the sequence's block table.

One program per (sequence, query head) reads the keys and values of its kv head
(head // group_size: grouped-query attention; the group's programs hit the same cache
lines). Keys are visited `TILE_N` tokens at a time with an online softmax; everything
accumulates in float32 whatever the cache dtype, and head sizes need not be powers of two
(masked). Every tile holds at least one visible key (the first tile starts at the window's
first key), so the running maximum is always finite. A `softcap` > 0 caps every scaled score
as softcap * tanh(score / softcap) before the softmax (Gemma 2's attn_logit_softcapping).
`sinks` (gpt-oss): one learned logit per query head that joins each softmax's denominator
and has no value, so a head can attend to nothing. A `chunk` > 0 (Llama 4's chunked
attention) shows each query only the keys of its own chunk of `chunk` positions.
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

DEFAULT_TILE_N = 32


@triton.jit
def soft_cap(scores, softcap):
    """softcap * tanh(scores / softcap), with tanh(x) = 1 - 2 / (exp(2x) + 1): triton.language
    has no tanh (libdevice's is per backend), and this form goes to +-1, never NaN, at both ends."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))


@triton.jit
def _paged_attention_decode_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
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
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group_size
    context_len = tl.load(context_lens_ptr + seq)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q = tl.load(query_ptr + seq * stride_qt + head * stride_qh + dims, mask=dim_mask, other=0.0)
    q = q.to(tl.float32) * scale

    # The query sits at context_len - 1; with a window it sees only the last `window` keys.
    first = tl.where(sliding_window > 0, tl.maximum(context_len - sliding_window, 0), 0)
    first = tl.where(chunk > 0, (context_len - 1) // tl.maximum(chunk, 1) * chunk, first)
    start = (first // TILE_N) * TILE_N

    m = tl.max(tl.full([TILE_N], float("-inf"), tl.float32), axis=0)
    denom = tl.sum(tl.zeros([TILE_N], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    tokens = tl.arange(0, TILE_N)
    for tile in range(start, context_len, TILE_N):
        positions = tile + tokens
        valid = (positions < context_len) & (positions >= first)
        block = tl.load(block_tables_ptr + seq * stride_bt + positions // block_size, mask=valid, other=0)
        rows = block.to(tl.int64) * stride_cb + (positions % block_size) * stride_cs + kv_head * stride_ch
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[None, :] * k, axis=1)  # [TILE_N]
        if softcap > 0:
            scores = soft_cap(scores, softcap)
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))  # finite: every tile holds a visible key
        correction = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(value_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        denom = denom * correction + tl.sum(p, axis=0)
        acc = acc * correction + tl.sum(p[:, None] * v, axis=0)
        m = m_new

    if HAS_SINKS:  # one more logit in the denominator, with no value
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_new = tl.maximum(m, sink)
        correction = tl.exp(m - m_new)
        denom = denom * correction + tl.exp(sink - m_new)
        acc = acc * correction
    out = acc / denom
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def _check(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    check_cache_pair(key_cache, value_cache)
    check_query(query, key_cache)
    device, num_seqs = key_cache.device, query.shape[0]
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, device)
    if block_tables.shape[0] != num_seqs:
        raise KernelArgumentError(f"block_tables: {block_tables.shape[0]} rows for {num_seqs} sequences")
    check_tensor("context_lens", context_lens, 1, INDEX_DTYPES, device)
    check_shape("context_lens", context_lens, (num_seqs,))


def paged_attention_decode(
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
    tile_n: int = DEFAULT_TILE_N,
) -> torch.Tensor:
    """query: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks] (entries past a
    sequence's context are ignored); context_lens: [num_seqs], each >= 1; softcap: the
    logit soft-cap (None: none); sinks: [num_heads] logits (None: none); chunk: the
    chunked-attention size (None: none).

    Returns [num_seqs, num_heads, head_dim] in the query's dtype.
    """
    _check(query, key_cache, value_cache, block_tables, context_lens)
    check_sinks(sinks, query)
    num_seqs, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    _paged_attention_decode_kernel[(num_seqs, num_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
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
        BLOCK_D=triton.next_power_of_2(head_dim),
        TILE_N=tile_n,
        HAS_SINKS=sinks is not None,
    )
    return out


def paged_attention_decode_torch(
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
    """The reference: each sequence's keys gathered through its table, plain softmax."""
    _check(query, key_cache, value_cache, block_tables, context_lens)
    check_sinks(sinks, query)
    out = torch.empty_like(query)
    for seq in range(query.shape[0]):
        length = int(context_lens[seq])
        keys, values = gather_context(key_cache, value_cache, block_tables[seq], length)
        first = 0
        if sliding_window:
            first = max(0, length - sliding_window)
        elif chunk:
            first = (length - 1) // chunk * chunk
        out[seq] = attend(
            query[seq : seq + 1], keys[first:], values[first:], scale, None, softcap=softcap, sinks=sinks
        )[0]
    return out


def gather_context(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first `length` keys and values, [length, num_kv_heads, head_dim]."""
    block_size = key_cache.shape[1]
    positions = torch.arange(length, device=key_cache.device)
    blocks = block_table.long()[positions // block_size]
    return key_cache[blocks, positions % block_size], value_cache[blocks, positions % block_size]


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    causal_offset: int | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Float32 softmax attention with grouped-query heads -> [q_len, num_heads, head_dim].

    query: [q_len, H, D]; keys/values: [k_len, KVH, D]. With `causal_offset`, query i sits
    at key position causal_offset + i and sees keys up to it (the last `sliding_window`).
    With `softcap`, each scaled score becomes softcap * tanh(score / softcap), before the mask.
    With `sinks` [H], each head's softmax has one more logit, dropped after it (gpt-oss).
    With `chunk`, query i sees only the keys of its own chunk of `chunk` positions.
    """
    group = query.shape[1] // keys.shape[1]
    q = query.float().transpose(0, 1)  # [H, q, D]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q @ k.transpose(1, 2)) * scale  # [H, q, k]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if causal_offset is not None:
        query_pos = causal_offset + torch.arange(query.shape[0], device=query.device)[:, None]
        key_pos = torch.arange(keys.shape[0], device=query.device)[None, :]
        hidden = key_pos > query_pos
        if sliding_window:
            hidden |= key_pos <= query_pos - sliding_window
        if chunk:
            hidden |= key_pos < query_pos // chunk * chunk
        scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink_column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return (probs @ v).transpose(0, 1).to(query.dtype)
