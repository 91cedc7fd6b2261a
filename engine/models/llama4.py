"""Llama 4 (text; Scout and Maverick's language model): Llama's layers with chunked local
attention on the RoPE layers, global NoPE layers with attention temperature tuning, and a
mixture of experts with a shared expert on the `moe_layers`.

What differs from Llama, as transformers computes it:
- RoPE layers see only the keys of their own chunk of `attention_chunk_size` positions
  (position p sees [p - p % C, p]); every `no_rope_layer_interval`-th layer has no RoPE and
  sees every key, its queries scaled by `log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`.
- RoPE rotates interleaved pairs (x0, x1), (x2, x3), ...: q and k rows are put in
  rotate-half order once at load (q . k is unchanged), so the usual RoPE applies. RoPE
  layers then L2-normalise q and k per head (`use_qk_norm`).
- Experts: the router takes the top k logits and their sigmoids scale each token's input to
  its expert (not the output); a shared expert is always added. Released models route to
  one expert (top 1), the only setting served. Dense layers are `intermediate_size_mlp` wide.
  With tensor parallelism each rank holds an equal share of the routed experts (their
  stacked tensors cut at load) and the shared expert is split as an MLP.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagefleet.engine.distributed.shard import Shard, chain, columns, rows
from pagefleet.engine.layers.attention import AttentionBackend, AttentionMetadata
from pagefleet.engine.layers.experts import RoutedExperts
from pagefleet.engine.layers.fused import rotary
from pagefleet.engine.layers.linear import Linear
from pagefleet.engine.layers.norm import RMSNorm
from pagefleet.engine.layers.rotary import interleaved_rope_rows_as_halves
from pagefleet.engine.models.config import Llama4Options, ModelConfig
from pagefleet.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    load_decoder_weights,
)
from pagefleet.engine.models.moe import expert_rows
from pagefleet.engine.models.weights import WeightLoader

# Per step: RoPE's cos and sin, and each token's query scale on the NoPE layers.
Positions = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _options(config: ModelConfig) -> Llama4Options:
    assert config.llama4 is not None, "a Llama 4 config"
    return config.llama4


class Llama4Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        super().__init__(config, shard, layer)
        options = _options(config)
        self.l2_norm_eps = config.norm_eps if options.qk_l2_norm and self.rope else None
        self.chunk = config.layer_chunk(layer)
        self.temperature = options.temperature_tuning and not self.rope

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,
        rope: Positions,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin, query_scale = rope
        if self.rope:
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        if self.l2_norm_eps is not None:
            q, k = _l2_normed(q, self.l2_norm_eps), _l2_normed(k, self.l2_norm_eps)
        if self.temperature:
            q = (q * query_scale).to(q.dtype)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale, self.window, chunk=self.chunk)
        return self.shard.all_reduce(self.o_proj(out.view(num_tokens, self.q_size)))


def _l2_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head's vector over its root mean square, in float32 (no weight)."""
    as_float = x.float()
    return (as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4MoE(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        assert config.moe is not None
        options = config.moe
        self.router = Linear(config.hidden_size, options.num_experts)
        self.experts = RoutedExperts(options.num_experts, config.hidden_size, options.width, shard=shard)
        self.shared_expert = LlamaMLP(config, shard, options.shared_expert_width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        top, experts = torch.topk(self.router(hidden), 1, dim=-1)
        score = torch.sigmoid(top.float()).to(hidden.dtype)
        routed = self.experts(hidden * score, torch.ones_like(score), experts)  # the score scales the input
        return self.shared_expert(hidden) + routed


class Llama4DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        nn.Module.__init__(self)  # not Llama's: its attention and MLP would be built, then dropped
        assert config.moe is not None
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = Llama4Attention(config, shard, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        sparse = config.moe.sparse_layers[layer]
        self.mlp = Llama4MoE(config, shard) if sparse else LlamaMLP(config, shard)  # type: ignore[assignment]


class Llama4ForCausalLM(LlamaForCausalLM):
    layer_class = Llama4DecoderLayer
    compiled_layers_run_this_family = False  # its layers are not Llama's

    def position_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> Positions:
        """RoPE's cos and sin, and the NoPE layers' query scale [num_tokens, 1, 1] (float32)."""
        options = _options(self.config)
        cos, sin = self.rotary.lookup(positions, dtype)
        floors = torch.floor((positions.float() + 1.0) / options.floor_scale)
        scale = torch.log1p(floors) * options.temperature_scale + 1.0
        return cos, sin, scale.view(-1, 1, 1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        renamed = ((name.replace(".feed_forward.", ".mlp."), tensor) for name, tensor in weights)
        rope_order = interleaved_rope_rows_as_halves(self.config.head_dim)
        load_decoder_weights(self, renamed, declare_mlp=self._declare_experts, qk_transform=rope_order)

    def _declare_experts(self, loader: WeightLoader, layer: int) -> bool:
        """A MoE layer's router, this rank's experts (stored `[E, H, 2I]`, gate columns then
        up) and shared expert."""
        assert self.config.moe is not None
        options = self.config.moe
        if not options.sparse_layers[layer]:
            return False
        hf, ours = f"model.layers.{layer}.mlp.", f"layers.{layer}.mlp."
        loader.direct(hf + "router.weight", ours + "router.weight")
        shard, width = self.shard, options.shared_expert_width
        stacked = chain(shard.stacked_experts(options.num_experts), expert_rows)
        loader.direct(hf + "experts.gate_up_proj", ours + "experts.gate_up", stacked)
        loader.direct(hf + "experts.down_proj", ours + "experts.down", stacked)
        start, end = shard.split(width, "intermediate_size")
        part = rows(start, end) if shard.size > 1 else None
        names = [hf + "shared_expert.gate_proj.weight", hf + "shared_expert.up_proj.weight"]
        loader.fused(names, ours + "shared_expert.gate_up_proj.weight", part)
        down_part = columns(start, end) if shard.size > 1 else None
        loader.direct(hf + "shared_expert.down_proj.weight", ours + "shared_expert.down_proj.weight", down_part)
        return True
