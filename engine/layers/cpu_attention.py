"""The CPU backend: the compiled operators of `pagefleet.kernels.cpu_attention`, which read
each sequence's blocks in place. Decodes go through the decode operator; prefill chunks
(cached prefix or not) through the prefill operator, 2-4x faster than torch's SDPA here.
Where the prefill operator is not built (CPUs without AVX-512, head sizes not a multiple
of 8), prefill chunks are attended as the torch backend does."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagefleet.engine.layers.attention import AttentionMetadata, CacheSpec, PagedBatch, StepLayout, head_major
from pagefleet.engine.layers.torch_attention import PrefillChunk, TorchAttentionBackend
from pagefleet.kernels import cpu_ops
from pagefleet.kernels.copy_blocks import copy_blocks_torch
from pagefleet.kernels.cpu_attention import paged_attention_prefill_cpu


@dataclass(slots=True)
class CpuMetadata(PagedBatch):
    torch_prefills: list[PrefillChunk] = field(default_factory=list)  # without the prefill operator


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        compiled_prefill = cpu_ops.has_prefill() and spec.head_dim % 8 == 0
        self.torch_prefill = None if compiled_prefill else TorchAttentionBackend(spec)

    def prepare(self, step: StepLayout) -> CpuMetadata:
        metadata = CpuMetadata.of(step, self.spec.device)
        if self.torch_prefill is not None:
            metadata.torch_prefills = self.torch_prefill.prefill_chunks(step)
        return metadata

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
        batch = metadata
        assert isinstance(batch, CpuMetadata), "metadata from another backend's prepare()"
        # The operators themselves, not their checked wrappers: this metadata is built to their
        # contract, their C++ checks remain, and the wrappers' Python checks would run on every
        # layer of every step.
        dtype = key_cache.dtype
        torch.ops.pagefleet.reshape_and_cache(
            key.to(dtype), value.to(dtype), key_cache, value_cache, batch.slot_mapping
        )
        decodes = batch.num_decodes
        if self.torch_prefill is not None:  # no prefill operator: the torch backend's prefill
            output = torch.empty_like(query)
            if decodes:
                output[:decodes] = self._decode(query[:decodes], key_cache, value_cache, batch, scale)
            keys, values = head_major(key_cache), head_major(value_cache)
            self.torch_prefill.attend_prefills(query, key, value, keys, values, batch.torch_prefills, scale, output)
            return output
        parts = []  # decode rows first, then prefill rows; a step of one kind is not copied
        if decodes:
            parts.append(self._decode(query[:decodes], key_cache, value_cache, batch, scale))
        if decodes < query.shape[0]:
            parts.append(self._prefill(query[decodes:], key_cache, value_cache, batch, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: PagedBatch, scale: float
    ) -> torch.Tensor:
        tables, lengths = batch.decodes.tables, batch.decodes.lengths
        window = self.spec.sliding_window or 0
        return torch.ops.pagefleet.paged_attention_decode(query, key_cache, value_cache, tables, lengths, scale, window)

    def _prefill(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: PagedBatch, scale: float
    ) -> torch.Tensor:
        return paged_attention_prefill_cpu(
            query,
            key_cache,
            value_cache,
            batch.prefills.tables,
            batch.prefill_cu_seqlens,
            batch.prefills.lengths,
            scale,
            self.spec.sliding_window,
        )
