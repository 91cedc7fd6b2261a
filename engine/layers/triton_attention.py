"""The attention backend production GPUs use: the Triton kernels of `pagefleet.kernels`.

On a CPU it runs only under the Triton interpreter (TRITON_INTERPRET=1 before start), which
is how the engine's exactness tests check it without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagefleet.engine.layers.attention import AttentionMetadata, BlockTables, CacheSpec, StepLayout
from pagefleet.kernels.copy_blocks import copy_blocks
from pagefleet.kernels.paged_attention_decode import paged_attention_decode
from pagefleet.kernels.paged_attention_prefill import paged_attention_prefill
from pagefleet.kernels.reshape_and_cache import reshape_and_cache


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


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec

    def prepare(self, step: StepLayout) -> PagedBatch:
        device, prefills = self.spec.device, step.prefills
        cu_seqlens = np.cumsum([0] + [p.num_new for p in prefills]).tolist()
        return PagedBatch(
            slot_mapping=step.slot_mapping,
            num_decodes=step.num_decodes,
            decodes=BlockTables.of(step.decode_block_tables, step.decode_context_lens, device),
            prefills=BlockTables.of([p.block_table for p in prefills], [p.context_len for p in prefills], device),
            prefill_cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
            max_prefill_len=max((p.num_new for p in prefills), default=0),
        )

    def copy_blocks(self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
        copy_blocks(key_cache, value_cache, block_mapping)

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
        batch = metadata
        assert isinstance(batch, PagedBatch), "metadata from another backend's prepare()"
        reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        output = torch.empty_like(query)
        decodes = batch.num_decodes
        if decodes:
            output[:decodes] = paged_attention_decode(
                query[:decodes],
                key_cache,
                value_cache,
                batch.decodes.tables,
                batch.decodes.lengths,
                scale,
                self.spec.sliding_window,
            )
        if decodes < query.shape[0]:
            output[decodes:] = paged_attention_prefill(
                query[decodes:],
                key_cache,
                value_cache,
                batch.prefills.tables,
                batch.prefill_cu_seqlens,
                batch.prefills.lengths,
                scale,
                batch.max_prefill_len,
                self.spec.sliding_window,
            )
        return output
