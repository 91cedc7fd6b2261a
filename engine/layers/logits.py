"""A model's vocabulary projection, giving float32 logits in memory kept from step to step.

A decode step's logits are large: 64 rows of Gemma 3's 262,144-token vocabulary are 32 MiB
in bfloat16 and 64 MiB in float32. glibc maps any allocation of 32 MiB or more afresh, so a
fresh tensor every step is faulted in page by page. Two things avoid it:
- Float32 logits go to memory kept from the call before (converting Gemma 3's bfloat16 ones
  took 16 ms into fresh memory, 3 ms into kept memory).
- A large vocabulary is projected in chunks of CHUNK_COLUMNS, each chunk's output small
  enough for the allocator to reuse and copied into the kept memory. On Gemma 3's head
  (bfloat16, 2 threads) one call then the conversion took 40.9 ms at 64 rows, the chunks
  27.8 ms; at 1 row 16.7 against 15.3 ms. Smaller chunks lose at few rows (per-call cost: 8,192
  columns took 19.5 ms at 1 row). The logits are the same to the bit: the chunks split only
  the output columns, not any sum.

On a CPU with AMX, an untied bfloat16 head is packed for the tiles instead (kernels/
amx_tiles.py) and writes its logits straight into the kept memory: a decode step streams
the whole weight, which the tiles read faster than oneDNN (Qwen3's 151,936 rows, 2 threads:
64 rows 19.5 -> 17.7 ms, 1 row 12.5 -> 10.5 ms, before oneDNN's copy into the kept memory),
and a row's logits no longer depend on the rows beside it. A tied head's weight
is also the embedding, whose rows must stay as they are: it keeps oneDNN.
"""

from __future__ import annotations

import torch

from pagefleet.engine.layers.int8 import Int8Weight
from pagefleet.engine.layers.linear import Linear, packed_linear
from pagefleet.engine.layers.quantized import QuantizedWeight, StackedWeight
from pagefleet.kernels import amx_tiles

# Kept up to this many float32 values (256 MB); rarer, larger steps (prompt logprobs over a
# long chunk) allocate their own.
_MAX_KEPT = 64 << 20
CHUNK_COLUMNS = 65536


class LogitsHead(Linear):
    """The head: `head(hidden)` is float32 logits [rows, out_features]. A result is valid
    until the next call: the runner uses a step's logits within the step (sampling, verifying
    drafts, prompt logprobs)."""

    def __init__(
        self, in_features: int, out_features: int, chunk_columns: int | None = None, tied: bool = False
    ) -> None:
        super().__init__(in_features, out_features)
        self.chunk_columns = chunk_columns or CHUNK_COLUMNS
        self.tied = tied  # the weight is the embedding too
        self.tiles = False  # the weight packed for AMX tiles
        self._kept = torch.empty(0)
        self._chunks: list[tuple[int, torch.Tensor]] = []  # (first column, prepacked rows of the weight)

    def quantize(self, weight: QuantizedWeight | StackedWeight | Int8Weight) -> None:
        super().quantize(weight)
        self._chunks = []

    def pack(self) -> None:
        if self._takes_tiles():
            self.weight.data = amx_tiles.pack_for_tiles(self.weight.data)
            self.tiles = True
            return
        if not self.packable or self.out_features <= self.chunk_columns:
            super().pack()
            return
        weight = self.weight.detach()
        self._chunks = [
            (start, torch.ops.mkldnn._reorder_linear_weight(weight[start : start + self.chunk_columns].contiguous()))
            for start in range(0, self.out_features, self.chunk_columns)
        ]

    def _takes_tiles(self) -> bool:
        weight = self.weight
        return (
            not self.tied
            and self.bias is None
            and self.packable
            and not self.tiles
            and amx_tiles.fits(self.in_features, self.out_features, weight.dtype)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles:
            out = self._kept_rows(x.shape[0])
            torch.ops.pagefleet.tiles_linear(x.to(self.weight.dtype).contiguous(), self.weight, out)
            return out
        if not self._chunks or self.lora is not None:
            return self._float32(super().forward(x))
        out = self._kept_rows(x.shape[0])
        for start, packed in self._chunks:
            stop = min(start + self.chunk_columns, self.out_features)
            bias = None if self.bias is None else self.bias[start:stop]
            out[:, start:stop].copy_(packed_linear(x, packed, bias))
        return out

    def _float32(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype == torch.float32 or logits.device.type != "cpu":
            return logits.float()
        return self._kept_rows(logits.shape[0]).copy_(logits)

    def _kept_rows(self, rows: int) -> torch.Tensor:
        """Float32 memory for `rows` rows of logits: the kept memory, unless too large."""
        size = rows * self.out_features
        if size > _MAX_KEPT:
            return torch.empty(rows, self.out_features)
        if self._kept.numel() < size:
            self._kept = torch.empty(size)
        return self._kept[:size].view(rows, self.out_features)
