"""The LoRA slots of one projection, and the step's token-to-slot map they all read.

A projection may fuse several of the checkpoint's (q, k and v; gate and up): each is a
*segment* of its output rows. A slot holds, per segment, A ([rank, in]) in its own band of
`a` ([slots, segments x max_rank, in]) and B ([rows, rank], scaled by alpha / r) in its
rows and band of `b` ([slots, out, segments x max_rank]); B being block-diagonal, one
shrink and one expand apply every segment's adapter at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagefleet.kernels.lora import lora_expand_torch, lora_shrink_torch, slot_groups


@dataclass(slots=True)
class LoRABatch:
    """Which slot each token row of this step uses (-1: the base model)."""

    slots: torch.Tensor
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (slot, rows), for the torch path

    @classmethod
    def of(cls, token_slots: list[int], device: torch.device) -> LoRABatch | None:
        """None when no row uses an adapter (nothing to add)."""
        if all(slot < 0 for slot in token_slots):
            return None
        slots = torch.tensor(token_slots, dtype=torch.long, device=device)
        return cls(slots, slot_groups(slots) if device.type != "cuda" else [])


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
        width = len(segments) * max_rank
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_features, width, dtype=dtype, device=device)

    @property
    def bytes_per_slot(self) -> int:
        return (self.a[0].numel() + self.b[0].numel()) * self.a.element_size()

    def load(self, slot: int, pieces: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill `slot` with an adapter's (A, scaled B) per segment; other segments stay zero."""
        self.clear(slot)
        for segment, (lora_a, lora_b) in pieces.items():
            band = segment * self.max_rank
            rows = self.segments[segment]
            rank = lora_a.shape[0]
            self.a[slot, band : band + rank] = lora_a.to(self.a.device, self.a.dtype)
            self.b[slot, rows[0] : rows[1], band : band + rank] = lora_b.to(self.b.device, self.b.dtype)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's adapter delta (y as the base projection returned it)."""
        batch = self.context.batch
        if batch is None:
            return y
        if x.device.type == "cuda":
            from pagefleet.kernels.lora import lora_expand, lora_shrink

            lora_expand(lora_shrink(x, self.a, batch.slots), self.b, batch.slots, y)
            return y
        shrunk = lora_shrink_torch(x, self.a, batch.slots, batch.groups)
        lora_expand_torch(shrunk, self.b, batch.slots, y, batch.groups)
        return y
