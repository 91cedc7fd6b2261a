"""Mixture-of-experts GGUF files: Qwen3-MoE (`qwen3moe`), Qwen2-MoE (`qwen2moe`) and Mixtral
(written by llama.cpp as `llama` with expert tensors).

llama.cpp stores a sparse layer's router as `ffn_gate_inp` [E, H], its experts as three 3-D
tensors `ffn_gate_exps`, `ffn_up_exps` [E, I, H] and `ffn_down_exps` [E, H, I] (one slice
per expert, each tensor in one block format), Qwen2-MoE's shared expert as `ffn_*_shexp`
and its gate as `ffn_gate_inp_shexp` [H]; the sizes as `{arch}.expert_count`,
`expert_used_count`, `expert_feed_forward_length` and `expert_shared_feed_forward_length`.

Conversion (engine/loader/gguf_cache.py): transformers reads Qwen's files but leaves the
experts' widths at its defaults (a size mismatch), so they are set here from the metadata;
it does not know Mixtral's (a `llama` file it would load without experts), whose model is
built here from the metadata and the file's tensors. Either is saved with each expert's
tensors under its own name (`save_checkpoint`), as engine/models/moe.py reads a published
checkpoint. A file whose expert tensors are
missing or misshapen is refused by name before either, rather than loaded with random
experts. Serving (engine/loader/gguf_weights.py): `quantized_experts` reads each expert's
slices as stored (engine/layers/quantized_experts.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagefleet.engine.errors import UnsupportedModelError
from pagefleet.engine.layers.quantized_experts import QuantizedRoutedExperts, expert_rows, gate_up_weight
from pagefleet.engine.loader.gguf_index import GGUFTensors

if TYPE_CHECKING:  # engine/models imports the loaders: a type only
    from pagefleet.engine.models.config import ModelConfig

QWEN_ARCHITECTURES = ("qwen2moe", "qwen3moe")
MIXTRAL_ARCHITECTURE = "llama"  # with `llama.expert_count`
# Built from the metadata in their own modules (engine/loader/gguf_deepseek.py, gguf_gpt_oss.py).
DEEPSEEK_ARCHITECTURE, GPT_OSS_ARCHITECTURE = "deepseek2", "gpt-oss"
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def is_moe_file(metadata: dict[str, Any]) -> bool:
    """Whether a GGUF file (its metadata) holds one of the mixtures of experts served here."""
    architecture = metadata["general.architecture"]
    return architecture in (*QWEN_ARCHITECTURES, DEEPSEEK_ARCHITECTURE, GPT_OSS_ARCHITECTURE) or (
        architecture == MIXTRAL_ARCHITECTURE and int(metadata.get("llama.expert_count") or 0) > 0
    )


@dataclass(frozen=True, slots=True)
class ExpertDims:
    """The sizes a file's expert tensors must have: the layers from `first_sparse` on sparse
    (every one, as llama.cpp runs Qwen's and Mixtral's; DeepSeek's first are dense),
    `num_experts` experts `width` wide, shared experts `shared_width` wide in all (0: none),
    gated by a `ffn_gate_inp_shexp` vector where `shared_gate` (Qwen2-MoE's)."""

    num_layers: int
    hidden_size: int
    num_experts: int
    width: int
    shared_width: int = 0
    first_sparse: int = 0
    shared_gate: bool = True

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], shapes: Callable[[str], tuple[int, ...] | None]) -> ExpertDims:
        """From a file's metadata; an expert width it does not state is read from the shape
        of its first gate tensor (`shapes`: a tensor's GGUF shape by name, or None)."""
        arch = metadata["general.architecture"]
        width = metadata.get(f"{arch}.expert_feed_forward_length")
        if width is None and arch == MIXTRAL_ARCHITECTURE:  # its experts are as wide as the MLP would be
            width = metadata.get(f"{arch}.feed_forward_length")
        if width is None:
            first_gate = shapes("blk.0.ffn_gate_exps.weight")
            width = 0 if first_gate is None else first_gate[1]  # 0: the check names the missing tensor
        shared_width = int(metadata.get(f"{arch}.expert_shared_feed_forward_length") or 0)
        if arch == DEEPSEEK_ARCHITECTURE:  # its shared experts stored as one MLP
            shared_width = int(metadata.get(f"{arch}.expert_shared_count") or 0) * int(width)
        return cls(
            num_layers=int(metadata[f"{arch}.block_count"]),
            hidden_size=int(metadata[f"{arch}.embedding_length"]),
            num_experts=int(metadata[f"{arch}.expert_count"]),
            width=int(width),
            shared_width=shared_width,
            first_sparse=int(metadata.get(f"{arch}.leading_dense_block_count") or 0),
            shared_gate=arch != DEEPSEEK_ARCHITECTURE,
        )

    @classmethod
    def from_config(cls, config: ModelConfig) -> ExpertDims:
        assert config.moe is not None, "a mixture-of-experts config"
        return cls(
            config.num_layers,
            config.hidden_size,
            config.moe.num_experts,
            config.moe.width,
            config.moe.shared_expert_width,
            first_sparse=config.moe.sparse_layers.index(True),
            shared_gate=config.family != "deepseek",
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every expert-related tensor of the file and its shape, in GGUF's order (the
        contiguous dimension first)."""
        hidden, experts, width, shared = self.hidden_size, self.num_experts, self.width, self.shared_width
        shapes: dict[str, tuple[int, ...]] = {}
        for layer in range(self.first_sparse, self.num_layers):
            blk = f"blk.{layer}."
            shapes[blk + "ffn_gate_inp.weight"] = (hidden, experts)
            shapes[blk + "ffn_gate_exps.weight"] = (hidden, width, experts)
            shapes[blk + "ffn_up_exps.weight"] = (hidden, width, experts)
            shapes[blk + "ffn_down_exps.weight"] = (width, hidden, experts)
            if shared and self.shared_gate:
                shapes[blk + "ffn_gate_inp_shexp.weight"] = (hidden,)
            if shared:
                shapes[blk + "ffn_gate_shexp.weight"] = (hidden, shared)
                shapes[blk + "ffn_up_shexp.weight"] = (hidden, shared)
                shapes[blk + "ffn_down_shexp.weight"] = (shared, hidden)
        return shapes


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A GGUF shape without its trailing 1s (ggml pads every shape with them)."""
    dims = list(shape)
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(dims)


