"""The Llama family on a flat token batch: Llama, Mistral, SmolLM2, Qwen2 (qkv bias) and
Qwen3 (per-head q/k RMSNorm).

Weights load from the Hugging Face state dict by explicit name; q/k/v and gate/up are
fused into one matmul each, which is where a CPU step spends most of its time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagefleet.engine.distributed.shard import Shard, chain, columns, rows, vocab_rows
from pagefleet.engine.errors import UnsupportedModelError
from pagefleet.engine.layers.attention import AttentionBackend, AttentionMetadata, KVCache, LayerMetadata
from pagefleet.engine.layers.cpu_attention import CpuAttentionBackend, CpuMetadata
from pagefleet.engine.layers.fused import gelu_tanh_and_mul, rotary, silu_and_mul
from pagefleet.engine.layers.linear import Linear, frozen_parameter
from pagefleet.engine.layers.logits import LogitsHead
from pagefleet.engine.layers.norm import RMSNorm
from pagefleet.engine.layers.quantized import PackedWeight, QuantizedWeight
from pagefleet.engine.layers.rotary import RotaryEmbedding
from pagefleet.engine.lora.adapter import LoRATarget
from pagefleet.engine.models.compiled_layers import compile_layers, run_compiled
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.weights import Transform, WeightLoader

# Each fused projection of a decoder layer and the Hugging Face projections it stacks, in
# row order (quantized checkpoints are read by these names: engine/loader/).
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


class LlamaAttention(nn.Module):
    """Column-parallel q/k/v (this rank's heads), row-parallel o_proj (one all-reduce); layer
    `layer`'s window, scale and soft-cap from the config (shared by the families whose
    attention differs only in those and in their q/k norm, `norm`)."""

    def __init__(self, config: ModelConfig, shard: Shard, layer: int = 0, norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.shard = shard
        self.num_heads = config.num_heads // shard.size
        self.num_kv_heads = shard.kv_heads(config.num_heads, config.num_kv_heads)[1]
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        # Added once after the all-reduce (a bias inside o_proj would count once per rank).
        self.o_bias = frozen_parameter(config.hidden_size) if config.o_bias else None
        self.sinks = frozen_parameter(self.num_heads) if config.attention_sinks else None
        self.q_norm = norm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = norm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.scale = config.attention_scale
        self.window = config.layer_window(layer)
        self.softcap = config.attn_softcap
        self.rope = config.layer_uses_rope(layer)
        self.rotary_dim = config.rotary_dim  # None: every dim of a head

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope and self.rotary_dim is None:
            q, k = rotary(q, *rope), rotary(k, *rope)
        elif self.rope:  # the first rotary_dim dims rotated, the rest passed through
            r = self.rotary_dim
            q = torch.cat((rotary(q[..., :r].contiguous(), *rope), q[..., r:]), dim=-1)
            k = torch.cat((rotary(k[..., :r].contiguous(), *rope), k[..., r:]), dim=-1)
        out = backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale, self.window, self.softcap, self.sinks
        )
        out = self.shard.all_reduce(self.o_proj(out.view(num_tokens, self.q_size)))
        return out if self.o_bias is None else out + self.o_bias


# A gated MLP's activation applied to the gate and multiplied by the up projection.
GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


class LlamaMLP(nn.Module):
    """Column-parallel gate/up, row-parallel down (one all-reduce)."""

    def __init__(self, config: ModelConfig, shard: Shard, intermediate_size: int | None = None) -> None:
        super().__init__()
        if config.hidden_act not in GATED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"activation {config.hidden_act!r} is not supported ({', '.join(GATED_ACTIVATIONS)})"
            )
        self.activation = GATED_ACTIVATIONS[config.hidden_act]
        self.shard = shard
        start, end = shard.split(intermediate_size or config.intermediate_size, "intermediate_size")
        self.intermediate_size = end - start
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shard.all_reduce(self.down_proj(self.activation(self.gate_up_proj(hidden))))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, shard, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config, shard)

    def forward(self, hidden, residual, rope, kv_cache, metadata, backend):  # type: ignore[no-untyped-def]
        """hidden: the previous layer's output (to add to `residual`), or the embeddings for
        the first layer (residual None). Returns this layer's output and the residual; each
        residual add is fused with the norm that follows it."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            residual, normed = self.input_layernorm.add_and_norm(residual, hidden)
        attention = self.self_attn(normed, rope, kv_cache, metadata, backend)
        residual, normed = self.post_attention_layernorm.add_and_norm(residual, attention)
        return self.mlp(normed), residual


