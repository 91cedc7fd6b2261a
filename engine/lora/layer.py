"""The LoRA slots of one projection, and the step's token-to-slot map they all read.

A projection may fuse several of the checkpoint's (q, k and v; gate and up): each is a
*segment* of its output rows. A slot holds, per segment, A ([rank, in]) in its own band of
`a` ([slots, segments x max_rank, in]) and B's transpose ([rank, rows], scaled by alpha / r)
in its band and rows of `b` ([slots, segments x max_rank, out]); the bands are packed at
the adapter's own rank (segment i at [i x rank, (i + 1) x rank)) and the rest is zero.
B being block-diagonal, the Triton kernels apply every segment's adapter in one shrink and
one expand; the CPU paths skip the zeros instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefleet.kernels import cpu_ops


@dataclass(slots=True)
class LoRABatch:
    """Which slot each token row of this step uses (-1: the base model): per row for the
    Triton kernels, and as runs of consecutive rows of one slot for the CPU paths (the
    engine orders a step's chunks by slot, so a slot's rows are one or two runs)."""

    slots: torch.Tensor | None  # per row, on CUDA only
    runs: list[tuple[int, int, int]]  # (slot, first row, end row)
    run_table: torch.Tensor  # the runs as an int64 [R, 3] tensor, for the compiled operator

    @classmethod
    def of(cls, chunk_slots: list[tuple[int | None, int]], device: torch.device) -> LoRABatch | None:
        """From each chunk's (slot, rows), in batch order (slot None: the base model); None
        when no row uses an adapter."""
        runs: list[tuple[int, int, int]] = []
        row = 0
        for slot, count in chunk_slots:
            if slot is not None and runs and runs[-1][0] == slot and runs[-1][2] == row:
                runs[-1] = (slot, runs[-1][1], row + count)  # the same adapter as the chunk before
            elif slot is not None:
                runs.append((slot, row, row + count))
            row += count
        if not runs:
            return None
        slots = None
        if device.type == "cuda":  # the kernel's per-row slots, -1 for the base model
            per_chunk = torch.tensor([(-1 if s is None else s, n) for s, n in chunk_slots], dtype=torch.long)
            slots = per_chunk[:, 0].repeat_interleave(per_chunk[:, 1]).to(device)
        return cls(slots, runs, torch.tensor(runs, dtype=torch.long))


@dataclass(slots=True)
class LoRAContext:
    """Shared by every LoRA layer of a model; the runner sets `batch` before each forward."""

    batch: LoRABatch | None = None


class LoRALayer:
    def __init__(
        self,
        context: LoRAContext,
        in_features: int,
        out_features: int,
        segments: list[tuple[int, int]],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.context = context
        self.segments, self.max_rank = segments, max_rank
        self.segment_table = torch.tensor(segments, dtype=torch.long).reshape(-1, 2)
        width = len(segments) * max_rank
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        self.ranks = torch.zeros(max_loras, dtype=torch.long)  # each slot's adapter's rank (0: none here)

    @property
    def bytes_per_slot(self) -> int:
        return (self.a[0].numel() + self.b[0].numel()) * self.a.element_size()

    def load(self, slot: int, pieces: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill `slot` with an adapter's (A, scaled B) per segment; other segments stay zero."""
        self.clear(slot)
        for segment, (lora_a, lora_b) in pieces.items():
            rank = lora_a.shape[0]
            band = segment * rank
            rows = self.segments[segment]
            self.a[slot, band : band + rank] = lora_a.to(self.a.device, self.a.dtype)
            self.b[slot, band : band + rank, rows[0] : rows[1]] = lora_b.T.to(self.b.device, self.b.dtype)
            self.ranks[slot] = rank

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot] = 0

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's adapter delta (y as the base projection returned it)."""
        batch = self.context.batch
        if batch is None:
            return y
        if batch.slots is not None:  # on CUDA
            from pagefleet.kernels.lora import lora_expand, lora_shrink

            lora_expand(lora_shrink(x, self.a, batch.slots), self.b.transpose(1, 2), batch.slots, y)
        elif _compiled(x, y):
            torch.ops.pagefleet.lora_add(x, y, self.a, self.b, batch.run_table, self.ranks, self.segment_table)
        else:
            self.add_delta_torch(x, y, batch.runs)
        return y

    def add_delta_torch(self, x: torch.Tensor, y: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
        """The compiled operator's reference, and the path without it: per run, one shrink,
        then one expand per segment onto that segment's rows only."""
        for slot, start, end in runs:
            rank = int(self.ranks[slot])
            if rank == 0:
                continue
            shrunk = x[start:end] @ self.a[slot, : len(self.segments) * rank].T
            for segment, (row_start, row_end) in enumerate(self.segments):
                band = slice(segment * rank, (segment + 1) * rank)
                y[start:end, row_start:row_end].addmm_(shrunk[:, band], self.b[slot, band, row_start:row_end])


def _compiled(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (
        x.dtype in (torch.float32, torch.bfloat16) and x.stride(-1) == 1 and y.stride(-1) == 1 and cpu_ops.is_loaded()
    )
