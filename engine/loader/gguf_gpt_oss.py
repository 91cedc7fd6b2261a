"""gpt-oss GGUF files (llama.cpp's `gpt-oss` architecture), as ggml-org publishes them.

transformers' GGUF reader expects other tensor names than llama.cpp's converter writes, so
the model is built here from the metadata and tensors, as the converter derived them from
a `GptOssForCausalLM`:

- each layer's experts as three 3-D tensors `ffn_gate_exps`, `ffn_up_exps` [E, I, H] and
  `ffn_down_exps` [E, H, I] (numpy's order), gate and up split out of the checkpoint's
  interleaved `gate_up_proj` [E, H, 2I], each with its bias (`.bias`, [E, I] and [E, H]);
  in MXFP4 in the published files (dequantized here, as gpt-oss's own MXFP4 checkpoints
  are: engine/loader/mxfp4.py);
- the router `ffn_gate_inp` with its bias, the sinks `attn_sinks`, q/k/v/o with biases,
  RoPE rows in Hugging Face's order (no permutation for this architecture);
- sliding layers (`attention.sliding_window`) alternate with full ones, the first sliding,
  as in every released config; YaRN from `rope.scaling.*`. Two settings the file does not
  store are the released checkpoints' (and llama.cpp's own constants): the clamped SwiGLU's
  limit 7.0 and YaRN without truncation.
"""

from __future__ import annotations

from typing import Any

import torch

from pagefleet.engine.loader.gguf_moe import dequantized

ARCHITECTURE = "gpt-oss"
_SLIDING, _FULL = "sliding_attention", "full_attention"


def gpt_oss_config(metadata: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The HF config (GptOssConfig's fields) of a `gpt-oss` file with these metadata values
    and tensors (`gguf_config.read_gguf`)."""

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{ARCHITECTURE}.{name}", default)

    num_layers = int(key("block_count"))
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),  # GGUF's shapes: contiguous dimension first
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("expert_feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": int(key("attention.head_count")),
        "num_key_value_heads": int(key("attention.head_count_kv")),
        "head_dim": int(key("attention.key_length")),
        "attention_bias": True,
        "num_local_experts": int(key("expert_count")),
        "num_experts_per_tok": int(key("expert_used_count")),
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": [_SLIDING if layer % 2 == 0 else _FULL for layer in range(num_layers)],
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": _rope_parameters(key),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


def _rope_parameters(key: Any) -> dict[str, Any]:
    theta = float(key("rope.freq_base", 150000.0))
    if key("rope.scaling.type") != "yarn":
        return {"rope_type": "default", "rope_theta": theta}
    parameters = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(key("rope.scaling.factor")),
        "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
        "truncate": False,
    }
    for name in ("beta_fast", "beta_slow"):
        if key(f"rope.scaling.yarn_{name}") is not None:
            parameters[name] = float(key(f"rope.scaling.yarn_{name}"))
    return parameters


# A layer's parameters (transformers' names, under `model.layers.N.`) and their GGUF tensors.
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
}
for _ours, _theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")):
    _LAYER |= {f"self_attn.{_ours}_proj.{kind}": f"attn_{_theirs}.{kind}" for kind in ("weight", "bias")}


def gpt_oss_state_dict(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """GptOssForCausalLM's parameters from a file's tensors, dequantized to float32: each
    layer's gate and up experts (and biases) interleaved again as `gate_up_proj` [E, H, 2I],
    the down experts transposed back to [E, I, H]."""
    state = {"model.embed_tokens.weight": dequantized(tensors["token_embd.weight"])}
    state["model.norm.weight"] = dequantized(tensors["output_norm.weight"])
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = dequantized(tensors["output.weight"])
    for layer in range(config["num_hidden_layers"]):
        blk, ours = f"blk.{layer}.", f"model.layers.{layer}.mlp.experts."
        state |= {f"model.layers.{layer}.{name}": dequantized(tensors[blk + theirs]) for name, theirs in _LAYER.items()}
        gate, up = (dequantized(tensors[f"{blk}{kind}.weight"]) for kind in ("ffn_gate_exps", "ffn_up_exps"))
        state[ours + "gate_up_proj"] = _interleaved(gate, up).transpose(1, 2).contiguous()
        gate_bias, up_bias = (dequantized(tensors[f"{blk}{kind}.bias"]) for kind in ("ffn_gate_exps", "ffn_up_exps"))
        state[ours + "gate_up_proj_bias"] = _interleaved(gate_bias, up_bias)
        state[ours + "down_proj"] = dequantized(tensors[blk + "ffn_down_exps.weight"]).transpose(1, 2).contiguous()
        state[ours + "down_proj_bias"] = dequantized(tensors[blk + "ffn_down_exps.bias"])
    return state


def _interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[E, I, ...] gate and up -> [E, 2I, ...] with gate row i at 2i and up row i at 2i + 1."""
    return torch.stack((gate, up), dim=2).reshape(gate.shape[0], -1, *gate.shape[2:])
