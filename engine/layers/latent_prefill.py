"""Latent attention's prompt rows with the up-projections expanded (DeepSeek's prefill,
`EngineConfig.mla_prefill="expanded"`).

Decode rows attend in the latent space (the up-projections absorbed into the query and the
output, engine/models/deepseek.py): one query against a cache of `kv_lora_rank +
qk_rope_head_dim` dims a key. A prompt chunk of n rows over a context of c keys does that
n * c times per head, where expanding the context's latents into every head's keys
(`qk_nope_head_dim + qk_rope_head_dim`) and values (`v_head_dim`) once, c times, makes each
query-key pair several times cheaper (DeepSeek-V3: 576 + 576 dims a pair absorbed, 192 +
192 expanded, the values padded to the keys' width). The cache stays latent either way: a
chunk's latents are written to it, then its context is read back by slot and expanded into
a scratch cache that the step's own attention backend reads as multi-head attention.

One answer per prompt. A token's attention is computed one way whatever path brings it:
prompt tokens expanded, generated tokens absorbed, also when a recomputed (preempted)
sequence prefills its generated tokens again. An expanded row's bits depend on its position
only: the context is expanded in slabs of `SLAB` positions cut at the same places (one GEMM
shape whatever the context's length), and the backend's rows are path-invariant themselves
(the CPU operator's). The KV cache manager keeps only prompt blocks for the prefix cache
with this setting (`cache_generated_blocks`): a later prompt that contains generated tokens
computes them as prompt tokens rather than reading the absorbed ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagefleet.engine.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    PrefillSpan,
    StepLayout,
    head_major,
)

SLAB = 256  # context positions expanded by one GEMM


@dataclass(frozen=True, slots=True)
class PerHeadProjections:
    """kv_b_proj per head, laid out for batched matmuls over the heads: W_UK [heads, nope,
    rank] and W_UV^T [heads, rank, v] (float32: absorbed rows), and the whole up-projection
    transposed, [heads, rank, nope + v] in the model's dtype (expanded rows)."""

    key_up: torch.Tensor
    value_up: torch.Tensor
    expand: torch.Tensor

    @classmethod
    def of(cls, kv_b_proj: torch.Tensor, nope: int) -> PerHeadProjections:
        """kv_b_proj: [heads, nope + v, rank] (each head's W_UK rows, then its W_UV rows)."""
        wide = kv_b_proj.float()
        return cls(
            wide[:, :nope].contiguous(),
            wide[:, nope:].transpose(1, 2).contiguous(),
            kv_b_proj.transpose(1, 2).contiguous(),
        )


MIN_BATCHED_ROWS = 4  # per_head_matmul's fewest rows: every row count from here on runs one kernel


def per_head_matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [n, heads, k] @ weight [heads, k, m] per head, [n, heads, m] in the rows' dtype.

    A row's bits do not depend on n (the other rows of the step): a float32 batched matmul
    over contiguous per-head weights gives a row the same bits among 4 to 2,048 rows on the
    CPUs measured (Sapphire Rapids: from 2 rows; Zen 4: 1 row, 2-3 rows and 4 or more take
    three kernels), so fewer rows are padded to MIN_BATCHED_ROWS. bfloat16's batched matmul
    and transposed weights do depend on n, hence float32."""
    count = rows.shape[0]
    wide = rows.float()
    if 0 < count < MIN_BATCHED_ROWS:
        wide = torch.cat((wide, wide[:1].expand(MIN_BATCHED_ROWS - count, *wide.shape[1:])))
    out = torch.bmm(wide.transpose(0, 1), weight).transpose(0, 1)
    return out[:count].to(rows.dtype)


@dataclass(slots=True)
class LatentChunk:
    """A prompt chunk's rows that are prompt tokens (its first `num_expanded`), their
    backend metadata over the scratch cache and the context's latent slots."""

    row: int
    num_expanded: int
    context_slots: torch.Tensor  # [context_len] int64: the cached prefix, then these rows
    scratch: AttentionMetadata


@dataclass(slots=True)
class LatentStep(AttentionMetadata):
    """A step as latent layers with expanded prompt rows read it: the absorbed rows (the
    decodes; every row when a chunk holds generated tokens) through the backend's own
    metadata, then the prompt rows chunk by chunk (a decode row that is a prompt's last
    token is computed both ways, the expanded result kept)."""

    absorbed: AttentionMetadata | None = None  # None: no absorbed row
    num_absorbed: int = 0  # rows 0..num_absorbed - 1 (the whole step if any chunk has generated rows)
    chunks: list[LatentChunk] = field(default_factory=list)


