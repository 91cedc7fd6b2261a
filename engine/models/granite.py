"""IBM Granite 3.x (`GraniteForCausalLM`): the Llama architecture with four multipliers, as
transformers applies them: the embeddings times `embedding_multiplier`, attention scaled by
`attention_multiplier` (not head_dim**-0.5; config.py reads it), each attention and MLP
output times `residual_multiplier` before its residual add, and the logits divided by
`logits_scaling`."""

from __future__ import annotations

import torch

from pagefleet.engine.distributed.shard import Shard
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        super().__init__(config, shard, layer)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, hidden, residual, rope, kv_cache, metadata, backend):  # type: ignore[no-untyped-def]
        """As Llama's layer, each output scaled before it joins the residual (the MLP's in
        the next layer's fused add, or the final norm's)."""
        multiplier = self.residual_multiplier
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            residual, normed = self.input_layernorm.add_and_norm(residual, hidden)
        attention = self.self_attn(normed, rope, kv_cache, metadata, backend) * multiplier
        residual, normed = self.post_attention_layernorm.add_and_norm(residual, attention)
        return self.mlp(normed) * multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    layer_class = GraniteDecoderLayer
    compiled_layers_run_this_family = False  # its layers are not Llama's

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return logits / self.config.logits_scaling if logits is not None else None
