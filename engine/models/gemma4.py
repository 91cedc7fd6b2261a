"""Gemma 4 (text) on a flat token batch.

What differs from Gemma 3, each as transformers computes it (`Gemma4TextModel`):
- norms scale by w (not 1 + w) after `x * pow(mean(x^2) + eps, -0.5)` in float32; values
  are normed too, without a weight; attention is unscaled (q and k are normed);
- global layers have a head size and KV heads of their own (512 and fewer heads in the
  released models); with `attention_k_eq_v` they have no value projection: the values are
  the keys before their norm and RoPE; their RoPE is "proportional" (a quarter of the
  angles turn);
- the last `num_kv_shared_layers` layers compute no keys or values: each attends over the
  cache of the last earlier layer of its type, and has no cache of its own
  (engine/core/kv_groups.py); with `use_double_wide_mlp` their MLPs are twice as wide;
- per-layer embeddings: a second table gives each layer a small input of its own, mixed
  with a projection of the token embeddings, which gates a residual branch after the MLP;
- each layer's output is scaled by a learned scalar;
- with `enable_moe_block` (26B-A4B), routed experts run beside each layer's MLP; with
  tensor parallelism each rank holds an equal share of them (engine/layers/experts.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.distributed.shard import Shard, Transform, chain, columns, rows, vocab_rows
from pagefleet.engine.layers.attention import AttentionBackend, KVCache, LayerMetadata
from pagefleet.engine.layers.experts import ExpertActivation, RoutedExperts, softmax_top_k
from pagefleet.engine.layers.fused import rotary
from pagefleet.engine.layers.linear import Linear, frozen_parameter
from pagefleet.engine.layers.quantized import QuantizedWeight
from pagefleet.engine.layers.rotary import RotaryEmbedding
from pagefleet.engine.lora.adapter import LoRATarget
from pagefleet.engine.models.config import Gemma4Options, ModelConfig
from pagefleet.engine.models.gemma import GemmaHead
from pagefleet.engine.models.llama import LlamaMLP
from pagefleet.engine.models.weights import WeightLoader

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
# The routed experts' norms: of the MLP's output, of the experts' output, of their input.
_EXPERT_NORMS = ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")
SharedKV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # a step's keys and values, by the layer that made them


class Gemma4RMSNorm(nn.Module):
    """x * pow(mean(x^2) + eps, -0.5), times w where the norm has one, in float32, then cast
    back (transformers uses pow, not rsqrt, to agree with JAX)."""

    def __init__(self, size: int, eps: float, scaled: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False) if scaled else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.pow(wide.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            normed = normed * self.weight.float()
        return normed.to(x.dtype)


def _options(config: ModelConfig) -> Gemma4Options:
    assert config.gemma4 is not None, "a Gemma 4 config"
    return config.gemma4


class Gemma4Attention(nn.Module):
    """q (and, unless the layer reads another's KV, k and v) in one column-parallel matmul,
    each normed per head; row-parallel o_proj."""

    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        super().__init__()
        self.shard, self.layer, self.source = shard, layer, config.kv_source(layer)
        kv_heads, self.head_dim = config.layer_kv_shape(layer)
        self.num_heads = config.num_heads // shard.size
        self.num_kv_heads = shard.kv_heads(config.num_heads, kv_heads)[1]
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.window = config.layer_window(layer)
        self.keys_are_values = _options(config).attention_k_eq_v and self.window is None
        self.num_projections = 1 if self.source != layer else 2 if self.keys_are_values else 3
        out = self.q_size + (self.num_projections - 1) * self.kv_size
        self.qkv_proj = Linear(config.hidden_size, out, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.norm_eps)
        self.k_norm = Gemma4RMSNorm(self.head_dim, config.norm_eps) if self.source == layer else None
        self.v_norm = Gemma4RMSNorm(self.head_dim, config.norm_eps, scaled=False)
        self.scale, self.softcap = config.attention_scale, config.attn_softcap

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: object,
        backend: AttentionBackend,
        shared: SharedKV,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q = rotary(self.q_norm(qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)), *rope)
        if self.k_norm is None:  # a KV-shared layer: its source wrote these keys this step
            k, v = shared[self.source]
        else:
            kv_shape = (num_tokens, self.num_kv_heads, self.head_dim)
            raw_k = qkv[:, self.q_size : self.q_size + self.kv_size].view(kv_shape)
            raw_v = raw_k if self.keys_are_values else qkv[:, self.q_size + self.kv_size :].view(kv_shape)
            k, v = rotary(self.k_norm(raw_k), *rope), self.v_norm(raw_v)
            shared[self.layer] = k, v
        # A KV-shared layer writes its source's keys again into the same slots (the cache
        # is its source's): the backends' one path, at the cost of one small copy.
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale, self.window, self.softcap)  # type: ignore[arg-type]
        return self.shard.all_reduce(self.o_proj(out.view(num_tokens, self.q_size)))


class Gemma4Experts(nn.Module):
    """The routed experts beside the MLP (each tensor-parallel rank holds its share; the
    router and the per-expert scales are whole on every rank): the router reads the normed
    residual, keeps the top k, renormalises them and scales each by its expert's learned
    scale; each expert is a GELU-gated MLP."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        options = _options(config)
        hidden, experts = config.hidden_size, options.num_experts
        self.top_k = options.top_k_experts
        self.router_norm = Gemma4RMSNorm(hidden, config.norm_eps, scaled=False)
        self.router = Linear(hidden, experts)
        self.router_scale = frozen_parameter(hidden)
        self.per_expert_scale = frozen_parameter(experts)
        width, activation = options.moe_intermediate_size, ExpertActivation("gelu_tanh")
        self.routed = RoutedExperts(experts, hidden, width, activation, shard=shard)
        self.root_size = hidden**-0.5

    def forward(self, residual: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """residual routes, `hidden` (residual normed for the experts) is computed."""
        scores = self.router(self.router_norm(residual) * self.router_scale * self.root_size)
        weights, experts = softmax_top_k(scores, self.top_k, normalize=True, keep_float=True)
        return self.routed(hidden, weights * self.per_expert_scale[experts], experts)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        super().__init__()
        options = _options(config)
        hidden, eps, width = config.hidden_size, config.norm_eps, options.per_layer_input_size
        self.sliding = config.layer_window(layer) is not None
        self.self_attn = Gemma4Attention(config, shard, layer)
        wide = 2 if options.double_wide_mlp and config.kv_source(layer) != layer else 1
        self.mlp = LlamaMLP(config, shard, wide * config.intermediate_size)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.per_layer_input_gate = Linear(hidden, width) if width else None
        self.per_layer_projection = Linear(width, hidden) if width else None
        self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps) if width else None
        self.experts = Gemma4Experts(config, shard) if options.num_experts else None
        expert_norms = [Gemma4RMSNorm(hidden, eps) for _ in _EXPERT_NORMS] if self.experts is not None else []
        self.expert_norms = nn.ModuleDict(dict(zip(_EXPERT_NORMS, expert_norms, strict=False)))

    def forward(  # type: ignore[no-untyped-def]
        self, hidden, per_layer_input, rope, kv_cache, metadata, backend, shared: SharedKV
    ) -> torch.Tensor:
        attention = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, metadata, backend, shared)
        hidden = hidden + self.post_attention_layernorm(attention)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.experts is not None:
            norms = self.expert_norms
            routed = self.experts(hidden, norms["pre_feedforward_layernorm_2"](hidden))
            mlp = norms["post_feedforward_layernorm_1"](mlp) + norms["post_feedforward_layernorm_2"](routed)
        hidden = hidden + self.post_feedforward_layernorm(mlp)
        if self.per_layer_input_gate is not None:
            assert self.per_layer_projection is not None and self.post_per_layer_input_norm is not None
            gate = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return hidden * self.layer_scalar