def check_expert_tensors(path: Path, dims: ExpertDims, shapes: Callable[[str], tuple[int, ...] | None]) -> None:
    """Refuse a file whose router, experts or shared expert are missing or misshapen.

    Args:
        path: the file, for the message.
        dims: the sizes its metadata (or the model's config) gives.
        shapes: a tensor's GGUF shape by name, or None where the file lacks it.
    Raises:
        UnsupportedModelError: naming the first tensor missing or of another shape."""
    for name, expected in dims.expected_shapes().items():
        found = shapes(name)
        if found is None:
            raise UnsupportedModelError(f"{path.name}: the mixture of experts' tensor {name} is missing")
        if _squeezed(tuple(int(d) for d in found)) != expected:
            raise UnsupportedModelError(
                f"{path.name}: tensor {name} has shape {tuple(found)} (GGUF's order), expected {expected} for "
                f"{dims.num_experts} experts {dims.width} wide on a hidden size of {dims.hidden_size}"
            )


def qwen_config_updates(dims: ExpertDims) -> dict[str, Any]:
    """What transformers' reader leaves at Qwen2MoeConfig's or Qwen3MoeConfig's defaults:
    the experts' widths (llama.cpp runs every layer sparse: the defaults agree)."""
    updates = {"moe_intermediate_size": dims.width}
    if dims.shared_width:  # Qwen2-MoE's
        updates["shared_expert_intermediate_size"] = dims.shared_width
    return updates


