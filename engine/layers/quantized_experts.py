"""Routed experts served from a GGUF file's blocks as stored (Qwen3-MoE, Qwen2-MoE, Mixtral).

llama.cpp stores a layer's experts as three 3-D tensors, one [width, hidden] (gate, up) or
[hidden, width] (down) slice per expert, each in one GGML block format. A slice is whole
rows of blocks, so expert e's gate is rows e * width ... (e + 1) * width of the tensor read
as a [num_experts * width, hidden] matrix, still quantized:

    ffn_gate_exps  [E * I, H]   expert e: rows e*I .. e*I+I-1  ─┐ gate_up[e]: [2I, H]
    ffn_up_exps    [E * I, H]   expert e: rows e*I .. e*I+I-1  ─┘ (one run, or two if the types differ)
    ffn_down_exps  [E * H, I]   expert e: rows e*H .. e*H+H-1     down[e]:    [H, I]

Each expert multiplies by `quantized_linear` (the compiled operator on a CPU, the Triton
kernel on CUDA), never a float copy of its weights. The order of work and of summation is
`RoutedExperts`' (engine/layers/experts.py): expert by expert in ascending order, each over
the tokens routed to it, so a token's sum takes its experts in the same order whatever else
is in the batch.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
from torch import nn

from pagefleet.engine.layers.experts import ExpertActivation
from pagefleet.engine.layers.quantized import (
    PackedWeight,
    QuantizedWeight,
    StackedWeight,
    for_this_device,
)

ExpertWeight: TypeAlias = QuantizedWeight | PackedWeight | StackedWeight
_SILU = ExpertActivation()  # Qwen's and Mixtral's experts


def expert_rows(weight: QuantizedWeight, expert: int, rows_per_expert: int) -> QuantizedWeight:
    """Expert `expert`'s slice of a stacked expert tensor read as [E * rows, in]: a view of
    its blocks, not a copy."""
    rows = slice(expert * rows_per_expert, (expert + 1) * rows_per_expert)
    return QuantizedWeight(weight.ggml_type, weight.quants[rows], weight.scales[rows], weight.mins[rows])


def gate_up_weight(gate: QuantizedWeight, up: QuantizedWeight) -> QuantizedWeight | StackedWeight:
    """An expert's gate rows then its up rows: one weight where both are of one type, else
    two runs multiplied each on its own (a Q4_K_M file's gate Q4_K beside up Q6_K)."""
    if gate.ggml_type == up.ggml_type:
        return QuantizedWeight.cat([gate, up])
    return StackedWeight((gate, up))


class QuantizedRoutedExperts(nn.Module):
    """`RoutedExperts`' contract over quantized weights: per expert, `gate_up[e]` [2 * width,
    hidden] (gate rows, then up rows) and `down[e]` [hidden, width]. No biases (none of
    the families served from GGUF has expert biases)."""

    def __init__(
        self,
        gate_up: list[QuantizedWeight | StackedWeight],
        down: list[QuantizedWeight],
        activation: ExpertActivation = _SILU,
    ) -> None:
        super().__init__()
        if len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} experts' gate/up weights but {len(down)} down weights")
        widths = {w.shape[0] for w in gate_up}
        hidden_sizes = {w.shape[1] for w in gate_up} | {w.shape[0] for w in down}
        if len(widths) != 1 or len(hidden_sizes) != 1 or {w.shape[1] * 2 for w in down} != widths:
            raise ValueError("experts of different shapes")
        self.num_experts, self.width, self.activation = len(down), widths.pop() // 2, activation
        self.hidden_size = hidden_sizes.pop()
        # In the layout this device's kernel reads (packed once for the AVX2 kernel).
        self.gate_up: list[ExpertWeight] = [for_this_device(w) for w in gate_up]
        self.down: list[ExpertWeight] = [for_this_device(w) for w in down]

    @property
    def nbytes(self) -> int:
        """The bytes of every expert's weights, as served."""
        return sum(w.nbytes for w in (*self.gate_up, *self.down))

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """hidden [T, H]; weights, experts [T, k]: each token's experts and their weights.
        Returns [T, H] in hidden's dtype."""
        out = torch.zeros_like(hidden)
        for expert in experts.unique().tolist():
            tokens, slots = torch.where(experts == expert)
            projected = self.gate_up[expert].matmul(hidden[tokens])
            routed = self.down[expert].matmul(self.activation(*projected.chunk(2, dim=-1)))
            out.index_add_(0, tokens, (routed * weights[tokens, slots, None]).to(out.dtype))
        return out
