"""A Gemma 4 GGUF file's config and the tensors transformers' GGUF reader does not map.

transformers reads a GGUF file's config from a fixed table of scalar keys, and llama.cpp's
Gemma 4 converter writes per-layer arrays (the feed-forward width with double-wide MLPs,
the KV heads where global layers have fewer): transformers refuses those files. So the
config is built here from the file's metadata, as the converter derived it from
`Gemma4TextConfig` (engine/loader/gguf_cache.py passes it to transformers), and the tensors
transformers leaves unread (the layer scalars, the routed experts and their router's
scales) are read here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

ARCHITECTURE = "gemma4"
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _array(tensor: Any) -> np.ndarray:
    """A tensor's values as float32, in the checkpoint's dimension order."""
    import gguf

    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def gemma4_config(metadata: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The HF config (Gemma4TextConfig's fields) of a file with these metadata values and
    tensors (`gguf_config.read_gguf`)."""

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{ARCHITECTURE}.{name}", default)

    num_layers = int(key("block_count"))
    sliding = [bool(s) for s in key("attention.sliding_window_pattern")]
    layer_types = [_SLIDING if s else _FULL for s in sliding]
    feed_forward = _per_layer(key("feed_forward_length"), num_layers)
    kv_heads = _per_layer(key("attention.head_count_kv"), num_layers)
    global_layer = sliding.index(False)
    global_head_dim, head_dim = int(key("attention.key_length")), int(key("attention.key_length_swa"))
    experts = int(key("expert_count", 0) or 0)
    config: dict[str, Any] = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),  # GGUF's shapes: contiguous dimension first
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": min(feed_forward),
        "num_hidden_layers": num_layers,
        "num_attention_heads": int(key("attention.head_count")),
        "num_key_value_heads": kv_heads[sliding.index(True)] if True in sliding else kv_heads[0],
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "num_global_key_value_heads": kv_heads[global_layer],
        # Global layers with no value projection take their values from the keys.
        "attention_k_eq_v": f"blk.{global_layer}.attn_v.weight" not in tensors,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": layer_types,
        "num_kv_shared_layers": int(key("attention.shared_kv_layers", 0) or 0),
        "hidden_size_per_layer_input": int(key("embedding_length_per_layer_input", 0) or 0),
        "use_double_wide_mlp": len(set(feed_forward)) > 1,
        "final_logit_softcapping": key("final_logit_softcapping"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_parameters": _rope_parameters(metadata, tensors.get("rope_freqs.weight"), global_head_dim),
        "enable_moe_block": experts > 0,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        # The end of a turn ends generation too, where the file names it.
        "eos_token_id": [m for k in ("eos", "eot") if (m := metadata.get(f"tokenizer.ggml.{k}_token_id")) is not None]
        or None,
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    if "per_layer_token_embd.weight" in tensors:
        config["vocab_size_per_layer_input"] = int(tensors["per_layer_token_embd.weight"].shape[-1])
    if experts:
        config |= {
            "num_experts": experts,
            "top_k_experts": int(key("expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length")),
        }
    return config


def _rope_parameters(metadata: dict[str, Any], rope_freqs: Any, global_head_dim: int) -> dict[str, Any]:
    """Both layer types' RoPE: the global layers' proportional where the file has
    `rope_freqs` (the converter marks the angles that stay still with 1e30)."""
    full: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(metadata.get(f"{ARCHITECTURE}.rope.freq_base", 1e6)),
    }
    if rope_freqs is not None:
        turning = int(np.count_nonzero(_array(rope_freqs) == 1.0))
        full |= {"rope_type": "proportional", "partial_rotary_factor": 2 * turning / global_head_dim}
    sliding_theta = float(metadata.get(f"{ARCHITECTURE}.rope.freq_base_swa", 10_000.0))
    return {_FULL: full, _SLIDING: {"rope_type": "default", "rope_theta": sliding_theta}}


def _per_layer(value: Any, num_layers: int) -> list[int]:
    """A metadata value given once for every layer, or per layer."""
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * num_layers
    return [int(v) for v in values]


# Per layer: the checkpoint's name and the GGUF tensor transformers' reader does not map.
_UNMAPPED = {
    "layer_scalar": "layer_output_scale.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}


def gemma4_unmapped_tensors(tensors: dict[str, Any], num_layers: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (HF names) the file holds under names transformers' reader
    does not know, as float32."""
    found = {}
    for layer in range(num_layers):
        for ours, theirs in _UNMAPPED.items():
            tensor = tensors.get(f"blk.{layer}.{theirs}")
            if tensor is not None:
                found[f"model.layers.{layer}.{ours}"] = torch.from_numpy(np.array(_array(tensor), copy=True))
    return found
