"""The attention backend production GPUs use: the Triton kernels of `pagefleet.kernels`.

On a CPU it runs only under the Triton interpreter (TRITON_INTERPRET=1 before start), which
is how the engine's exactness tests check it without a GPU.
"""

from __future__ import annotations

import torch

from pagefleet.engine.layers.attention import AttentionMetadata, CacheSpec, PagedBatch, StepLayout
from pagefleet.kernels.copy_blocks import copy_blocks
from pagefleet.kernels.paged_attention_decode import paged_attention_decode
from pagefleet.kernels.paged_attention_prefill import paged_attention_prefill
from pagefleet.kernels.reshape_and_cache import reshape_and_cache


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec

    def prepare(self, step: StepLayout) -> PagedBatch:
        return PagedBatch.of(step, self.spec.device)

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
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk: int | None = None,
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
                window,
                softcap=softcap,
                sinks=sinks,
                chunk=chunk,
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
                window,
                softcap=softcap,
                sinks=sinks,
                chunk=chunk,
            )
        return output
