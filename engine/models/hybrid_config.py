"""The configs of models with state layers, on Llama's fields: Qwen3-Next and Qwen3.5
(Gated DeltaNet) and Granite 4 (Mamba-2), as transformers reads them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pagefleet.engine.errors import UnsupportedModelError
from pagefleet.engine.models.config import ModelConfig, MoEOptions
from pagefleet.engine.models.linear_attention_config import (
    LEGACY_LAYER_TYPES,
    linear_attention_options,
    mamba2_options,
)

LlamaFields = Callable[[dict[str, Any]], ModelConfig]  # Llama's reading of the config, with fields overridden


def hybrid_config(raw: dict[str, Any], architecture: str, llama: LlamaFields) -> ModelConfig:
    layer_types = tuple(
        LEGACY_LAYER_TYPES.get(t, t) for t in raw.get("layer_types") or raw.get("layers_block_type") or ()
    )
    if architecture == "GraniteMoeHybridForCausalLM":
        return _granite_hybrid(raw, llama({"intermediate_size": raw["shared_intermediate_size"]}), layer_types)
    # Qwen3.5-MoE has no dense MLP (every layer routes): no intermediate_size of its own.
    dense = raw.get("intermediate_size") or raw.get("moe_intermediate_size")
    return replace(
        llama({"intermediate_size": dense}), layer_types=layer_types, linear_attention=linear_attention_options(raw)
    )


def _granite_hybrid(raw: dict[str, Any], config: ModelConfig, layer_types: tuple[str, ...]) -> ModelConfig:
    """Granite 4: Mamba-2 layers between attention ones (RoPE or none), Granite's
    multipliers, routed experts (the top k logits, then a softmax) beside a shared MLP on
    every layer, or the shared MLP alone."""
    if raw.get("attention_bias"):
        raise UnsupportedModelError("Granite 4 with attention_bias=true is not supported")
    num_experts = raw.get("num_local_experts") or 0
    moe = None
    if num_experts:
        moe = MoEOptions(
            num_experts=num_experts,
            experts_per_token=raw["num_experts_per_tok"],
            width=raw["intermediate_size"],
            normalize=False,
            keep_float=False,
            sparse_layers=(True,) * config.num_layers,
            shared_expert_width=raw["shared_intermediate_size"],
            router="top_k_softmax",
        )
    rope = raw.get("position_embedding_type") == "rope"
    return replace(
        config,
        layer_types=layer_types,
        layer_rope=() if rope else (False,) * config.num_layers,
        attn_scale=float(raw.get("attention_multiplier", 1.0)),
        moe=moe,
        linear_attention=mamba2_options(raw),
    )
