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

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's chunk of new tokens in the flat batch."""

    query_start: int
    query_len: int
    context_len: int  # cached prefix + this chunk
    context_slots: torch.Tensor  # [context_len] cache slots of the whole context


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows of similar context length, attended together over a padded gather."""

    rows: torch.Tensor  # [b] row indices into the flat batch
    block_ids: torch.Tensor  # [b * num_blocks] physical blocks, row-major
    num_blocks: int
    masked: torch.Tensor  # [b, 1, 1, num_blocks * block_size], True where a key is hidden


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of every row
    num_decode_tokens: int
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


class AttentionBackend(Protocol):
    """Writes a layer's new keys/values into its cache and computes attention."""

    name: str

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


class TorchAttentionBackend:
    """Plain-torch attention: the CPU path and the reference for the Triton kernels."""

    name = "torch"

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
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        flat_keys = key_cache.view(-1, num_kv_heads, head_dim)
        flat_values = value_cache.view(-1, num_kv_heads, head_dim)
        flat_keys.index_copy_(0, metadata.slot_mapping, key)
        flat_values.index_copy_(0, metadata.slot_mapping, value)

        output = torch.empty_like(query)
        for bucket in metadata.decode_buckets:
            output[bucket.rows] = _decode_bucket(query, key_cache, value_cache, bucket, scale)
        for chunk in metadata.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            output[rows] = _prefill_chunk(query[rows], flat_keys, flat_values, chunk, scale)
        return output


def _decode_bucket(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
) -> torch.Tensor:
    """Single-token attention for `bucket.rows` -> [b, num_heads, head_dim]."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_rows = bucket.rows.numel()
    length = bucket.num_blocks * block_size
    q = query.index_select(0, bucket.rows).view(num_rows, num_kv_heads, -1, head_dim)
    keys = key_cache.index_select(0, bucket.block_ids).view(num_rows, length, num_kv_heads, head_dim)
    values = value_cache.index_select(0, bucket.block_ids).view(num_rows, length, num_kv_heads, head_dim)
    # [b, kv_heads, group, D] @ [b, kv_heads, D, L]: query head h reads kv head h // group.
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1)).float() * scale
    scores.masked_fill_(bucket.masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))
    return out.reshape(num_rows, -1, head_dim)


def _prefill_chunk(
    query: torch.Tensor,
    flat_keys: torch.Tensor,
    flat_values: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk over its cached prefix and itself -> [q_len, H, D]."""
    keys = flat_keys.index_select(0, chunk.context_slots).transpose(0, 1).unsqueeze(0)
    values = flat_values.index_select(0, chunk.context_slots).transpose(0, 1).unsqueeze(0)
    q = query.transpose(0, 1).unsqueeze(0)
    prefix = chunk.context_len - chunk.query_len
    if prefix == 0:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        # Query i sits at position prefix + i and sees keys 0..prefix + i.
        visible = torch.ones(chunk.query_len, chunk.context_len, dtype=torch.bool, device=q.device)
        visible = visible.tril(diagonal=prefix)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible, scale=scale, enable_gqa=True
        )
    return out.squeeze(0).transpose(0, 1)
