"""Mixtures of experts on Llama's attention: Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss.

What differs from Llama, each as transformers computes it: on the sparse layers the MLP is
a router (a linear layer, softmax in float32, top k, renormalised where `norm_topk_prob` or
always for Mixtral) and the routed experts' SiLU-gated MLPs (engine/layers/experts.py);
Qwen2-MoE adds a shared expert, always on, scaled by the sigmoid of its own gate. Qwen's
`mlp_only_layers` and `decoder_sparse_step` keep a dense MLP on some layers. With tensor
parallelism each rank holds an equal share of the routed experts (expert parallelism: the
router runs on every rank, each computes its experts' part and the parts are all-reduced)
and loads only their tensors; the shared expert is split as an MLP.

gpt-oss: the router has a bias and softmaxes only its top k logits; the experts have biases
and a clamped SwiGLU, their gate and up columns interleaved in the checkpoint (`[E, H, 2I]`,
gate at even columns), which loading transposes and splits into gate rows then up rows. Its
attention (llama.py) has sinks and an output bias; sliding and full layers alternate, and
RoPE is YaRN-scaled (engine/layers/rotary.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagefleet.engine.distributed.shard import Shard, Transform, chain, columns, rows
from pagefleet.engine.layers.experts import ExpertActivation, RoutedExperts, softmax_top_k, top_k_softmax
from pagefleet.engine.layers.linear import Linear
from pagefleet.engine.models.config import ModelConfig, MoEOptions
from pagefleet.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, load_decoder_weights
from pagefleet.engine.models.weights import WeightLoader


def _options(config: ModelConfig) -> MoEOptions:
    assert config.moe is not None, "a mixture-of-experts config"
    return config.moe


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        options = self.options = _options(config)
        self.gate = Linear(config.hidden_size, options.num_experts, bias=options.biases)
        activation = ExpertActivation(options.activation, options.swiglu_alpha, options.swiglu_limit)
        self.experts = RoutedExperts(
            options.num_experts, config.hidden_size, options.width, activation, options.biases, shard
        )
        shared = options.shared_expert_width
        self.shared_expert = LlamaMLP(config, shard, shared) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1) if shared else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        options, logits = self.options, self.gate(hidden)
        if options.router == "top_k_softmax":
            weights, experts = top_k_softmax(logits, options.experts_per_token)
        else:
            weights, experts = softmax_top_k(logits, options.experts_per_token, options.normalize, options.keep_float)
        out = self.experts(hidden, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


class MoEDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        super().__init__(config, shard, layer)
        if _options(config).sparse_layers[layer]:
            self.mlp = SparseMoeBlock(config, shard)  # type: ignore[assignment]


class MoEForCausalLM(LlamaForCausalLM):
    layer_class = MoEDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_decoder_weights(self, weights, declare_mlp=self._declare_experts)

    def _declare_experts(self, loader: WeightLoader, layer: int) -> bool:
        """A sparse layer's router, this rank's experts (each expert's gate and up rows, then
        every expert's down rows; the others' tensors skipped) and shared expert; False for
        a dense layer."""
        options = _options(self.config)
        if not options.sparse_layers[layer]:
            return False
        if self.config.architecture == "GptOssForCausalLM":
            _declare_gpt_oss_experts(loader, layer, self.shard.stacked_experts(options.num_experts))
            return True
        mixtral = self.config.architecture == "MixtralForCausalLM"
        block = f"model.layers.{layer}.block_sparse_moe." if mixtral else f"model.layers.{layer}.mlp."
        ours = f"layers.{layer}.mlp."
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        declare_expert_tensors(loader, block, ours, (gate, up, down), self.shard, options.num_experts)
        loader.direct(block + "gate.weight", ours + "gate.weight")
        if options.shared_expert_width:
            shard, width = self.shard, options.shared_expert_width
            start, end = shard.split(width, "shared_expert_intermediate_size")
            part = rows(start, end) if shard.size > 1 else None
            names = [block + "shared_expert.gate_proj.weight", block + "shared_expert.up_proj.weight"]
            loader.fused(names, ours + "shared_expert.gate_up_proj.weight", part)
            down_columns = columns(start, end) if shard.size > 1 else None
            loader.direct(
                block + "shared_expert.down_proj.weight", ours + "shared_expert.down_proj.weight", down_columns
            )
            loader.direct(block + "shared_expert_gate.weight", ours + "shared_expert_gate.weight")
        return True


def declare_expert_tensors(
    loader: WeightLoader, block: str, ours: str, projections: tuple[str, str, str], shard: Shard, num_experts: int
) -> None:
    """Checkpoint tensors `{block}experts.{e}.{projection}.weight`, one per expert and
    projection (gate, up, down), into `{ours}experts.gate_up` (each of this rank's experts'
    gate rows then up rows) and `{ours}experts.down`; the other ranks' experts skipped."""
    mine = shard.experts(num_experts)
    names = {e: [block + f"experts.{e}.{projection}.weight" for projection in projections] for e in range(num_experts)}
    loader.fused([name for e in mine for name in names[e][:2]], ours + "experts.gate_up")
    loader.fused([names[e][2] for e in mine], ours + "experts.down")
    loader.skip(name for e, expert in names.items() if e not in mine for name in expert)


def _declare_gpt_oss_experts(loader: WeightLoader, layer: int, held: Transform | None) -> None:
    """gpt-oss's router and experts: its stacked `[E, H, 2I]` gate/up (gate at even columns)
    and `[E, I, H]` down, cut to this rank's experts by `held`, transposed to our per-expert
    rows, and their biases likewise."""
    block, ours = f"model.layers.{layer}.mlp.", f"layers.{layer}.mlp."
    loader.direct(block + "router.weight", ours + "gate.weight")
    loader.direct(block + "router.bias", ours + "gate.bias")
    loader.direct(block + "experts.gate_up_proj", ours + "experts.gate_up", chain(held, _gate_rows_then_up_rows))
    gate_up_bias = chain(held, _gate_rows_then_up_rows)
    loader.direct(block + "experts.gate_up_proj_bias", ours + "experts.gate_up_bias", gate_up_bias)
    loader.direct(block + "experts.down_proj", ours + "experts.down", chain(held, expert_rows))
    loader.direct(block + "experts.down_proj_bias", ours + "experts.down_bias", chain(held, _flattened))


def _gate_rows_then_up_rows(stacked: torch.Tensor) -> torch.Tensor:
    """[E, H, 2I] interleaved columns (or a bias [E, 2I]) -> [E * 2I, H] (or [E * 2I]), each
    expert's gate rows then its up rows."""
    interleaved = stacked.transpose(1, 2) if stacked.dim() == 3 else stacked
    return torch.cat((interleaved[:, 0::2], interleaved[:, 1::2]), dim=1).flatten(0, 1)


def expert_rows(stacked: torch.Tensor) -> torch.Tensor:
    """[E, in, out] (x @ W per expert) -> [E * out, in], each expert's rows as a Linear's."""
    return stacked.transpose(1, 2).flatten(0, 1)


def _flattened(bias: torch.Tensor) -> torch.Tensor:
    return bias.reshape(-1)
