"""Routed experts: each token's hidden state through its top-k experts' gated MLPs, weighted
and summed back in token order (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss, Gemma 4's).

Run expert by expert in ascending order, each over the tokens routed to it, as transformers'
reference does: a token's sum takes its experts in the same order whatever else is in the
batch. This is the plain-torch path (the oracle of a fused operator to come); the experts
are held as two matrices, every expert's gate and up rows stacked, then every expert's
down rows, so that a checkpoint's per-expert tensors load as consecutive parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.layers.linear import frozen_parameter


@dataclass(frozen=True, slots=True)
class ExpertActivation:
    """How an expert gates: `act(gate) * up` with act "silu" or "gelu_tanh", or gpt-oss's
    "swiglu_oai": gate clamped above at `limit`, up clamped to [-limit, limit], then
    `(up + 1) * gate * sigmoid(alpha * gate)`."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        if self.kind == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        if self.kind == "swiglu_oai":
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        raise ValueError(f"unknown expert activation {self.kind!r}")


class RoutedExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        width: int,
        activation: ExpertActivation = ExpertActivation(),
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts, self.width, self.activation = num_experts, width, activation
        self.gate_up = frozen_parameter(num_experts * 2 * width, hidden_size)  # per expert: gate rows, then up rows
        self.down = frozen_parameter(num_experts * hidden_size, width)
        # gpt-oss: per expert a bias on its gate and up rows (same order) and on its output.
        self.gate_up_bias = frozen_parameter(num_experts * 2 * width) if bias else None
        self.down_bias = frozen_parameter(num_experts * hidden_size) if bias else None

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """hidden [T, H]; weights, experts [T, k]: each token's experts and their weights."""
        num, width = self.num_experts, self.width
        gate_up = self.gate_up.view(num, 2 * width, -1)
        down = self.down.view(num, -1, width)
        gate_up_bias = None if self.gate_up_bias is None else self.gate_up_bias.view(num, 2 * width)
        down_bias = None if self.down_bias is None else self.down_bias.view(num, -1)
        out = torch.zeros_like(hidden)
        for expert in experts.unique().tolist():
            tokens, slots = torch.where(experts == expert)
            projected = F.linear(hidden[tokens], gate_up[expert])
            if gate_up_bias is not None:
                projected = projected + gate_up_bias[expert]
            routed = F.linear(self.activation(*projected.chunk(2, dim=-1)), down[expert])
            if down_bias is not None:
                routed = routed + down_bias[expert]
            out.index_add_(0, tokens, (routed * weights[tokens, slots, None]).to(out.dtype))
        return out


def softmax_top_k(
    logits: torch.Tensor, k: int, normalize: bool, keep_float: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [T, k]: the k most probable experts by a float32 softmax, their
    probabilities renormalised to sum to 1 where `normalize`, cast back to the logits' dtype
    unless `keep_float` (Mixtral keeps them float32)."""
    weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if keep_float else weights.to(logits.dtype)), experts


def top_k_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [T, k]: gpt-oss's order, the k largest logits first, then a softmax
    over those k in the logits' dtype."""
    top, experts = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), experts
