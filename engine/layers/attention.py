"""Attention over the paged KV cache: the metadata of one step and the backend seam.

A step's tokens form one flat batch with no padding:

    rows: [ d0 d1 d2 ... | p0 p0 p0 p0 | p1 p1 ... ]
           decodes: one    prefill chunks: q_len
           token each      tokens each (causal)

Every row's key and value are first written into the cache at its slot
(`slot = block_id * block_size + offset`); then each query attends over its sequence's
context, read back through the sequence's block table.

The model runner describes a step once, neutrally (`StepLayout`); each backend builds its
own metadata from it (`AttentionBackend.prepare`), once per step, and every layer passes
that metadata back to the backend's `forward`. A backend is one module plus one line in
`backends.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pagefleet.engine.core.host_memory import zeros_on_huge_pages

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (key cache, value cache)


@dataclass(slots=True, frozen=True)
class CacheSpec:
    """What a backend may need to know of the caches it reads, fixed for the engine's life."""

    num_blocks: int
    block_size: int
    num_kv_heads: int  # the most of any layer (Gemma 4's layers differ)
    head_dim: int
    dtype: torch.dtype
    device: torch.device


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of new tokens in the flat batch."""

    row: int  # its first row
    num_new: int
    context_len: int  # cached prefix + this chunk
    block_table: list[int]  # the blocks covering [0, context_len) (block 0 where a window freed one)
    context_slots: np.ndarray  # [context_len] cache slot of every context position
    num_prompt_tokens: int = 0  # its request's: rows at positions before it are prompt tokens


@dataclass(slots=True)
class StepLayout:
    """One step's attention work, before any backend shapes it: decodes (one token each)
    are rows 0..num_decodes - 1, prefill chunks follow."""

    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of every row
    decode_context_lens: list[int]
    decode_block_tables: list[list[int]]
    prefills: list[PrefillSpan]
    # Decode rows that are a prompt's last token (after a prefix-cache hit), as one-row
    # spans: latent attention computes prompt tokens its own way (engine/layers/latent_prefill.py).
    prompt_decodes: list[PrefillSpan] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_context_lens)


@dataclass(slots=True)
class AttentionMetadata:
    """The base of every backend's metadata: what every backend needs to write the cache."""

    slot_mapping: torch.Tensor  # [num_tokens] int64


@dataclass(slots=True)
class BlockTables:
    """Padded block tables and lengths as int32 tensors, the shape kernels read."""

    tables: torch.Tensor  # [num_seqs, max_blocks] int32 (padded with block 0)
    lengths: torch.Tensor  # [num_seqs] int32

    @classmethod
    def of(cls, tables: list[list[int]], lengths: list[int], device: torch.device) -> BlockTables:
        return cls(padded_tables(tables, device), torch.tensor(lengths, dtype=torch.int32, device=device))


def padded_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one int32 tensor [len(tables), longest], padded with block 0 (which
    also stands for the places a sliding window freed: never read unmasked)."""
    width = max((len(t) for t in tables), default=0)
    rows = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32).clamp_(min=0).view(len(tables), width).to(device)


@dataclass(slots=True)
class PagedBatch(AttentionMetadata):
    """The step as the kernels read it: block tables and lengths. Decode rows are
    0..num_decodes-1; prefill chunk i is rows num_decodes + cu_seqlens[i] ..
    num_decodes + cu_seqlens[i + 1]."""

    num_decodes: int
    decodes: BlockTables
    prefills: BlockTables  # lengths: cached prefix + chunk
    prefill_cu_seqlens: torch.Tensor  # [num_prefills + 1] int32
    max_prefill_len: int

    @classmethod
    def of(cls, step: StepLayout, device: torch.device) -> PagedBatch:
        prefills = step.prefills
        cu_seqlens = np.cumsum([0] + [p.num_new for p in prefills]).tolist()
        return cls(
            slot_mapping=step.slot_mapping,
            num_decodes=step.num_decodes,
            decodes=BlockTables.of(step.decode_block_tables, step.decode_context_lens, device),
            prefills=BlockTables.of([p.block_table for p in prefills], [p.context_len for p in prefills], device),
            prefill_cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
            max_prefill_len=max((p.num_new for p in prefills), default=0),
        )


LayerMetadata = list[AttentionMetadata]  # per layer: its KV cache group's metadata for the step


class AttentionBackend(Protocol):
    """Writes a layer's new keys/values into its cache and computes attention."""

    name: str

    def prepare(self, step: StepLayout) -> AttentionMetadata:
        """This backend's metadata for `step`, built once and passed to every layer."""
        ...

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
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim]; key/value: [num_tokens, num_kv_heads,
        head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]; metadata: what
        this backend's `prepare` built; the layer's own attention: each query sees the last
        `window` keys (None: all), its scores scaled by `scale`, then capped as
        `softcap * tanh(score / softcap)` (None: no cap); `sinks` [num_heads]: one
        more logit per head in each softmax's denominator, with no value (gpt-oss; None: none);
        `chunk`: each query sees only its own chunk of that many positions (Llama 4; None: none).

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
    """A zeroed cache, [num_blocks, block_size, num_kv_heads, head_dim] over head-major storage;
    on the CPU, on huge pages where the kernel gives them (engine/core/host_memory.py)."""
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    if torch.device(device).type == "cpu":
        storage = zeros_on_huge_pages(*shape, dtype=dtype)
    else:
        storage = torch.zeros(*shape, dtype=dtype, device=device)
    return storage.permute(1, 2, 0, 3)
