"""Gemma 2 and Gemma 3 (text) on a flat token batch, from the Llama family's layers.

What differs from Llama, each as transformers computes it:
- RMSNorm scales by `1 + w`, in float32 before the cast back (`GemmaRMSNorm`);
- every layer has four norms: before and after attention, before and after the MLP;
- the embeddings are multiplied by sqrt(hidden_size), rounded to the weights' dtype first;
- attention is scaled by `query_pre_attn_scalar ** -0.5`; sliding-window and global layers
  interleave by `layer_types`; Gemma 2 soft-caps attention scores and final logits;
  Gemma 3 normalises q and k per head and gives sliding layers their own RoPE base;
- the MLP's activation is GELU with the tanh approximation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagefleet.engine.distributed.shard import Shard
from pagefleet.engine.layers.attention import AttentionBackend, KVCache, LayerMetadata
from pagefleet.engine.layers.fused import gemma_rms_norm
from pagefleet.engine.layers.linear import frozen_parameter
from pagefleet.engine.layers.logits import LogitsHead
from pagefleet.engine.layers.quantized import PackedWeight, QuantizedWeight
from pagefleet.engine.layers.rotary import RotaryEmbedding
from pagefleet.engine.lora.adapter import LoRATarget
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.llama import LlamaAttention, LlamaMLP, decoder_lora_targets, load_decoder_weights

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class GemmaRMSNorm(nn.Module):
    """x normalised and scaled by (1 + w), both in float32, then cast back (the checkpoint
    stores w around 0)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        super().__init__()
        self.sliding = config.layer_window(layer) is not None
        self.self_attn = LlamaAttention(config, shard, layer, norm=GemmaRMSNorm)
        self.mlp = LlamaMLP(config, shard)
        for name in _NORMS:
            setattr(self, name, GemmaRMSNorm(config.hidden_size, config.norm_eps))

    def forward(self, hidden, rope, kv_cache, metadata, backend):  # type: ignore[no-untyped-def]
        attention = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, metadata, backend)
        hidden = hidden + self.post_attention_layernorm(attention)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaHead(nn.Module):
    """What every Gemma has around its layers: the head (tied to the embedding unless the
    config says not), a GGUF's embedding looked up as stored, embeddings scaled by
    sqrt(hidden_size) rounded to the weights' dtype, and logits soft-capped where the
    config says. A family sets `config` and `shard`, then calls `init_head`."""

    config: ModelConfig
    shard: Shard

    def init_head(self) -> None:
        config = self.config
        vocab_start, vocab_end = self.shard.vocab(config.vocab_size)
        self.lm_head = LogitsHead(config.hidden_size, vocab_end - vocab_start, tied=config.tie_word_embeddings)
        self.embed_tokens = (
            self.lm_head.weight if config.tie_word_embeddings else frozen_parameter(*self.lm_head.weight.shape)
        )
        self.quantized_embedding: QuantizedWeight | PackedWeight | None = None  # a GGUF's, looked up as stored

    @property
    def embedding(self) -> torch.Tensor:
        """The token embedding's float weight (the head's, when tied)."""
        return self.embed_tokens

    def scaled_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized_embedding is None:
            hidden = self.shard.embed(input_ids, self.embed_tokens)
        else:
            hidden = self.quantized_embedding.dequantize(input_ids).to(self.lm_head.weight.dtype)
        return hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [n, hidden] -> float32 logits [n, vocab], soft-capped where the model says."""
        logits = self.shard.gather_vocab(self.lm_head(hidden), self.config.vocab_size)
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if logits is not None and cap is not None else logits


class GemmaForCausalLM(GemmaHead):
    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard = shard or Shard()
        positions = config.max_position_embeddings
        self.rotary = RotaryEmbedding(config.head_dim, positions, config.rope_theta, config.rope_scaling)
        self.local_rotary = (
            RotaryEmbedding(config.head_dim, positions, config.local_rope_theta, {})
            if config.local_rope_theta is not None
            else None
        )
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, shard, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.norm_eps)
        self.init_head()

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
        rope = self.rotary.lookup(positions, hidden.dtype)
        local_rope = self.local_rotary.lookup(positions, hidden.dtype) if self.local_rotary is not None else rope
        for layer, kv_cache, layer_metadata in zip(self.layers, kv_caches, metadata, strict=True):
            hidden = layer(hidden, local_rope if layer.sliding else rope, kv_cache, layer_metadata, backend)
        return self.norm(hidden)

    def lora_targets(self) -> dict[str, LoRATarget]:
        return decoder_lora_targets(self.config, self.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_decoder_weights(self, weights, layer_norms=_NORMS)
