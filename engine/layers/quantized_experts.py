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

Two paths compute that sum. Where the experts' gate/up blocks are all of one type and their
down blocks all of one type (a file's three tensors, the usual case), the experts are held
stacked, one matrix per projection as in the file, and with the compiled operators loaded
`torch.ops.pagefleet.quantized_experts` (csrc/cpu_quant_experts.h) runs the layer in one
call: per row the same quantized activations and column kernel as `quantized_linear`, so
the same bits as the loop, without the interpreter between some 100 small calls a layer
(at one token 0.5 ms a layer against the loop's 2.7, docs/benchmarks.md). Otherwise, and
as its reference, `forward_loop` calls `quantized_linear` expert by expert. `gate_up[e]`,
`down[e]` are each expert's weights either way (views of the stacked matrices where they
are stacked).
"""

from __future__ import annotations

from typing import TypeAlias

import torch
from torch import nn

from pagefleet.engine.layers.experts import ExpertActivation
from pagefleet.engine.layers.quantized import (
    LANES,
    PackedWeight,
    QuantizedWeight,
    StackedWeight,
    for_this_device,
)
from pagefleet.kernels import cpu_ops
from pagefleet.kernels.fused_experts import ACTIVATIONS

ExpertWeight: TypeAlias = QuantizedWeight | PackedWeight | StackedWeight
_SILU = ExpertActivation()  # Qwen's and Mixtral's experts


def expert_rows(weight: QuantizedWeight, expert: int, rows_per_expert: int) -> QuantizedWeight:
    """Expert `expert`'s slice of a stacked expert tensor read as [E * rows, in]: a view of
    its blocks, not a copy."""
    return weight.select_rows(slice(expert * rows_per_expert, (expert + 1) * rows_per_expert))


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
        self.stacked = _stacked(gate_up, 2 * self.width), _stacked(down, self.hidden_size)
        if self.stacked[0] is not None and self.stacked[1] is not None:
            self.gate_up: list[ExpertWeight] = _expert_views(self.stacked[0], self.num_experts)
            self.down: list[ExpertWeight] = _expert_views(self.stacked[1], self.num_experts)
        else:
            self.stacked = None, None
            self.gate_up = [for_this_device(w) for w in gate_up]
            self.down = [for_this_device(w) for w in down]

    @property
    def nbytes(self) -> int:
        """The bytes of every expert's weights, as served."""
        return sum(w.nbytes for w in (*self.gate_up, *self.down))

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """hidden [T, H]; weights, experts [T, k]: each token's experts and their weights.
        Returns [T, H] in hidden's dtype."""
        gate_up, down = self.stacked
        if gate_up is None or down is None or hidden.device.type != "cpu" or not cpu_ops.has_quantized_linear():
            return self.forward_loop(hidden, weights, experts)
        activation = self.activation
        return torch.ops.pagefleet.quantized_experts(
            hidden.contiguous(),
            weights.float().contiguous(),
            experts.long().contiguous(),
            gate_up.quants,
            gate_up.scales,
            gate_up.mins,
            kernel_kind(gate_up),
            down.quants,
            down.scales,
            down.mins,
            kernel_kind(down),
            self.num_experts,
            self.width,
            ACTIVATIONS.index(activation.kind),
            activation.alpha,
            activation.limit,
        )

    def forward_loop(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """`forward` by one `quantized_linear` call per expert and projection: the compiled
        operator's reference, and the path on CUDA."""
        out = torch.zeros_like(hidden)
        for expert in experts.unique().tolist():
            tokens, slots = torch.where(experts == expert)
            projected = self.gate_up[expert].matmul(hidden[tokens])
            routed = self.down[expert].matmul(self.activation(*projected.chunk(2, dim=-1)))
            out.index_add_(0, tokens, (routed * weights[tokens, slots, None]).to(out.dtype))
        return out


def _stacked(weights: list[QuantizedWeight | StackedWeight], rows: int) -> QuantizedWeight | PackedWeight | None:
    """Every expert's weight (`rows` rows each) as one matrix in this device's layout, expert
    e's rows after the others', or None where the experts' types differ or the packed
    layout cannot hold one expert's rows in whole groups of columns."""
    if not all(isinstance(w, QuantizedWeight) for w in weights) or len({w.ggml_type for w in weights}) != 1:
        return None
    parts = [w for w in weights if isinstance(w, QuantizedWeight)]
    if cpu_ops.quantized_packed_layout() and rows % LANES:
        return None
    return for_this_device(QuantizedWeight.cat(parts))  # type: ignore[return-value]


def _expert_views(stacked: QuantizedWeight | PackedWeight, num_experts: int) -> list[ExpertWeight]:
    """Each expert's rows of a stacked matrix, as views (its weights are held once)."""
    rows = stacked.shape[0] // num_experts
    if isinstance(stacked, QuantizedWeight):
        return [expert_rows(stacked, e, rows) for e in range(num_experts)]
    groups = rows // LANES
    return [
        PackedWeight(
            stacked.ggml_type,
            stacked.quants[e * groups : (e + 1) * groups],
            stacked.scales[e * groups : (e + 1) * groups],
            stacked.mins[e * groups : (e + 1) * groups],
            rows,
        )
        for e in range(num_experts)
    ]


def kernel_kind(weight: QuantizedWeight | PackedWeight) -> int:
    """The operator's `kind`: the packed kind (AVX2) or GGML's-order format (VNNI)."""
    return weight.kind if isinstance(weight, PackedWeight) else weight.format
