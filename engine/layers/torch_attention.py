"""Plain-torch attention: the reference backend and the fallback on CPUs with no compiler.

Cache writes and copies are the kernels' torch references. Decodes are gathered in a few
buckets of similar context length and attended with batched matmuls (so short contexts do
not pay for the padding of long ones); prefill chunks go through SDPA, over the cached
prefix gathered by slot when there is one. Checked against the kernels' references.
Caches are head-major storage as allocated, gathered in one index_select; padded pages
(layers of several key shapes on one tensor, Gemma 4's) are read block by block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pagefleet.engine.layers.attention import AttentionMetadata, CacheSpec, StepLayout
from pagefleet.kernels.copy_blocks import copy_blocks_torch
from pagefleet.kernels.reshape_and_cache import reshape_and_cache_torch

_MAX_DECODE_BUCKETS = 2
_BUCKET_RATIO = 0.5  # a decode shorter than this fraction of its bucket's longest starts a new one


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's chunk of new tokens, as the torch path attends it."""

    query_start: int
    query_len: int
    context_len: int  # cached prefix + this chunk
    context_slots: torch.Tensor  # [context_len] cache slots of the whole context


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows of similar context length, attended together over one padded gather."""

    rows: torch.Tensor  # [b] row indices into the flat batch
    num_blocks: int  # blocks per row (padded)
    head_block_ids: torch.Tensor  # [kv_heads * b * num_blocks] rows of the head-major storage
    block_ids: torch.Tensor  # [b * num_blocks] the blocks themselves (padded pages read these)
    row_lengths: torch.Tensor  # [b] each row's context length (the query sits at length - 1)
    # Per (window, chunk) (None: all keys), [kv_heads * b, 1, num_blocks * block_size]
    # additive masks, 0 or -inf, made by the first layer that asks.
    biases: dict[tuple[int | None, int | None], torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class TorchMetadata(AttentionMetadata):
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        # Gathered keys/values are tens of MB a layer; reusing one buffer avoids a fresh
        # mmap (and its page faults) for every layer of every step.
        self._workspace: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def prepare(self, step: StepLayout) -> TorchMetadata:
        return TorchMetadata(step.slot_mapping, self.decode_buckets(step), self.prefill_chunks(step))

    def prefill_chunks(self, step: StepLayout) -> list[PrefillChunk]:
        device = self.spec.device
        return [
            PrefillChunk(p.row, p.num_new, p.context_len, torch.from_numpy(p.context_slots).to(device))
            for p in step.prefills
        ]

    def decode_buckets(self, step: StepLayout) -> list[DecodeBucket]:
        lengths, tables = step.decode_context_lens, step.decode_block_tables
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        groups: list[list[int]] = []
        for i in order:
            if groups and (lengths[i] >= _BUCKET_RATIO * lengths[groups[-1][0]] or len(groups) == _MAX_DECODE_BUCKETS):
                groups[-1].append(i)
            else:
                groups.append([i])
        return [self._bucket(group, lengths, tables) for group in groups]

    def _bucket(self, group: list[int], lengths: list[int], tables: list[list[int]]) -> DecodeBucket:
        spec = self.spec
        num_blocks = len(tables[group[0]])
        padded = torch.tensor([tables[i] + [0] * (num_blocks - len(tables[i])) for i in group]).flatten().clamp_(min=0)
        heads = torch.arange(spec.num_kv_heads)[:, None] * spec.num_blocks
        return DecodeBucket(
            rows=torch.tensor(group, device=spec.device),
            num_blocks=num_blocks,
            head_block_ids=(heads + padded[None, :]).flatten().to(spec.device),
            block_ids=padded.to(spec.device),
            row_lengths=torch.tensor([lengths[i] for i in group]),
        )

    def _bias(self, bucket: DecodeBucket, window: int | None, chunk: int | None) -> torch.Tensor:
        """The bucket's additive mask for layers that see the last `window` keys, or the keys
        of the query's own `chunk` (None: all)."""
        bias = bucket.biases.get((window, chunk))
        if bias is None:
            spec, lengths = self.spec, bucket.row_lengths[:, None]
            key_positions = torch.arange(bucket.num_blocks * spec.block_size)[None, :]
            masked = key_positions >= lengths
            if window is not None:  # the query sits at length - 1
                masked |= key_positions <= lengths - 1 - window
            if chunk is not None:
                masked |= key_positions < (lengths - 1) // chunk * chunk
            bias = torch.zeros(masked.shape, dtype=spec.dtype).masked_fill_(masked, float("-inf"))
            bias = bucket.biases[window, chunk] = bias.repeat(spec.num_kv_heads, 1).unsqueeze(1).to(spec.device)
        return bias

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
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchMetadata), "metadata from another backend's prepare()"
        reshape_and_cache_torch(key, value, key_cache, value_cache, metadata.slot_mapping)
        output = torch.empty_like(query)
        shape = Shape(scale, window, softcap, sinks, chunk)
        for bucket in metadata.decode_buckets:
            output[bucket.rows] = self._decode_bucket(query, key_cache, value_cache, bucket, shape)
        for prefill in metadata.prefills:
            rows = slice(prefill.query_start, prefill.query_start + prefill.query_len)
            if prefill.context_len == prefill.query_len:  # nothing cached before: attend to itself
                chunk_keys, chunk_values = key[rows].transpose(0, 1), value[rows].transpose(0, 1)
            else:
                chunk_keys, chunk_values = _context(key_cache, prefill), _context(value_cache, prefill)
            output[rows] = _prefill_chunk(query[rows], chunk_keys, chunk_values, prefill, shape)
        return output

    def _gathered(self, cache: torch.Tensor, bucket: DecodeBucket, name: str) -> torch.Tensor:
        """The bucket's keys or values, [kv_heads * b, num_blocks * block_size, head_dim]."""
        _, block_size, num_kv_heads, head_dim = cache.shape
        num_rows, length = bucket.rows.numel(), bucket.num_blocks * block_size
        storage = cache.permute(2, 0, 1, 3)
        if not storage.is_contiguous():  # padded pages (Gemma 4's): block by block
            blocks = cache[bucket.block_ids]
            return blocks.permute(2, 0, 1, 3).reshape(num_kv_heads * num_rows, length, head_dim)
        # Head-major storage, as allocated: one gather of rows [kv_heads * num_blocks,
        # block_size * D]. The ids are head-major for the most KV heads any layer has; a
        # layer with fewer (Gemma 4's global ones) reads the first heads' part.
        head_block_ids = bucket.head_block_ids[: num_kv_heads * num_rows * bucket.num_blocks]
        gathered = self._buffer(name, (head_block_ids.numel(), block_size * head_dim), cache)
        torch.index_select(storage.view(-1, block_size * head_dim), 0, head_block_ids, out=gathered)
        return gathered.view(num_kv_heads * num_rows, length, head_dim)

    def _decode_bucket(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        bucket: DecodeBucket,
        shape: Shape,
    ) -> torch.Tensor:
        """Single-token attention for `bucket.rows` -> [b, num_heads, head_dim]."""
        num_kv_heads, head_dim = key_cache.shape[2:]
        num_rows = bucket.rows.numel()
        batch_keys = self._gathered(key_cache, bucket, "keys")
        batch_values = self._gathered(value_cache, bucket, "values")
        # Batch over (kv head, row): [kv*b, group, D] @ [kv*b, D, L] -> [kv*b, group, L].
        q = query.index_select(0, bucket.rows).view(num_rows, num_kv_heads, -1, head_dim)
        q = q.transpose(0, 1).reshape(num_kv_heads * num_rows, -1, head_dim)
        bias = self._bias(bucket, shape.window, shape.chunk)[: num_kv_heads * num_rows]
        if shape.softcap is None:
            scores = torch.baddbmm(bias, q, batch_keys.transpose(1, 2), alpha=shape.scale)
        else:  # capped before the mask, as transformers does
            scores = _capped(torch.bmm(q, batch_keys.transpose(1, 2)) * shape.scale, shape.softcap) + bias
        sinks = None if shape.sinks is None else shape.sinks.view(num_kv_heads, 1, -1, 1).expand(-1, num_rows, -1, 1)
        probs = _softmax(scores, None if sinks is None else sinks.reshape(num_kv_heads * num_rows, -1, 1))
        out = torch.bmm(probs.to(query.dtype), batch_values)
        return out.view(num_kv_heads, num_rows, -1, head_dim).transpose(0, 1).reshape(num_rows, -1, head_dim)


