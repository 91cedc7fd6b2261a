"""Attention over the paged KV cache: the metadata of one step and the backend seam.

A step's tokens form one flat batch with no padding:

    rows: [ d0 d1 d2 ... | p0 p0 p0 p0 | p1 p1 ... ]
           decodes: one    prefill chunks: q_len
           token each      tokens each (causal)

Every row's key and value are first written into the cache at its slot
(`slot = block_id * block_size + offset`); then each query attends over its sequence's
context, read back through the sequence's block table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagefleet.kernels.copy_blocks import copy_blocks_torch
from pagefleet.kernels.reshape_and_cache import reshape_and_cache_torch


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's chunk of new tokens in the flat batch."""

    query_start: int
    query_len: int
    context_len: int  # cached prefix + this chunk
    context_slots: torch.Tensor  # [context_len] cache slots of the whole context
    sliding_window: int | None = None  # a query sees only the last `sliding_window` keys


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows of similar context length, attended together over a padded gather."""

    rows: torch.Tensor  # [b] row indices into the flat batch
    block_ids: torch.Tensor  # [b * num_blocks] physical blocks, row-major
    num_blocks: int
    masked: torch.Tensor  # [b, num_blocks * block_size], True where a key is hidden
    head_block_ids: torch.Tensor | None = None  # block ids offset per kv head (torch backend)
    bias: torch.Tensor | None = None  # additive mask [kv_heads * b, 1, L] (torch backend)


@dataclass(slots=True)
class PagedBatch:
    """The step as the Triton kernels read it: block tables and lengths.

    Decode rows are 0..num_decodes-1 of the flat batch; prefill chunk i is rows
    num_decodes + cu_seqlens[i] .. num_decodes + cu_seqlens[i + 1].
    """

    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_cu_seqlens: torch.Tensor  # [num_prefills + 1] int32
    prefill_context_lens: torch.Tensor  # [num_prefills] int32, cached prefix + chunk
    max_prefill_len: int
    sliding_window: int | None


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of every row
    decode_buckets: list[DecodeBucket] = field(default_factory=list)  # torch backend
    prefills: list[PrefillChunk] = field(default_factory=list)  # torch backend
    paged: PagedBatch | None = None  # backends with `uses_block_tables`


class AttentionBackend(Protocol):
    """Writes a layer's new keys/values into its cache and computes attention."""

    name: str
    uses_block_tables: bool  # wants AttentionMetadata.paged rather than buckets and chunks

    def copy_blocks(self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
        """Copy block mapping[i, 0] onto mapping[i, 1] in both caches (copy-on-write)."""
        ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim]; key/value: [num_tokens, num_kv_heads,
        head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim].

        Returns: [num_tokens, num_heads, head_dim] in the query's dtype.
        """
        ...


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The storage behind a cache view: [num_kv_heads, num_blocks, block_size, head_dim].

    Caches are allocated head-major and handed around as the permuted view
    [num_blocks, block_size, num_kv_heads, head_dim], so one head's blocks are contiguous
    and a gather yields operands that batched matmuls take without another copy.
    """
    storage = cache.permute(2, 0, 1, 3)
    assert storage.is_contiguous(), "KV caches must be allocated head-major (see allocate_kv_cache)"
    return storage