class Gemma4ForCausalLM(GemmaHead):
    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard = shard or Shard()
        options = _options(config)
        positions, windows = config.max_position_embeddings, config.layer_windows
        global_layer = next((i for i, window in enumerate(windows) if window is None), 0)
        global_head_dim = config.layer_kv_shape(global_layer)[1]
        self.rotary = RotaryEmbedding(global_head_dim, positions, config.rope_theta, config.rope_scaling)
        self.local_rotary = RotaryEmbedding(config.head_dim, positions, config.local_rope_theta or 10000.0, {})
        self.decoder_layers = [Gemma4DecoderLayer(config, shard, i) for i in range(config.num_layers)]
        self.layers = nn.ModuleList(self.decoder_layers)
        self.norm = Gemma4RMSNorm(config.hidden_size, config.norm_eps)
        self.init_head()
        self.quantized_per_layer_embedding: QuantizedWeight | None = None  # the same, of the per-layer table
        width = options.per_layer_input_size
        if width:
            self.embed_tokens_per_layer = frozen_parameter(options.per_layer_vocab_size, config.num_layers * width)
            self.per_layer_model_projection = Linear(config.hidden_size, config.num_layers * width)
            self.per_layer_projection_norm = Gemma4RMSNorm(width, config.norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCache,
        metadata: LayerMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        hidden = self.scaled_embeddings(input_ids)
        per_layer = self._per_layer_inputs(input_ids, hidden)
        rope = self.rotary.lookup(positions, hidden.dtype)
        local_rope = self.local_rotary.lookup(positions, hidden.dtype)
        shared: SharedKV = {}
        for i, (layer, kv_cache, layer_metadata) in enumerate(zip(self.layers, kv_caches, metadata, strict=True)):
            layer_input = per_layer[:, i] if per_layer is not None else None
            layer_rope = local_rope if layer.sliding else rope
            hidden = layer(hidden, layer_input, layer_rope, kv_cache, layer_metadata, backend, shared)
        return self.norm(hidden)

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor | None:
        """[num_tokens, num_layers, width]: each layer's own embedding of the token, mixed
        with a normed projection of the token embeddings; None without them."""
        width = _options(self.config).per_layer_input_size
        if not width:
            return None
        dtype = embeddings.dtype
        if self.quantized_per_layer_embedding is None:
            own = F.embedding(input_ids, self.embed_tokens_per_layer)
        else:
            own = self.quantized_per_layer_embedding.dequantize(input_ids).to(dtype)
        own = own * torch.tensor(width**0.5, dtype=dtype)
        projected = self.per_layer_model_projection(embeddings) * self.config.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(-1, self.config.num_layers, width))
        return (projected + own.view(projected.shape)) * 2**-0.5

    def lora_targets(self) -> dict[str, LoRATarget]:
        """The checkpoint's q/k/v/o and gate/up/down projections, in our fused ones."""
        targets = {}
        for i, layer in enumerate(self.decoder_layers):
            attn, mlp, hf = layer.self_attn, layer.mlp, f"model.layers.{i}."
            q, kv = attn.q_size, attn.kv_size
            parts = (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv))[: attn.num_projections]
            for segment, (name, start, end) in enumerate(parts):
                proj = LoRATarget(attn.qkv_proj, segment, attn.num_projections, start, end)
                targets[hf + f"self_attn.{name}_proj"] = proj
            targets[hf + "self_attn.o_proj"] = LoRATarget(attn.o_proj, 0, 1, 0, self.config.hidden_size)
            width = mlp.intermediate_size
            targets[hf + "mlp.gate_proj"] = LoRATarget(mlp.gate_up_proj, 0, 2, 0, width)
            targets[hf + "mlp.up_proj"] = LoRATarget(mlp.gate_up_proj, 1, 2, width, 2 * width)
            targets[hf + "mlp.down_proj"] = LoRATarget(mlp.down_proj, 0, 1, 0, self.config.hidden_size)
        return targets

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        config, shard = self.config, self.shard
        loader = WeightLoader(self)
        vocab = vocab_rows(*shard.vocab(config.vocab_size)) if shard.size > 1 else None
        loader.direct("model.embed_tokens.weight", "embed_tokens", vocab)
        loader.direct("model.norm.weight", "norm.weight")
        if not config.tie_word_embeddings:
            loader.direct("lm_head.weight", "lm_head.weight", vocab)
        if _options(config).per_layer_input_size:
            for name in ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm"):
                loader.direct(f"model.{name}.weight", name if name.startswith("embed") else f"{name}.weight")
        ignored: list[str] = []
        for i, layer in enumerate(self.decoder_layers):
            ignored += _declare_attention(loader, config, shard, i, layer.self_attn)
            _declare_layer(loader, shard, i, layer)
        loader.load(weights, ignore=tuple(ignored) + ("rotary_emb.inv_freq",))


