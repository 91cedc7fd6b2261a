"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet linear-attention layers with a
full-attention layer every few, each as transformers computes it.

    layer_types: linear linear linear full | linear linear linear full | ...
    linear: in_proj -> [q k v | z] and [b a]; q k v through a causal depthwise conv (SiLU);
            the gated delta rule over the request's recurrent state (per value head a
            [Dk, Dv] matrix, decayed by exp(g), g = -exp(A_log) * softplus(a + dt_bias),
            written with strength beta = sigmoid(b)); a gated RMSNorm by z; out_proj
    full:   q and an output gate from q_proj (per head: D query dims, then D gate dims),
            zero-centred q/k norms, RoPE on the first quarter of each head's dims,
            attention over the paged KV, output * sigmoid(gate), o_proj

Every RMSNorm but the linear layers' gated one scales by (1 + w). A linear layer's state is
its request's slot of the state cache (engine/worker/state_cache.py), carried from chunk to
chunk and decode to decode; the delta rule runs token by token (kernels/
gated_delta_rule.py), so a token's state is the same bits however its prompt was chunked.

Qwen3-Next stores q/k/v/z and b/a grouped by key head ([q k v z] of head 0, then head 1's
...); loading reorders them into Qwen3.5's layout (all q, all k, all v, all z), which both
then run. Mixture-of-experts layers are Qwen2-MoE's: routed experts and a shared expert
under a sigmoid gate (engine/models/moe.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.distributed.shard import Shard
from pagefleet.engine.layers.attention import AttentionBackend, AttentionMetadata
from pagefleet.engine.layers.fused import rotary
from pagefleet.engine.layers.linear import Linear, frozen_parameter
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.gemma import GemmaRMSNorm
from pagefleet.engine.models.hybrid import HybridForCausalLM
from pagefleet.engine.models.linear_attention_config import LinearAttentionOptions
from pagefleet.engine.models.llama import LlamaMLP
from pagefleet.engine.models.moe import SparseMoeBlock, declare_expert_tensors
from pagefleet.engine.models.weights import WeightLoader, conv1d_kernel
from pagefleet.engine.worker.state_cache import StateMetadata
from pagefleet.kernels.causal_conv1d import causal_conv1d
from pagefleet.kernels.chunked_gated_delta_rule import chunked_gated_delta_rule
from pagefleet.kernels.cpu_state import causal_conv1d_cpu, gated_delta_rule_cpu
from pagefleet.kernels.gated_delta_rule import gated_delta_rule


class GatedRMSNorm(nn.Module):
    """Per value head: x RMS-normalised in float32, cast back, scaled by w, then times
    SiLU(z) in float32 and rounded once (transformers' Qwen3NextRMSNormGated)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = frozen_parameter(size)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * normed.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, options: LinearAttentionOptions) -> None:
        super().__init__()
        self.options = options
        self.in_proj_qkvz = Linear(config.hidden_size, options.conv_dim + options.value_dim)
        self.in_proj_ba = Linear(config.hidden_size, 2 * options.num_value_heads)
        self.conv_weight = frozen_parameter(options.conv_dim, options.conv_kernel)
        self.A_log = frozen_parameter(options.num_value_heads)
        self.dt_bias = frozen_parameter(options.num_value_heads)
        self.norm = GatedRMSNorm(options.value_head_dim, config.norm_eps)
        self.out_proj = Linear(options.value_dim, config.hidden_size)

    def forward(
        self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], step: StateMetadata
    ) -> torch.Tensor:
        """hidden: [T, hidden]; state: this layer's (conv, recurrent) slots, the step's
        sequences' rows read and overwritten."""
        o, num_tokens = self.options, hidden.shape[0]
        mixed, z = self.in_proj_qkvz(hidden).split([o.conv_dim, o.value_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).split([o.num_value_heads, o.num_value_heads], dim=-1)
        conv = causal_conv1d if hidden.is_cuda else causal_conv1d_cpu
        mixed = conv(mixed.contiguous(), self.conv_weight, None, state[0], *_spans(step), activation="silu")
        q, k, v = mixed.split([o.key_dim, o.key_dim, o.value_dim], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        heads = (
            q.reshape(num_tokens, o.num_key_heads, o.key_head_dim),
            k.reshape(num_tokens, o.num_key_heads, o.key_head_dim),
            v.reshape(num_tokens, o.num_value_heads, o.value_head_dim),
            g,
            beta,
            state[1],
            *_spans(step),
        )
        if step.chunk_size:  # the Triton path: chunked prefills (kernels/chunked_gated_delta_rule.py)
            out = chunked_gated_delta_rule(
                *heads, step.start_positions, step.chunk_limits, chunk_size=step.chunk_size, use_qk_l2norm=True
            )
        else:
            rule = gated_delta_rule if hidden.is_cuda else gated_delta_rule_cpu
            out = rule(*heads, use_qk_l2norm=True)
        out = self.norm(out.reshape(-1, o.value_head_dim), z.reshape(-1, o.value_head_dim))
        return self.out_proj(out.reshape(num_tokens, o.value_dim))


def _spans(step: StateMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return step.query_start, step.slots, step.has_state


class GatedAttention(nn.Module):
    """Full attention with an output gate: qkv_proj's rows are every head's queries, every
    head's gates, then the keys and values."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.norm_eps)
        self.scale = config.attention_scale
        self.rotary_dim = config.rotary_dim or config.head_dim

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens, r = hidden.shape[0], self.rotary_dim
        q, gate, k, v = self.qkv_proj(hidden).split([self.q_size, self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q = torch.cat((rotary(q[..., :r].contiguous(), *rope), q[..., r:]), dim=-1)
        k = torch.cat((rotary(k[..., :r].contiguous(), *rope), k[..., r:]), dim=-1)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size) * torch.sigmoid(gate))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        super().__init__()
        assert config.linear_attention is not None, "a linear-attention config"
        self.is_linear = config.is_state_layer(layer)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.norm_eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, config.linear_attention)
        else:
            self.self_attn = GatedAttention(config)
        sparse = config.moe is not None and config.moe.sparse_layers[layer]
        self.mlp: nn.Module = SparseMoeBlock(config, shard) if sparse else LlamaMLP(config, shard)

    def forward(self, hidden, rope, cache, metadata, backend):  # type: ignore[no-untyped-def]
        normed = self.input_layernorm(hidden)
        if self.is_linear:
            hidden = hidden + self.linear_attn(normed, cache, metadata)
        else:
            hidden = hidden + self.self_attn(normed, rope, cache, metadata, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextForCausalLM(HybridForCausalLM):
    layer_class = Qwen3NextDecoderLayer
    norm_class = GemmaRMSNorm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = self.common_weights()
        for i, layer in enumerate(self.layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            if layer.is_linear:
                self._declare_linear(loader, hf + "linear_attn.", ours + "linear_attn.")
            else:
                self._declare_attention(loader, hf + "self_attn.", ours + "self_attn.")
            self._declare_mlp(loader, i, hf + "mlp.", ours + "mlp.")
        loader.load(_without_mtp(weights), ignore=("rotary_emb.inv_freq",))

    def _declare_linear(self, loader: WeightLoader, hf: str, ours: str) -> None:
        options = self.config.linear_attention
        assert options is not None
        if self.config.architecture == "Qwen3NextForCausalLM":  # grouped by key head
            loader.direct(hf + "in_proj_qkvz.weight", ours + "in_proj_qkvz.weight", _QKVZByKeyHead(options))
            loader.direct(hf + "in_proj_ba.weight", ours + "in_proj_ba.weight", _BAByKeyHead(options))
        else:
            loader.fused([hf + "in_proj_qkv.weight", hf + "in_proj_z.weight"], ours + "in_proj_qkvz.weight")
            loader.fused([hf + "in_proj_b.weight", hf + "in_proj_a.weight"], ours + "in_proj_ba.weight")
        loader.direct(hf + "conv1d.weight", ours + "conv_weight", conv1d_kernel)
        for name in ("A_log", "dt_bias"):
            loader.direct(hf + name, ours + name)
        loader.direct(hf + "norm.weight", ours + "norm.weight")
        loader.direct(hf + "out_proj.weight", ours + "out_proj.weight")

    def _declare_attention(self, loader: WeightLoader, hf: str, ours: str) -> None:
        config = self.config
        query_then_gate = _QueryThenGate(config.num_heads, config.head_dim)
        names = [hf + "q_proj.weight", hf + "k_proj.weight", hf + "v_proj.weight"]
        loader.fused(names, ours + "qkv_proj.weight", [query_then_gate, None, None])
        if config.qkv_bias:
            names = [hf + "q_proj.bias", hf + "k_proj.bias", hf + "v_proj.bias"]
            loader.fused(names, ours + "qkv_proj.bias", [query_then_gate, None, None])
        loader.direct(hf + "o_proj.weight", ours + "o_proj.weight")
        loader.direct(hf + "q_norm.weight", ours + "q_norm.weight")
        loader.direct(hf + "k_norm.weight", ours + "k_norm.weight")

    def _declare_mlp(self, loader: WeightLoader, layer: int, hf: str, ours: str) -> None:
        moe = self.config.moe
        if moe is None or not moe.sparse_layers[layer]:
            loader.fused([hf + "gate_proj.weight", hf + "up_proj.weight"], ours + "gate_up_proj.weight")
            loader.direct(hf + "down_proj.weight", ours + "down_proj.weight")
            return
        declare_expert_tensors(loader, hf, ours, ("gate_proj", "up_proj", "down_proj"), self.shard, moe.num_experts)
        loader.direct(hf + "gate.weight", ours + "gate.weight")
        if moe.shared_expert_width:
            names = [hf + "shared_expert.gate_proj.weight", hf + "shared_expert.up_proj.weight"]
            loader.fused(names, ours + "shared_expert.gate_up_proj.weight")
            loader.direct(hf + "shared_expert.down_proj.weight", ours + "shared_expert.down_proj.weight")
            loader.direct(hf + "shared_expert_gate.weight", ours + "shared_expert_gate.weight")


def _without_mtp(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors but its multi-token-prediction head's (`mtp.*`, unused)."""
    return ((name, tensor) for name, tensor in weights if not name.startswith("mtp."))


class _QueryThenGate:
    """q_proj's rows [per head: D query rows, D gate rows] -> [every query row, every gate row]."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        self.num_heads, self.head_dim = num_heads, head_dim

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        per_head = tensor.reshape(self.num_heads, 2, self.head_dim, *tensor.shape[1:])
        return torch.cat((per_head[:, 0], per_head[:, 1])).reshape(tensor.shape)


class _QKVZByKeyHead:
    """Qwen3-Next's in_proj_qkvz rows [per key head: q, k, its value heads' v, their z]
    -> [all q, all k, all v, all z]."""

    def __init__(self, options: LinearAttentionOptions) -> None:
        ratio = options.num_value_heads // options.num_key_heads
        self.num_key_heads = options.num_key_heads
        value_rows = ratio * options.value_head_dim
        self.sizes = [options.key_head_dim, options.key_head_dim, value_rows, value_rows]

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        grouped = tensor.reshape(self.num_key_heads, sum(self.sizes), tensor.shape[-1])
        parts = grouped.split(self.sizes, dim=1)
        return torch.cat([part.reshape(-1, tensor.shape[-1]) for part in parts])


class _BAByKeyHead:
    """Qwen3-Next's in_proj_ba rows [per key head: its value heads' b, their a] -> [all b, all a]."""

    def __init__(self, options: LinearAttentionOptions) -> None:
        self.num_key_heads = options.num_key_heads
        self.ratio = options.num_value_heads // options.num_key_heads

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        grouped = tensor.reshape(self.num_key_heads, 2 * self.ratio, tensor.shape[-1])
        b, a = grouped.split([self.ratio, self.ratio], dim=1)
        return torch.cat((b.reshape(-1, tensor.shape[-1]), a.reshape(-1, tensor.shape[-1])))