def _context(cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
    """A chunk's whole context from the cache, [kv_heads, context_len, head_dim]."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    storage = cache.permute(2, 0, 1, 3)
    if storage.is_contiguous():  # head-major, as allocated
        return storage.view(num_kv_heads, num_blocks * block_size, head_dim).index_select(1, chunk.context_slots)
    slots = chunk.context_slots  # padded pages (Gemma 4's)
    return cache[slots // block_size, slots % block_size].transpose(0, 1)


@dataclass(slots=True, frozen=True)
class Shape:
    """One layer's attention: its scale, the keys it sees (the last `window`; None: all), its
    soft-cap, its sinks [num_heads] and its attention chunk (None: none)."""

    scale: float
    window: int | None
    softcap: float | None
    sinks: torch.Tensor | None = None
    chunk: int | None = None


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(scores / softcap) * softcap


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """A float32 softmax over the last dimension; `sinks` (broadcast to [..., 1]) join each
    denominator as one more logit and are dropped after it, as transformers does for gpt-oss."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    combined = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]


def _prefill_chunk(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chunk: PrefillChunk, shape: Shape
) -> torch.Tensor:
    """Causal attention of a chunk over its context -> [q_len, H, D].

    query: [q_len, H, D]; keys/values: [num_kv_heads, context_len, D].
    """
    q = query.transpose(0, 1).unsqueeze(0)
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    prefix = chunk.context_len - chunk.query_len
    window, scale = shape.window, shape.scale
    plain = shape.softcap is None and shape.sinks is None
    chunk_size = shape.chunk
    if plain and prefix == 0 and (window is None or window >= chunk.query_len) and chunk_size is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.squeeze(0).transpose(0, 1)
    # Query i sits at position prefix + i and sees keys 0..prefix + i (the last `window` of
    # them with a sliding window).
    visible = torch.ones(chunk.query_len, chunk.context_len, dtype=torch.bool, device=q.device)
    visible = visible.tril(diagonal=prefix)
    if window is not None:
        visible = visible.triu(diagonal=prefix - window + 1)
    if chunk_size is not None:  # query i (at prefix + i) sees from its chunk's start
        query_chunks = (prefix + torch.arange(chunk.query_len, device=q.device)) // chunk_size
        visible &= query_chunks[:, None] == torch.arange(chunk.context_len, device=q.device)[None, :] // chunk_size
    if plain:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible, scale=scale, enable_gqa=True
        )
        return out.squeeze(0).transpose(0, 1)
    # SDPA has neither soft-cap nor sinks: the scores by hand, capped before the mask as
    # transformers does.
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if shape.softcap is not None:
        scores = _capped(scores, shape.softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    sinks = None if shape.sinks is None else shape.sinks.view(1, -1, 1, 1)
    probs = _softmax(scores, sinks).to(q.dtype)
    return torch.matmul(probs, values).squeeze(0).transpose(0, 1)
