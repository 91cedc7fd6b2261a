"""What the models with state layers share around their decoder layers (Qwen3-Next and
Qwen3.5 in qwen3_next.py, Granite 4 in granite_hybrid.py): one rank, the embedding (times
Granite's multiplier, 1 elsewhere), RoPE's table, the layers in order, the final norm and
the head (its logits divided by Granite's scaling). Each layer takes its cache and metadata:
a KV cache group's for attention layers, a state-cache pair and the step's StateMetadata for
state layers (engine/worker/model_runner.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.distributed.shard import Shard
from pagefleet.engine.errors import UnsupportedModelError
from pagefleet.engine.layers.attention import AttentionBackend, KVCache, LayerMetadata
from pagefleet.engine.layers.linear import frozen_parameter
from pagefleet.engine.layers.logits import LogitsHead
from pagefleet.engine.layers.rotary import RotaryEmbedding
from pagefleet.engine.lora.adapter import LoRATarget
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.weights import WeightLoader


class HybridForCausalLM(nn.Module):
    layer_class: Any  # (config, shard, layer index) -> the family's decoder layer
    norm_class: Any  # (size, eps) -> the family's RMSNorm

    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard = shard or Shard()
        if shard.size > 1:
            raise UnsupportedModelError("models with state layers run with tensor_parallel_size=1")
        self.rotary = RotaryEmbedding(
            config.rotary_dim or config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(self.layer_class(config, shard, i) for i in range(config.num_layers))
        self.norm = self.norm_class(config.hidden_size, config.norm_eps)
        self.lm_head = LogitsHead(config.hidden_size, config.vocab_size, tied=config.tie_word_embeddings)
        self.embed_tokens = (
            self.lm_head.weight if config.tie_word_embeddings else frozen_parameter(*self.lm_head.weight.shape)
        )

    @property
    def embedding(self) -> torch.Tensor:
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
        hidden = F.embedding(input_ids, self.embed_tokens) * self.config.embedding_multiplier
        rope = self.rotary.lookup(positions, hidden.dtype)
        for layer, cache, layer_metadata in zip(self.layers, kv_caches, metadata, strict=True):
            hidden = layer(hidden, rope, cache, layer_metadata, backend)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden) / self.config.logits_scaling

    def lora_targets(self) -> dict[str, LoRATarget]:
        return {}

    def common_weights(self) -> WeightLoader:
        """A loader with the embedding, the final norm, the head and every layer's two norms
        declared (the family declares the rest)."""
        loader = WeightLoader(self)
        loader.direct("model.embed_tokens.weight", "embed_tokens")
        loader.direct("model.norm.weight", "norm.weight")
        if not self.config.tie_word_embeddings:
            loader.direct("lm_head.weight", "lm_head.weight")
        for i in range(self.config.num_layers):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                loader.direct(f"model.layers.{i}.{norm}.weight", f"layers.{i}.{norm}.weight")
        return loader