class LlamaForCausalLM(nn.Module):
    layer_class: type[nn.Module] = LlamaDecoderLayer  # a family built on Llama's may change its layers
    # Whether the compiled loop (models/compiled_layers.py) runs this family's layers: Llama's
    # forward around Llama's attention, with a dense or a sparse MLP it knows.
    compiled_layers_run_this_family = True

    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard = shard or Shard()
        self.rotary = RotaryEmbedding(
            config.rotary_dim or config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(self.layer_class(config, shard, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        vocab_start, vocab_end = shard.vocab(config.vocab_size)
        self.lm_head = LogitsHead(config.hidden_size, vocab_end - vocab_start, tied=config.tie_word_embeddings)
        self.embed_tokens = (
            self.lm_head.weight if config.tie_word_embeddings else frozen_parameter(*self.lm_head.weight.shape)
        )
        self.quantized_embedding: QuantizedWeight | PackedWeight | None = None  # a GGUF's, looked up as stored
        self.compiled: Any | None = False  # the compiled layers (False: not tried yet; None: cannot)

    @property
    def embedding(self) -> torch.Tensor:
        """The token embedding's float weight (the head's, when tied)."""
        return self.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCache,
        metadata: LayerMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        hidden = self.embed(input_ids)
        rope = self.position_inputs(positions, hidden.dtype)
        first = metadata[0]
        one_group = all(m is first for m in metadata)
        compiled = self._compiled_layers(backend) if one_group and isinstance(first, CpuMetadata) else None
        if compiled is not None:
            assert isinstance(first, CpuMetadata)
            hidden, residual = run_compiled(compiled, hidden, rope, kv_caches, first)
        else:
            residual = None
            for layer, kv_cache, layer_metadata in zip(self.layers, kv_caches, metadata, strict=True):
                hidden, residual = layer(hidden, residual, rope, kv_cache, layer_metadata, backend)
        return self.norm.add_and_norm(residual, hidden)[1]

    def position_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """What every layer takes from the step's positions: RoPE's cos and sin."""
        return self.rotary.lookup(positions, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (looked up in a GGUF's quantized table where it has one)."""
        if self.quantized_embedding is None:
            return self.shard.embed(input_ids, self.embed_tokens)
        return self.quantized_embedding.dequantize(input_ids).to(self.norm.weight.dtype)

    def _compiled_layers(self, backend: AttentionBackend) -> Any | None:
        """The layers as one compiled call (models/compiled_layers.py), made at the first step
        on the CPU backend (after the weights are loaded and LoRA, if any, is attached), or
        None where they cannot be; never while an adapter is attached, nor for a family that
        changes Llama's layers (the compiled loop runs Llama's)."""
        first = self.layers[0]
        if not self.compiled_layers_run_this_family or type(first) is not self.layer_class:
            return None
        attention = first.self_attn
        assert isinstance(attention, LlamaAttention)
        if attention.qkv_proj.lora is not None or attention.o_bias is not None or attention.sinks is not None:
            return None  # the compiled loop has no adapters, output bias or sinks
        if self.compiled is False:
            assert isinstance(backend, CpuAttentionBackend)
            self.compiled = compile_layers(self, self.config.sliding_window or 0)
        return self.compiled

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [n, hidden] -> float32 logits [n, vocab] (on rank 0; None on the others)."""
        return self.shard.gather_vocab(self.lm_head(hidden), self.config.vocab_size)

    def lora_targets(self) -> dict[str, LoRATarget]:
        return decoder_lora_targets(self.config, self.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_decoder_weights(self, weights)


def decoder_lora_targets(config: ModelConfig, layers: nn.ModuleList) -> dict[str, LoRATarget]:
    """The checkpoint's q/k/v/o and gate/up/down projections, in our fused ones."""
    targets = {}
    hidden, intermediate = config.hidden_size, config.intermediate_size
    for i, layer in enumerate(layers):
        attn, mlp, hf = layer.self_attn, layer.mlp, f"model.layers.{i}."
        assert isinstance(attn, LlamaAttention)
        q, kv = attn.q_size, attn.kv_size
        for segment, (name, start, end) in enumerate((("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv))):
            targets[hf + f"self_attn.{name}_proj"] = LoRATarget(attn.qkv_proj, segment, 3, start, end)
        targets[hf + "self_attn.o_proj"] = LoRATarget(attn.o_proj, 0, 1, 0, hidden)
        if not isinstance(mlp, LlamaMLP):  # a mixture of experts' layer: adapters reach its attention only
            continue
        targets[hf + "mlp.gate_proj"] = LoRATarget(mlp.gate_up_proj, 0, 2, 0, intermediate)
        targets[hf + "mlp.up_proj"] = LoRATarget(mlp.gate_up_proj, 1, 2, intermediate, 2 * intermediate)
        targets[hf + "mlp.down_proj"] = LoRATarget(mlp.down_proj, 0, 1, 0, hidden)
    return targets


def load_decoder_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    layer_norms: tuple[str, ...] = (),
    declare_mlp: Callable[[WeightLoader, int], bool] | None = None,
    qk_transform: Transform | None = None,
) -> None:
    """A Llama-shaped decoder's weights from the checkpoint's tensors, one at a time (a rank
    keeps only its part of each): the embedding, the final norm, the head unless tied, and
    per layer q/k/v fused, o, the q/k norms, gate/up fused, down and each of `layer_norms`
    (default: the input and post-attention norms). `declare_mlp(loader, layer)` declares a
    layer's feed-forward weights where it returns True (a mixture of experts' layers);
    `qk_transform` reorders the q and k projections' rows (Llama 4's RoPE pairs)."""
    config: ModelConfig = model.config  # type: ignore[assignment]
    shard: Shard = model.shard  # type: ignore[assignment]
    vocab = vocab_rows(*shard.vocab(config.vocab_size)) if shard.size > 1 else None
    head_range = shard.split(config.num_heads, "num_attention_heads")
    q_start, q_end = (config.head_dim * h for h in head_range)
    heads = rows(*head_range) if shard.size > 1 else None  # per-head tensors (gpt-oss's sinks)
    kv_first, kv_count = shard.kv_heads(config.num_heads, config.num_kv_heads)
    kv = rows(kv_first * config.head_dim, (kv_first + kv_count) * config.head_dim)
    qkv: list[Transform | None] | None = [rows(q_start, q_end), kv, kv] if shard.size > 1 else None
    if qk_transform is not None:
        parts = qkv or [None, None, None]
        qkv = [chain(parts[0], qk_transform), chain(parts[1], qk_transform), parts[2]]
    mlp_start, mlp_end = shard.split(config.intermediate_size, "intermediate_size")
    gate_up = rows(mlp_start, mlp_end) if shard.size > 1 else None
    o_cols = columns(q_start, q_end) if shard.size > 1 else None
    down_cols = columns(mlp_start, mlp_end) if shard.size > 1 else None
    loader = WeightLoader(model)
    loader.direct("model.embed_tokens.weight", "embed_tokens", vocab)
    loader.direct("model.norm.weight", "norm.weight")
    if not config.tie_word_embeddings:
        loader.direct("lm_head.weight", "lm_head.weight", vocab)
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = ours + "self_attn."
        loader.fused([hf + f"self_attn.{p}_proj.weight" for p in "qkv"], attn + "qkv_proj.weight", qkv)
        if config.qkv_bias:
            loader.fused([hf + f"self_attn.{p}_proj.bias" for p in "qkv"], attn + "qkv_proj.bias", qkv)
        loader.direct(hf + "self_attn.o_proj.weight", attn + "o_proj.weight", o_cols)
        if config.o_bias:
            loader.direct(hf + "self_attn.o_proj.bias", attn + "o_bias")
        if config.attention_sinks:
            loader.direct(hf + "self_attn.sinks", attn + "sinks", heads)
        if config.qk_norm:
            loader.direct(hf + "self_attn.q_norm.weight", attn + "q_norm.weight")
            loader.direct(hf + "self_attn.k_norm.weight", attn + "k_norm.weight")
        for norm in layer_norms or ("input_layernorm", "post_attention_layernorm"):
            loader.direct(hf + f"{norm}.weight", ours + f"{norm}.weight")
        if declare_mlp is not None and declare_mlp(loader, i):
            continue
        loader.fused(
            [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"], ours + "mlp.gate_up_proj.weight", gate_up
        )
        loader.direct(hf + "mlp.down_proj.weight", ours + "mlp.down_proj.weight", down_cols)
    loader.load(weights, ignore=("rotary_emb.inv_freq",))