def prepare_latent_step(step: StepLayout, backend: AttentionBackend, block_size: int) -> AttentionMetadata:
    """The step's metadata for latent layers: the backend's own when it has no prompt row."""
    spans = [(span, _num_prompt_rows(span)) for span in step.prefills]
    if not step.prompt_decodes and not any(count for _, count in spans):
        return backend.prepare(step)
    device = step.slot_mapping.device
    expanded = [(span, 1) for span in step.prompt_decodes] + [(span, count) for span, count in spans if count]
    chunks = [_chunk(span, count, backend, block_size, device) for span, count in expanded]
    if any(count < span.num_new for span, count in spans):
        return LatentStep(step.slot_mapping, backend.prepare(step), len(step.slot_mapping), chunks)
    num_decodes = step.num_decodes
    absorbed = None
    if num_decodes:
        absorbed = backend.prepare(
            StepLayout(step.slot_mapping[:num_decodes], step.decode_context_lens, step.decode_block_tables, [])
        )
    return LatentStep(step.slot_mapping, absorbed, num_decodes, chunks)


def _num_prompt_rows(span: PrefillSpan) -> int:
    first = span.context_len - span.num_new
    return max(0, min(span.num_new, span.num_prompt_tokens - first))


def _chunk(
    span: PrefillSpan, num_expanded: int, backend: AttentionBackend, block_size: int, device: torch.device
) -> LatentChunk:
    """The chunk's prompt rows as a chunk of their own over a scratch cache whose slot s
    holds position s (in `block_size`-token blocks, as the backend's)."""
    end = span.context_len - span.num_new + num_expanded
    table = list(range(-(-end // block_size)))
    rows = torch.arange(end - num_expanded, end, dtype=torch.int64, device=device)
    scratch_span = PrefillSpan(0, num_expanded, end, table, np.arange(end, dtype=np.int64), end)
    scratch = backend.prepare(StepLayout(rows, [], [], [scratch_span]))
    context_slots = torch.from_numpy(span.context_slots[:end]).to(device=device, dtype=torch.int64)
    return LatentChunk(span.row, num_expanded, context_slots, scratch)


def write_latents(cache: torch.Tensor, latents: torch.Tensor, slots: torch.Tensor) -> None:
    """latents [n, 1, dims] into the one-head cache [blocks, block_size, 1, dims] at `slots`."""
    flat = head_major(cache).view(-1, cache.shape[-1])
    flat.index_copy_(0, slots, latents.view(-1, cache.shape[-1]).to(cache.dtype))


def expanded_context(
    cache: torch.Tensor, context_slots: torch.Tensor, expand: torch.Tensor, shape: tuple[int, int, int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every head's keys and values of a context, as a scratch (key cache, value cache)
    pair, [blocks, block_size, heads, nope + rope] each over head-major storage, slot s
    position s; values padded with zeros to the keys' width.

    cache: the layer's latent cache; expand: kv_b_proj [heads, rank, nope + v]; shape:
    (nope, rope, v). A position's keys come out of the slab of SLAB positions it falls in,
    one GEMM shape whatever the context's length (zeros past its end)."""
    nope, rope, v_dim = shape
    heads, rank = expand.shape[0], expand.shape[1]
    slab = max(SLAB, block_size)
    num_context = context_slots.shape[0]
    padded = -(-num_context // slab) * slab
    latents = cache.new_zeros(padded, cache.shape[-1], dtype=expand.dtype)
    latents[:num_context] = head_major(cache).view(-1, cache.shape[-1]).index_select(0, context_slots)
    slabs = latents.view(padded // slab, 1, slab, -1)
    # [slabs, heads, slab, nope + v]: the slabs' latents through every head's up-projection.
    keys_values = torch.matmul(slabs[..., :rank], expand.unsqueeze(0))
    keys_values = keys_values.transpose(0, 1).reshape(heads, padded, nope + v_dim)
    width = nope + rope
    keys = torch.cat((keys_values[..., :nope], latents[:, rank : rank + rope].expand(heads, padded, rope)), dim=-1)
    values = torch.nn.functional.pad(keys_values[..., nope:], (0, width - v_dim))
    as_cache = (heads, padded // block_size, block_size, width)
    return keys.view(as_cache).permute(1, 2, 0, 3), values.view(as_cache).permute(1, 2, 0, 3)


def expanded_rows_attention(
    query: torch.Tensor,
    scratch: tuple[torch.Tensor, torch.Tensor],
    chunk: LatentChunk,
    backend: AttentionBackend,
    scale: float,
) -> torch.Tensor:
    """A chunk's prompt rows attending over their expanded context, [rows, heads, nope + rope]
    (the values' dims first). query: [rows, heads, nope + rope], its RoPE dims rotated."""
    keys, values = scratch
    rows = chunk.scratch.slot_mapping
    block_size = keys.shape[1]
    own_keys = keys[rows // block_size, rows % block_size]
    own_values = values[rows // block_size, rows % block_size]
    return backend.forward(query, own_keys, own_values, keys, values, chunk.scratch, scale)
