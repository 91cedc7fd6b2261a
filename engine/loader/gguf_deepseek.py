"""DeepSeek-V3 GGUF files (llama.cpp's `deepseek2` architecture; Kimi K2's too).

transformers does not read these files, so the model is built here from the metadata and
the tensors, as llama.cpp's converter derived them from a `DeepseekV3ForCausalLM`:

- latent attention: the converter stores MLA as multi-query attention (`head_count_kv` 1,
  `key_length` = kv_lora_rank + rope dims) and keeps the per-head sizes as
  `key_length_mla`/`value_length_mla`; it splits `kv_b_proj` into `attn_k_b` (each head's
  key rows, transposed: [heads, kv_lora_rank, nope]) and `attn_v_b` ([heads, v, rank]),
  which are put back together here (files written before that split have `attn_kv_b`);
- RoPE rows stay interleaved as in the checkpoint (llama.cpp rotates pairs for this
  architecture), so the config keeps `rope_interleave`;
- YaRN's `mscale_all_dim` is stored as `rope.scaling.yarn_log_multiplier` (0.1 times it);
  `mscale` is not stored, and every released checkpoint has the two equal;
- routing: `expert_gating_func` 2 (sigmoid) with `exp_probs_b` (the correction bias),
  `expert_group_count`/`expert_group_used_count`, `expert_weights_scale` and
  `expert_weights_norm`; the first `leading_dense_block_count` layers are dense. A file
  without the sigmoid gating function is DeepSeek-V2's (softmax routing), not served.
"""

from __future__ import annotations

from typing import Any

import torch

from pagefleet.engine.errors import UnsupportedModelError
from pagefleet.engine.loader.gguf_moe import dequantized

ARCHITECTURE = "deepseek2"
_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def deepseek_config(metadata: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The HF config (DeepseekV3Config's fields) of a `deepseek2` file with these metadata
    values and tensors (`gguf_config.read_gguf`).

    Raises:
        UnsupportedModelError: a DeepSeek-V2 file (softmax routing)."""

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{ARCHITECTURE}.{name}", default)

    if key("expert_gating_func") != _SIGMOID_GATING:
        raise UnsupportedModelError(
            "a deepseek2 GGUF file without sigmoid expert gating is DeepSeek-V2's (softmax routing), which is "
            "not served; DeepSeek-V3 and Kimi K2 files are"
        )
    rope_dims = int(key("rope.dimension_count"))
    qk_head_dim = int(key("attention.key_length_mla") or key("attention.key_length"))
    heads = int(key("attention.head_count"))
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),  # GGUF's shapes: contiguous dimension first
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,  # MLA's heads; the file's 1 is its multi-query layout
        "q_lora_rank": int(key("attention.q_lora_rank")) if key("attention.q_lora_rank") else None,
        "kv_lora_rank": int(key("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dims,
        "qk_nope_head_dim": qk_head_dim - rope_dims,
        "v_head_dim": int(key("attention.value_length_mla") or key("attention.value_length")),
        "head_dim": rope_dims,
        "rope_interleave": True,
        "n_routed_experts": int(key("expert_count")),
        "num_experts_per_tok": int(key("expert_used_count")),
        "n_shared_experts": int(key("expert_shared_count", 0)),
        "n_group": int(key("expert_group_count", 1) or 1),
        "topk_group": int(key("expert_group_used_count", 1) or 1),
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "first_k_dense_replace": int(key("leading_dense_block_count", 0)),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": _rope_parameters(key),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


def _rope_parameters(key: Any) -> dict[str, Any]:
    """transformers' `rope_parameters` from the file's RoPE keys (YaRN or none)."""
    theta = float(key("rope.freq_base", 10000.0))
    if key("rope.scaling.type") != "yarn":
        return {"rope_type": "default", "rope_theta": theta}
    mscale = float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    parameters = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(key("rope.scaling.factor")),
        "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }
    for name in ("beta_fast", "beta_slow"):
        if key(f"rope.scaling.yarn_{name}") is not None:
            parameters[name] = float(key(f"rope.scaling.yarn_{name}"))
    return parameters


# A layer's parameters (transformers' names, under `model.layers.N.`) and their GGUF tensors.
_ATTENTION = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
}
_DENSE_MLP = {f"mlp.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")}
_SPARSE_MLP = {f"mlp.shared_experts.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")}
_SPARSE_MLP |= {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}


def deepseek_state_dict(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """DeepseekV3ForCausalLM's parameters from a file's tensors, dequantized to float32:
    `kv_b_proj` rebuilt from `attn_k_b` and `attn_v_b`, each layer's gate and up experts
    stacked as `gate_up_proj` [E, 2I, H]."""
    state = {"model.embed_tokens.weight": dequantized(tensors["token_embd.weight"])}
    state["model.norm.weight"] = dequantized(tensors["output_norm.weight"])
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = dequantized(tensors["output.weight"])
    for layer in range(config["num_hidden_layers"]):
        blk, ours = f"blk.{layer}.", f"model.layers.{layer}."
        names = _ATTENTION | (_DENSE_MLP if layer < config["first_k_dense_replace"] else _SPARSE_MLP)
        state |= {
            ours + name: dequantized(tensors[blk + theirs]) for name, theirs in names.items() if blk + theirs in tensors
        }
        state[ours + "self_attn.kv_b_proj.weight"] = _kv_b_proj(tensors, blk, config)
        if layer >= config["first_k_dense_replace"]:
            gate, up = (dequantized(tensors[f"{blk}{kind}.weight"]) for kind in ("ffn_gate_exps", "ffn_up_exps"))
            state[ours + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    return state


def _kv_b_proj(tensors: dict[str, Any], blk: str, config: dict[str, Any]) -> torch.Tensor:
    """[heads * (nope + v), kv_lora_rank]: per head its key rows, then its value rows."""
    if blk + "attn_kv_b.weight" in tensors:
        return dequantized(tensors[blk + "attn_kv_b.weight"])
    keys = dequantized(tensors[blk + "attn_k_b.weight"]).transpose(1, 2)  # [heads, nope, rank]
    values = dequantized(tensors[blk + "attn_v_b.weight"])  # [heads, v, rank]
    return torch.cat([keys, values], dim=1).reshape(-1, config["kv_lora_rank"])
