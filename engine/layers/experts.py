"""Routed experts: each token's hidden state through its top-k experts' gated MLPs, weighted
and summed back in token order (Qwen3-MoE, Qwen2-MoE, Mixtral, Gemma 4's).

Run expert by expert in ascending order, each over the tokens routed to it, as transformers'
reference does: a token's sum takes its experts in the same order whatever else is in the
batch. This is the plain-torch path (the oracle of a fused operator to come); the experts
are held as two matrices, every expert's gate and up rows stacked, then every expert's
down rows, so that a checkpoint's per-expert tensors load as consecutive parts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.layers.linear import frozen_parameter


class RoutedExperts(nn.Module):
    def __init__(
        self, num_experts: int, hidden_size: int, width: int, activation: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__()
        self.num_experts, self.width, self.activation = num_experts, width, activation
        self.gate_up = frozen_parameter(num_experts * 2 * width, hidden_size)  # per expert: gate rows, then up rows
        self.down = frozen_parameter(num_experts * hidden_size, width)

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """hidden [T, H]; weights, experts [T, k]: each token's experts and their weights."""
        gate_up = self.gate_up.view(self.num_experts, 2 * self.width, -1)
        down = self.down.view(self.num_experts, -1, self.width)
        out = torch.zeros_like(hidden)
        for expert in experts.unique().tolist():
            tokens, slots = torch.where(experts == expert)
            gate, up = F.linear(hidden[tokens], gate_up[expert]).chunk(2, dim=-1)
            routed = F.linear(self.activation(gate) * up, down[expert])
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
