"""Routed experts: each token's hidden state through its top-k experts' gated MLPs, weighted
and summed back in token order (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss, Gemma 4's).

Expert by expert in ascending order, each over the tokens routed to it, as transformers'
reference does: a token's sum takes its experts in the same order whatever else is in the
batch. The experts are held as two matrices, every expert's gate and up rows stacked, then
every expert's down rows, so that a checkpoint's per-expert tensors load as consecutive
parts. Three paths compute the same sum (kernels/fused_experts.py draws the layout):

- CPU with the compiled operators loaded: `torch.ops.pagefleet.fused_experts`
  (csrc/cpu_experts.cpp), one call, a token's bits the same alone or in any batch;
- CUDA: the Triton grouped matmuls (kernels/fused_experts.py);
- otherwise, and as the others' oracle: `forward_torch`, the loop over experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagefleet.engine.layers.linear import frozen_parameter
from pagefleet.kernels import cpu_ops
from pagefleet.kernels.fused_experts import ACTIVATIONS, activation_torch, fused_experts, fused_experts_torch


@dataclass(frozen=True, slots=True)
class ExpertActivation:
    """How an expert gates: `act(gate) * up` with act "silu" or "gelu_tanh", or gpt-oss's
    "swiglu_oai": gate clamped above at `limit`, up clamped to [-limit, limit], then
    `(up + 1) * gate * sigmoid(alpha * gate)`.

    Raises:
        ValueError: a kind not among those three.
    """

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {self.kind!r}: expected one of {ACTIVATIONS}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return activation_torch(gate, up, self.kind, self.alpha, self.limit)


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
        """hidden [T, H]; weights, experts [T, k]: each token's experts and their weights
        (experts int64) -> [T, H] in hidden's dtype."""
        kind, alpha, limit = self.activation.kind, self.activation.alpha, self.activation.limit
        if self._can_run_compiled(hidden):
            return torch.ops.pagefleet.fused_experts(  # type: ignore[no-any-return]
                hidden,
                weights.float().contiguous(),
                experts.long().contiguous(),
                self.gate_up,
                self.down,
                self.gate_up_bias,
                self.down_bias,
                ACTIVATIONS.index(kind),
                alpha,
                limit,
            )
        if hidden.is_cuda:
            biases = (self.gate_up_bias, self.down_bias)
            return fused_experts(hidden, weights, experts, self.gate_up, self.down, *biases, kind, alpha, limit)
        return self.forward_torch(hidden, weights, experts)

    def forward_torch(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The plain-torch loop over experts: the other paths' oracle."""
        kind, alpha, limit = self.activation.kind, self.activation.alpha, self.activation.limit
        biases = (self.gate_up_bias, self.down_bias)
        return fused_experts_torch(hidden, weights, experts, self.gate_up, self.down, *biases, kind, alpha, limit)

    def _can_run_compiled(self, hidden: torch.Tensor) -> bool:
        return (
            hidden.device.type == "cpu"
            and hidden.dtype in (torch.float32, torch.bfloat16)
            and hidden.dim() == 2
            and hidden.stride(1) == 1
            and self.gate_up.dtype == hidden.dtype
            and cpu_ops.is_loaded()
        )


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