def _declare_attention(
    loader: WeightLoader, config: ModelConfig, shard: Shard, i: int, attn: Gemma4Attention
) -> list[str]:
    """Where layer i's attention weights go (a rank's heads of each); returns the names a
    checkpoint may hold that this layer does not use (a KV-shared layer's k/v, as
    transformers ignores them)."""
    hf, ours, split = f"model.layers.{i}.self_attn.", f"layers.{i}.self_attn.", shard.size > 1
    q_start, q_end = (attn.head_dim * h for h in shard.split(config.num_heads, "num_attention_heads"))
    kv_first = shard.kv_heads(config.num_heads, config.layer_kv_shape(i)[0])[0] * attn.head_dim
    kv = rows(kv_first, kv_first + attn.kv_size)
    names = ("q", "k", "v")[: attn.num_projections]
    qkv_rows: list[Transform | None] | None = [rows(q_start, q_end), kv, kv][: len(names)] if split else None
    loader.fused([hf + f"{p}_proj.weight" for p in names], ours + "qkv_proj.weight", qkv_rows)
    if config.qkv_bias:
        loader.fused([hf + f"{p}_proj.bias" for p in names], ours + "qkv_proj.bias", qkv_rows)
    loader.direct(hf + "o_proj.weight", ours + "o_proj.weight", columns(q_start, q_end) if split else None)
    loader.direct(hf + "q_norm.weight", ours + "q_norm.weight")
    if attn.k_norm is None:
        return [hf + name for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight")]
    loader.direct(hf + "k_norm.weight", ours + "k_norm.weight")
    return []


def _declare_layer(loader: WeightLoader, shard: Shard, i: int, layer: Gemma4DecoderLayer) -> None:
    """Where the rest of layer i's weights go: the MLP (a rank's part), the norms, the layer
    scalar, the per-layer input branch and the experts."""
    hf, ours, split = f"model.layers.{i}.", f"layers.{i}.", shard.size > 1
    mlp_start, mlp_end = shard.split(layer.mlp.intermediate_size * shard.size, "intermediate_size")
    gate_up = rows(mlp_start, mlp_end) if split else None
    loader.fused([hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"], ours + "mlp.gate_up_proj.weight", gate_up)
    down_columns = columns(mlp_start, mlp_end) if split else None
    loader.direct(hf + "mlp.down_proj.weight", ours + "mlp.down_proj.weight", down_columns)
    for norm in _NORMS:
        loader.direct(hf + f"{norm}.weight", ours + f"{norm}.weight")
    for norm in layer.expert_norms:
        loader.direct(hf + f"{norm}.weight", ours + f"expert_norms.{norm}.weight")
    loader.direct(hf + "layer_scalar", ours + "layer_scalar")
    if layer.per_layer_input_gate is not None:
        for name in ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm"):
            loader.direct(hf + f"{name}.weight", ours + f"{name}.weight")
    if layer.experts is not None:
        for theirs, mine in (
            ("router.proj.weight", "router.weight"),
            ("router.scale", "router_scale"),
            ("router.per_expert_scale", "per_expert_scale"),
        ):
            loader.direct(hf + theirs, ours + f"experts.{mine}")
        # The checkpoint's [experts, rows, columns], this rank's experts, as our rows.
        stacked = chain(shard.stacked_experts(layer.experts.routed.num_experts), _rows_of_every_expert)
        loader.direct(hf + "experts.gate_up_proj", ours + "experts.routed.gate_up", stacked)
        loader.direct(hf + "experts.down_proj", ours + "experts.routed.down", stacked)


def _rows_of_every_expert(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1])
