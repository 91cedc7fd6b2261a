"""The CPU backend: the compiled operators of `pagefleet.kernels.cpu_attention`, which read
each sequence's blocks in place. Every row of a step, decode or prompt, goes through one
operator with one arithmetic (`paged_attention_rows`): a row attends over the context up to
its own position in partitions of 256 keys cut at the same positions whatever the chunk, so
its output never depends on whether its prefix was computed in this step, an earlier one,
another replica or the file tier, nor on the other rows (path invariance). The rows of a
prompt chunk share each key read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefleet.engine.layers.attention import AttentionMetadata, CacheSpec, StepLayout, padded_tables
from pagefleet.kernels.copy_blocks import copy_blocks_torch


@dataclass(slots=True)
class RowTables:
    """Every row of a step as the rows operator reads it: one block table per sequence,
    each row's context up to and including its own position, and the rows of each table."""

    tables: torch.Tensor  # [num_sequences, max_blocks] int32
    lengths: torch.Tensor  # [num_rows] int32
    row_groups: torch.Tensor  # [num_sequences + 1] int32

    @classmethod
    def of(cls, step: StepLayout, device: torch.device) -> RowTables:
        tables = list(step.decode_block_tables) + [span.block_table for span in step.prefills]
        lengths = list(step.decode_context_lens)
        groups = list(range(len(lengths) + 1))
        for span in step.prefills:
            lengths += range(span.context_len - span.num_new + 1, span.context_len + 1)
            groups.append(len(lengths))
        lengths_tensor = torch.tensor(lengths, dtype=torch.int32, device=device)
        groups_tensor = torch.tensor(groups, dtype=torch.int32, device=device)
        return cls(padded_tables(tables, device), lengths_tensor, groups_tensor)


@dataclass(slots=True)
class CpuMetadata(AttentionMetadata):
    rows: RowTables


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec

    def prepare(self, step: StepLayout) -> CpuMetadata:
        return CpuMetadata(step.slot_mapping, RowTables.of(step, self.spec.device))

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
        batch = metadata
        assert isinstance(batch, CpuMetadata), "metadata from another backend's prepare()"
        # The operators themselves, not their checked wrappers: this metadata is built to their
        # contract, their C++ checks remain, and the wrappers' Python checks would run on every
        # layer of every step.
        dtype = key_cache.dtype
        torch.ops.pagefleet.reshape_and_cache(
            key.to(dtype), value.to(dtype), key_cache, value_cache, batch.slot_mapping
        )
        rows = batch.rows
        return torch.ops.pagefleet.paged_attention_rows(
            query,
            key_cache,
            value_cache,
            rows.tables,
            rows.lengths,
            rows.row_groups,
            scale,
            window or 0,
            softcap or 0.0,
            sinks,
            chunk or 0,
        )