def mixtral_config(metadata: dict[str, Any], tensors: dict[str, Any], dims: ExpertDims) -> dict[str, Any]:
    """The MixtralConfig of a `llama` file with experts (`tensors`: gguf's ReaderTensor by
    name), as llama.cpp's converter wrote it from one."""

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"llama.{name}", default)

    heads = int(key("attention.head_count"))
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.width,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("rope.dimension_count", dims.hidden_size // heads)),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 1e6))},
        "num_local_experts": dims.num_experts,
        "num_experts_per_tok": int(key("expert_used_count")),
        "sliding_window": None,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


# A Mixtral layer's parameters (transformers 5's names) and their GGUF tensors.
_MIXTRAL_LAYER = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate.weight": "ffn_gate_inp",
    "mlp.experts.down_proj": "ffn_down_exps",
}


def dequantized(tensor: Any) -> torch.Tensor:
    """A gguf ReaderTensor dequantized to float32, in numpy's order ([out, in])."""
    import gguf

    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True))


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (per head: the two rotary halves interleaved)."""
    return weight.reshape(heads, weight.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def mixtral_state_dict(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """transformers' MixtralForCausalLM parameters from a file's tensors, dequantized to
    float32: q and k rows put back in Hugging Face's order, each layer's gate and up experts
    stacked as `gate_up_proj` [E, 2I, H]."""
    state = {"model.embed_tokens.weight": dequantized(tensors["token_embd.weight"])}
    state["model.norm.weight"] = dequantized(tensors["output_norm.weight"])
    state["lm_head.weight"] = dequantized(tensors.get("output.weight", tensors["token_embd.weight"]))
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for layer in range(config["num_hidden_layers"]):
        blk, ours = f"blk.{layer}.", f"model.layers.{layer}."
        for name, theirs in _MIXTRAL_LAYER.items():
            value = dequantized(tensors[f"{blk}{theirs}.weight"])
            state[ours + name] = _unpermute(value, heads[theirs]) if theirs in heads else value
        gate, up = (dequantized(tensors[f"{blk}{kind}.weight"]) for kind in ("ffn_gate_exps", "ffn_up_exps"))
        state[ours + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    return state


def save_checkpoint(model: Any, directory: Path) -> None:
    """A transformers MoE model (`_load_moe`'s) saved as a Hugging Face checkpoint with each
    expert's gate, up and down under its own name, as the published checkpoints are and
    engine/models/moe.py reads them: transformers keeps its fused `gate_up_proj` and
    `down_proj` after a GGUF load and `save_pretrained` would write them so. Each expert's
    slices are copied (safetensors refuses tensors sharing storage)."""
    from safetensors.torch import save_file

    config = model.config
    mixtral = config.model_type == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = name.replace(".mlp.", ".block_sparse_moe.") if mixtral else name
        prefix, _, kind = name.rpartition(".experts.")
        if kind == "gate_up_proj":  # [E, 2I, H]: per expert its gate rows, then its up rows
            width = tensor.shape[1] // 2
            for e, expert in enumerate(tensor):
                state[f"{prefix}.experts.{e}.{gate}.weight"] = expert[:width].clone()
                state[f"{prefix}.experts.{e}.{up}.weight"] = expert[width:].clone()
        elif kind == "down_proj":  # [E, H, I]
            state |= {f"{prefix}.experts.{e}.{down}.weight": expert.clone() for e, expert in enumerate(tensor)}
        else:
            state[name] = tensor.contiguous()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)


def quantized_experts(
    tensors: GGUFTensors, layer: int, dims: ExpertDims, device: torch.device
) -> QuantizedRoutedExperts | None:
    """Layer `layer`'s experts as the file stores them, or None where one of their tensors
    is of a type the kernels do not read (those experts stay float)."""
    gate, up, down = (tensors.quantized(f"blk.{layer}.{kind}.weight") for kind in EXPERT_TENSORS)
    if gate is None or up is None or down is None:
        return None
    gate, up, down = gate.to(device), up.to(device), down.to(device)
    experts = range(dims.num_experts)
    return QuantizedRoutedExperts(
        [gate_up_weight(expert_rows(gate, e, dims.width), expert_rows(up, e, dims.width)) for e in experts],
        [expert_rows(down, e, dims.hidden_size) for e in experts],
    )
