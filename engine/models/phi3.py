"""Microsoft Phi-3 and Phi-4 (`Phi3ForCausalLM`): the Llama architecture with q/k/v stored
as one `qkv_proj` and gate/up as one `gate_up_proj`, a sliding window on every layer where
the config sets one, and RoPE on part of each head (`partial_rotary_factor`, Phi-4-mini).
The fused tensors are split into Llama's names as they are read, so loading (and a
tensor-parallel rank's share of each) is Llama's. LongRoPE (`rope_type: longrope`) is
Llama's rotary table with a second set of rows (engine/layers/rotary.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.llama import LlamaForCausalLM, load_decoder_weights

Weights = Iterable[tuple[str, torch.Tensor]]


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Weights) -> None:
        load_decoder_weights(self, _as_llama_names(weights, self.config))


def _as_llama_names(weights: Weights, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, each fused projection split into Llama's parts."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for name, tensor in weights:
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            for part, piece in zip("qkv", tensor.split([q, kv, kv]), strict=True):
                yield f"{prefix}{part}_proj.weight", piece
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2)
            yield prefix + "gate_proj.weight", gate
            yield prefix + "up_proj.weight", up
        else:
            yield name, tensor
