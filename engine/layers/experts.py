"""Routed experts: each token's hidden state through its top-k experts' gated MLPs, weighted
and summed back in token order (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss, Gemma 4's).

Expert by expert in ascending order, each over the tokens routed to it, as transformers'
reference does: a token's sum takes its experts in the same order whatever else is in the
batch. The experts are held as two matrices, every expert's gate and up rows stacked, then
every expert's down rows, so that a checkpoint's per-expert tensors load as consecutive
parts. Three paths compute the same sum (kernels/fused_experts.py draws the layout):

- CPU with the compiled operators loaded: `torch.ops.pagefleet.fused_experts`
  (csrc/cpu_experts.cpp), one call, a token's bits the same alone or in any batch; on AMX
  CPUs, bfloat16 experts of whole tiles are packed for them once loaded (`pack`) and run
  `fused_experts_packed`, the same bits;
- CUDA: the Triton grouped matmuls (kernels/fused_experts.py);
- otherwise, and as the others' oracle: `forward_torch`, the loop over experts.

Expert parallelism: with tensor parallelism each rank holds an equal share of the experts
(`Shard.experts`), in id order, and runs the tokens' pairs routed to them; the others' are
given as -1, which every path skips. The ranks' partial sums are all-reduced, so every
rank returns the whole output:

    experts [T, k] (global)  3 0 5 2  --rank 1 of 2, E=8, holds 4..7-->  -1 -1 1 -1
    out = all_reduce(rank 0's sum over experts 0..3, rank 1's over 4..7)

A token's sum then adds its experts in ascending order within each rank, then the ranks'
sums: other bits than one rank's (greedy tokens equal transformers' all the same). With one
rank the ids are passed as they are and nothing is reduced: the same bits as without a shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagefleet.engine.distributed.shard import Shard
from pagefleet.engine.layers.linear import frozen_parameter
from pagefleet.kernels import amx_tiles, cpu_ops
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
    """This rank's routed experts, returning every expert's contribution summed.

    Args:
        num_experts: experts in the layer, over every rank.
        hidden_size, width: each expert's input/output size and intermediate size.
        activation: how the experts gate.
        bias: gpt-oss's biases on gate/up and down.
        shard: the tensor-parallel rank; it holds experts `shard.experts(num_experts)` only
            (parameters sized for them, loaded from their checkpoint tensors).

    Raises:
        UnsupportedModelError: num_experts does not divide between the ranks.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        width: int,
        activation: ExpertActivation = ExpertActivation(),
        bias: bool = False,
        shard: Shard | None = None,
    ) -> None:
        super().__init__()
        self.shard = shard = shard or Shard()
        self.num_experts, self.width, self.activation = num_experts, width, activation
        self.local_experts = shard.experts(num_experts)
        held = len(self.local_experts)
        self.gate_up = frozen_parameter(held * 2 * width, hidden_size)  # per expert: gate rows, then up rows
        self.down = frozen_parameter(held * hidden_size, width)
        # gpt-oss: per expert a bias on its gate and up rows (same order) and on its output.
        self.gate_up_bias = frozen_parameter(held * 2 * width) if bias else None
        self.down_bias = frozen_parameter(held * hidden_size) if bias else None
        self.packed = False  # gate_up and down packed for AMX tiles (`pack`)

    def pack(self) -> None:
        """Once loaded: on a CPU whose AMX tiles take this shape, hold bfloat16 weights packed
        for them (kernels/amx_tiles.py): no transposes at every step, the same bits."""
        hidden_size, dtype = self.down.shape[0] // len(self.local_experts), self.gate_up.dtype
        if self.packed or self.gate_up.device.type != "cpu":
            return
        if amx_tiles.fits(hidden_size, 2 * self.width, dtype) and amx_tiles.fits(self.width, hidden_size, dtype):
            self.gate_up.data = amx_tiles.pack_for_tiles(self.gate_up.data)
            self.down.data = amx_tiles.pack_for_tiles(self.down.data)
            self.packed = True

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """hidden [T, H]; weights, experts [T, k]: each token's experts (global ids, int64)
        and their weights -> [T, H] in hidden's dtype, on every rank."""
        kind, alpha, limit = self.activation.kind, self.activation.alpha, self.activation.limit
        local = self.local_ids(experts)
        if self._can_run_compiled(hidden):
            operator = torch.ops.pagefleet.fused_experts_packed if self.packed else torch.ops.pagefleet.fused_experts
            out = operator(
                hidden,
                weights.float().contiguous(),
                local.long().contiguous(),
                self.gate_up,
                self.down,
                self.gate_up_bias,
                self.down_bias,
                ACTIVATIONS.index(kind),
                alpha,
                limit,
            )
        elif hidden.is_cuda:
            biases = (self.gate_up_bias, self.down_bias)
            out = fused_experts(hidden, weights, local, self.gate_up, self.down, *biases, kind, alpha, limit)
        else:
            out = self._forward_torch_local(hidden, weights, local)
        return self.shard.all_reduce(out)

    def local_ids(self, experts: torch.Tensor) -> torch.Tensor:
        """experts [T, k] global ids -> this rank's indices of them, -1 where another rank
        holds the expert (the ids themselves with one rank)."""
        if self.shard.size == 1:
            return experts
        local = experts - self.local_experts.start
        return local.masked_fill((local < 0) | (local >= len(self.local_experts)), -1)

    def forward_torch(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """`forward` by the plain-torch loop over experts: the other paths' oracle."""
        return self.shard.all_reduce(self._forward_torch_local(hidden, weights, self.local_ids(experts)))

    def _forward_torch_local(self, hidden: torch.Tensor, weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        kind, alpha, limit = self.activation.kind, self.activation.alpha, self.activation.limit
        biases = (self.gate_up_bias, self.down_bias)
        gate_up, down = self.gate_up, self.down
        if self.packed:
            gate_up, down = amx_tiles.unpack_from_tiles(gate_up), amx_tiles.unpack_from_tiles(down)
        return fused_experts_torch(hidden, weights, local, gate_up, down, *biases, kind, alpha, limit)

    def _can_run_compiled(self, hidden: torch.Tensor) -> bool:
        return (
            hidden.device.type == "cpu"
            and hidden.dtype in (torch.float32, torch.bfloat16)
            and hidden.dim() == 2
            and hidden.stride(1) == 1
            and self.gate_up.dtype == hidden.dtype
            and cpu_ops.is_loaded()
        )


def pack_experts(model: nn.Module) -> None:
    """Every RoutedExperts of a loaded model packed for this CPU's tiles, where it has them."""
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.pack()


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