def allocate_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zeroed cache, [num_blocks, block_size, num_kv_heads, head_dim] over head-major storage."""
    storage = torch.zeros(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device)
    return storage.permute(1, 2, 0, 3)


class TorchAttentionBackend:
    """Plain-torch attention, the CPU path: the kernels' torch references for cache writes
    and copies, and attention batched for the CPU (decodes gathered in buckets of similar
    length, prefills through SDPA), checked against the kernels' references in tests."""

    name = "torch"
    uses_block_tables = False

    def __init__(self) -> None:
        # Gathered keys/values are tens of MB a layer; reusing one buffer avoids a fresh
        # mmap (and its page faults) for every layer of every step.
        self._workspace: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def _buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        key = (name, like.dtype, like.device)
        numel = math.prod(shape)
        buffer = self._workspace.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._workspace[key] = buffer
        return buffer[:numel].view(shape)

    def copy_blocks(self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
        copy_blocks_torch(key_cache, value_cache, block_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        reshape_and_cache_torch(key, value, key_cache, value_cache, metadata.slot_mapping)
        keys, values = head_major(key_cache), head_major(value_cache)
        num_kv_heads, num_blocks, block_size, head_dim = keys.shape
        flat_keys = keys.view(num_kv_heads, num_blocks * block_size, head_dim)
        flat_values = values.view(num_kv_heads, num_blocks * block_size, head_dim)

        output = torch.empty_like(query)
        for bucket in metadata.decode_buckets:
            output[bucket.rows] = self._decode_bucket(query, keys, values, bucket, scale)
        for chunk in metadata.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if chunk.context_len == chunk.query_len:  # nothing cached before: attend to itself
                chunk_keys, chunk_values = key[rows].transpose(0, 1), value[rows].transpose(0, 1)
            else:
                chunk_keys = flat_keys.index_select(1, chunk.context_slots)
                chunk_values = flat_values.index_select(1, chunk.context_slots)
            output[rows] = _prefill_chunk(query[rows], chunk_keys, chunk_values, chunk, scale)
        return output

    def _decode_bucket(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bucket: DecodeBucket, scale: float
    ) -> torch.Tensor:
        """Single-token attention for `bucket.rows` -> [b, num_heads, head_dim].

        keys/values: head-major storage [num_kv_heads, num_blocks, block_size, head_dim].
        """
        num_kv_heads, num_blocks, block_size, head_dim = keys.shape
        num_rows = bucket.rows.numel()
        length = bucket.num_blocks * block_size
        if bucket.head_block_ids is None or bucket.bias is None:  # first layer; reused by the rest
            heads = torch.arange(num_kv_heads, device=keys.device)[:, None] * num_blocks
            bucket.head_block_ids = (heads + bucket.block_ids[None, :]).flatten()
            bias = torch.zeros(bucket.masked.shape, dtype=query.dtype, device=query.device)
            bias.masked_fill_(bucket.masked, float("-inf"))
            bucket.bias = bias.repeat(num_kv_heads, 1).unsqueeze(1)
        # One gather per cache: rows of storage [kv_heads * num_blocks, block_size * D].
        shape = (num_kv_heads * bucket.block_ids.numel(), block_size * head_dim)
        gathered_keys = self._buffer("keys", shape, keys)
        gathered_values = self._buffer("values", shape, values)
        torch.index_select(keys.view(-1, block_size * head_dim), 0, bucket.head_block_ids, out=gathered_keys)
        torch.index_select(values.view(-1, block_size * head_dim), 0, bucket.head_block_ids, out=gathered_values)
        # Batch over (kv head, row): [kv*b, group, D] @ [kv*b, D, L] -> [kv*b, group, L].
        q = query.index_select(0, bucket.rows).view(num_rows, num_kv_heads, -1, head_dim)
        q = q.transpose(0, 1).reshape(num_kv_heads * num_rows, -1, head_dim)
        batch_keys = gathered_keys.view(num_kv_heads * num_rows, length, head_dim)
        scores = torch.baddbmm(bucket.bias, q, batch_keys.transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.bmm(probs, gathered_values.view(num_kv_heads * num_rows, length, head_dim))
        return out.view(num_kv_heads, num_rows, -1, head_dim).transpose(0, 1).reshape(num_rows, -1, head_dim)


def _prefill_chunk(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    """Causal attention of a chunk over its context -> [q_len, H, D].

    query: [q_len, H, D]; keys/values: [num_kv_heads, context_len, D].
    """
    q = query.transpose(0, 1).unsqueeze(0)
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    prefix = chunk.context_len - chunk.query_len
    window = chunk.sliding_window
    if prefix == 0 and (window is None or window >= chunk.query_len):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        # Query i sits at position prefix + i and sees keys 0..prefix + i (the last
        # `window` of them with a sliding window).
        visible = torch.ones(chunk.query_len, chunk.context_len, dtype=torch.bool, device=q.device)
        visible = visible.tril(diagonal=prefix)
        if window is not None:
            visible = visible.triu(diagonal=prefix - window + 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible, scale=scale, enable_gqa=True
        )
    return out.squeeze(0).transpose(0, 1)
