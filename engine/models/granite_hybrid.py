"""IBM Granite 4 hybrids (GraniteMoeHybrid): Mamba-2 layers with an attention layer every
few, each as transformers computes it.

    mamba:     in_proj -> [z | x B C | dt]; x B C through a causal depthwise conv (SiLU,
               with bias); the selective scan over the request's state (per head an
               [head_dim, state_size] matrix, decayed by exp(softplus(dt + dt_bias) * A),
               A = -exp(A_log), fed dt * B * x, read by C, plus D * x); x * SiLU(z)
               RMS-normalised per group of heads; out_proj
    attention: Llama's, scaled by `attention_multiplier`, with RoPE or none
               (`position_embedding_type`)
    feed-forward: a shared SiLU-gated MLP, plus on MoE checkpoints routed experts (the top
               k router logits, softmaxed)

Granite's multipliers scale the embeddings, every residual branch and the logits. A Mamba
layer's state is its request's slot of the state cache, carried from chunk to chunk; the
scan runs token by token (kernels/selective_scan.py), so a token's state is the same bits
however its prompt was chunked or batched. On the Triton path a prompt's whole blocks run
in the scan's chunked form, a block a chunk at absolute block multiples
(kernels/chunked_selective_scan.py), which keeps that invariance.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.distributed.shard import Shard
from pagefleet.engine.layers.experts import ExpertActivation, RoutedExperts
from pagefleet.engine.layers.linear import Linear, frozen_parameter
from pagefleet.engine.layers.norm import RMSNorm
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.hybrid import HybridForCausalLM
from pagefleet.engine.models.linear_attention_config import Mamba2Options
from pagefleet.engine.models.llama import LlamaAttention, LlamaMLP
from pagefleet.engine.models.weights import WeightLoader, conv1d_kernel
from pagefleet.engine.worker.state_cache import StateMetadata
from pagefleet.kernels.causal_conv1d import causal_conv1d
from pagefleet.kernels.chunked_selective_scan import chunked_selective_scan
from pagefleet.kernels.cpu_state import causal_conv1d_cpu, selective_scan_cpu
from pagefleet.kernels.selective_scan import selective_scan


class GroupedGatedRMSNorm(nn.Module):
    """x * SiLU(z) in float32, RMS-normalised per group of `group_size` channels, cast back
    and scaled by w (transformers' GraniteMoeHybridRMSNormGated)."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = frozen_parameter(size)
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gated = x.float() * F.silu(gate.float())
        groups = gated.view(*gated.shape[:-1], -1, self.group_size)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.view(gated.shape).to(x.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: ModelConfig, options: Mamba2Options) -> None:
        super().__init__()
        self.options = options
        inner, heads = options.intermediate_size, options.num_heads
        self.in_proj = Linear(config.hidden_size, inner + options.conv_dim + heads, bias=options.proj_bias)
        self.conv_weight = frozen_parameter(options.conv_dim, options.conv_kernel)
        self.conv_bias = frozen_parameter(options.conv_dim) if options.conv_bias else None
        self.A_log = frozen_parameter(heads)
        self.D = frozen_parameter(heads)
        self.dt_bias = frozen_parameter(heads)
        self.norm = GroupedGatedRMSNorm(inner, inner // options.num_groups, config.norm_eps)
        self.out_proj = Linear(inner, config.hidden_size, bias=options.proj_bias)

    def forward(
        self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], step: StateMetadata
    ) -> torch.Tensor:
        """hidden: [T, hidden]; state: this layer's (conv, ssm) slots, the step's sequences'
        rows read and overwritten."""
        o, num_tokens = self.options, hidden.shape[0]
        spans = (step.query_start, step.slots, step.has_state)
        group_dims = o.num_groups * o.state_size
        gate, xbc, dt = self.in_proj(hidden).split([o.intermediate_size, o.conv_dim, o.num_heads], dim=-1)
        conv = causal_conv1d if hidden.is_cuda else causal_conv1d_cpu
        xbc = conv(xbc.contiguous(), self.conv_weight, self.conv_bias, state[0], *spans, activation="silu")
        x, b, c = xbc.split([o.intermediate_size, group_dims, group_dims], dim=-1)
        inputs = (
            x.reshape(num_tokens, o.num_heads, o.head_dim),
            dt.contiguous(),
            -torch.exp(self.A_log.float()),
            b.reshape(num_tokens, o.num_groups, o.state_size),
            c.reshape(num_tokens, o.num_groups, o.state_size),
            self.D,
            self.dt_bias,
            state[1],
            *spans,
        )
        if step.chunk_size:  # the Triton path: chunked prefills (kernels/chunked_selective_scan.py)
            y = chunked_selective_scan(
                *inputs, step.start_positions, step.chunk_limits, step.chunk_size, dt_limit=o.time_step_limit
            )
        else:
            scan = selective_scan if hidden.is_cuda else selective_scan_cpu
            y = scan(*inputs, dt_limit=o.time_step_limit)
        return self.out_proj(self.norm(y.reshape(num_tokens, o.intermediate_size), gate))


class GraniteExperts(nn.Module):
    """Routed experts: the top k router logits (float32), softmaxed, in the hidden dtype."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        assert config.moe is not None, "a mixture-of-experts config"
        self.options = options = config.moe
        self.router = Linear(config.hidden_size, options.num_experts)
        activation = ExpertActivation("silu", options.swiglu_alpha, options.swiglu_limit)
        self.experts = RoutedExperts(options.num_experts, config.hidden_size, options.width, activation, False, shard)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        top, experts = torch.topk(self.router(hidden).float(), self.options.experts_per_token, dim=-1)
        return self.experts(hidden, torch.softmax(top, dim=-1).to(hidden.dtype), experts)


class GraniteHybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        super().__init__()
        assert isinstance(config.linear_attention, Mamba2Options), "a Mamba-2 config"
        self.is_mamba = config.is_state_layer(layer)
        self.residual_multiplier = config.residual_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        if self.is_mamba:
            self.mamba = Mamba2Mixer(config, config.linear_attention)
        else:
            self.self_attn = LlamaAttention(config, shard, layer)
        self.shared_mlp = LlamaMLP(config, shard)
        self.block_sparse_moe = GraniteExperts(config, shard) if config.moe is not None else None

    def forward(self, hidden, rope, cache, metadata, backend):  # type: ignore[no-untyped-def]
        normed = self.input_layernorm(hidden)
        if self.is_mamba:
            mixed = self.mamba(normed, cache, metadata)
        else:
            mixed = self.self_attn(normed, rope, cache, metadata, backend)
        hidden = hidden + mixed * self.residual_multiplier
        normed = self.post_attention_layernorm(hidden)
        out = self.shared_mlp(normed)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(normed) + out
        return hidden + out * self.residual_multiplier


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    layer_class = GraniteHybridDecoderLayer
    norm_class = RMSNorm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        config, loader = self.config, self.common_weights()
        for i, layer in enumerate(self.layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            if layer.is_mamba:
                self._declare_mamba(loader, hf + "mamba.", ours + "mamba.")
            else:
                names = [hf + f"self_attn.{p}_proj.weight" for p in "qkv"]
                loader.fused(names, ours + "self_attn.qkv_proj.weight")
                loader.direct(hf + "self_attn.o_proj.weight", ours + "self_attn.o_proj.weight")
            loader.direct(hf + "shared_mlp.input_linear.weight", ours + "shared_mlp.gate_up_proj.weight")
            loader.direct(hf + "shared_mlp.output_linear.weight", ours + "shared_mlp.down_proj.weight")
            if config.moe is not None:
                moe, ours_moe = hf + "block_sparse_moe.", ours + "block_sparse_moe."
                loader.direct(moe + "router.layer.weight", ours_moe + "router.weight")
                loader.direct(moe + "input_linear.weight", ours_moe + "experts.gate_up", _stacked_rows)
                loader.direct(moe + "output_linear.weight", ours_moe + "experts.down", _stacked_rows)
        loader.load(weights, ignore=("rotary_emb.inv_freq",))

    def _declare_mamba(self, loader: WeightLoader, hf: str, ours: str) -> None:
        options = self.config.linear_attention
        assert isinstance(options, Mamba2Options)
        for name in ("in_proj", "out_proj"):
            loader.direct(hf + f"{name}.weight", ours + f"{name}.weight")
            if options.proj_bias:
                loader.direct(hf + f"{name}.bias", ours + f"{name}.bias")
        loader.direct(hf + "conv1d.weight", ours + "conv_weight", conv1d_kernel)
        if options.conv_bias:
            loader.direct(hf + "conv1d.bias", ours + "conv_bias")
        for name in ("A_log", "D", "dt_bias", "norm.weight"):
            loader.direct(hf + name, ours + name)


def _stacked_rows(stacked: torch.Tensor) -> torch.Tensor:
    """[E, out, in] (a Linear's weight per expert) -> [E * out, in]: each expert's rows in turn
    (input_linear's gate rows then up rows, output_linear's rows)."""
    return stacked.reshape(-1, stacked.shape[-1])
