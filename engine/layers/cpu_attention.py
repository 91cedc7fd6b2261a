"""The CPU backend: decodes through the compiled operator, which reads each sequence's
blocks in place (`pagefleet.kernels.cpu_attention`); prefill chunks as the torch backend
attends them (SDPA is compute-bound there, and already fast)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagefleet.engine.layers.attention import AttentionMetadata, BlockTables, CacheSpec, StepLayout, head_major
from pagefleet.engine.layers.torch_attention import PrefillChunk, TorchAttentionBackend
from pagefleet.kernels.copy_blocks import copy_blocks_torch
from pagefleet.kernels.cpu_attention import paged_attention_decode_cpu
from pagefleet.kernels.reshape_and_cache import reshape_and_cache_torch


@dataclass(slots=True)
class CpuMetadata(AttentionMetadata):
    decodes: BlockTables | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.prefill_backend = TorchAttentionBackend(spec)

    def prepare(self, step: StepLayout) -> CpuMetadata:
        decodes = None
        if step.num_decodes:
            decodes = BlockTables.of(step.decode_block_tables, step.decode_context_lens, self.spec.device)
        return CpuMetadata(step.slot_mapping, decodes, self.prefill_backend.prefill_chunks(step))

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
        assert isinstance(metadata, CpuMetadata), "metadata from another backend's prepare()"
        reshape_and_cache_torch(key, value, key_cache, value_cache, metadata.slot_mapping)
        decoded = None
        if metadata.decodes is not None:
            tables, lengths = metadata.decodes.tables, metadata.decodes.lengths
            decoded = paged_attention_decode_cpu(
                query[: lengths.numel()], key_cache, value_cache, tables, lengths, scale, self.spec.sliding_window
            )
            if not metadata.prefills:  # a pure decode step: no copy
                return decoded
        output = torch.empty_like(query)
        if decoded is not None:
            output[: decoded.shape[0]] = decoded
        keys, values = head_major(key_cache), head_major(value_cache)
        self.prefill_backend.attend_prefills(query, key, value, keys, values, metadata.prefills, scale, output)
        return output
