"""A GGUF file's quantized tensors, put in a loaded model's linear layers as they are stored.

The model is first loaded as always, from the float32 directory the file was converted to
(engine/loader/gguf_cache.py: config, tokenizer, norms, biases); then each linear layer
whose GGUF tensors are of types the operator reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K: all of a Q4_K_M or Q5_K_M file's) takes them and frees its float weight; a fused
layer whose parts differ in type (a Q4_K_M file's v in Q6_K beside q and k in Q4_K) runs
each run of one type on its own. Any other type (F16, Q2_K, Q3_K, the IQ formats, ...)
stays dequantized, and the log says which.

Served so: the Llama family, Gemma 2/3/4 and Phi-3 (llama.cpp's names of our fused layers'
parts; Phi-3's q/k/v and gate/up stored fused, as `attn_qkv` and `ffn_up`), GPT-2, and the
mixtures of experts Qwen3-MoE, Qwen2-MoE and Mixtral: each expert's gate, up and down
slices of the stacked `ffn_*_exps` tensors multiplied as stored (engine/loader/gguf_moe.py,
engine/layers/quantized_experts.py), Qwen2-MoE's shared expert as an MLP; the routers
(`ffn_gate_inp`, F32 in llama.cpp's files) stay float.
llama.cpp's converter permutes q and k rows for its rotary layout in "llama"-architecture
files only (Gemma and Phi-3 rotate NEOX-style, as Hugging Face does); the rows are put back
in Hugging Face's order here, blocks untouched (a block lies within one row), exactly where
transformers' loader puts back its dequantized ones. The head is served as stored too, and
so is the embedding lookup, from the same blocks where they are tied (and Gemma 4's
per-layer embedding table).
The file is read by engine/loader/gguf_index.py.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pagefleet.engine.layers.experts import RoutedExperts
from pagefleet.engine.layers.linear import Linear
from pagefleet.engine.layers.quantized import GGML_NAMES, PackedWeight, QuantizedWeight, StackedWeight
from pagefleet.engine.layers.rotary import interleaved_rope_rows_as_halves
from pagefleet.engine.loader.gguf_index import GGUFTensors
from pagefleet.engine.loader.gguf_moe import EXPERT_TENSORS, ExpertDims, check_expert_tensors, quantized_experts
from pagefleet.engine.models.config import MLAOptions, ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Source:
    """One GGUF tensor feeding a linear layer: its name, and for llama.cpp's permuted q/k
    the number of heads whose rows to put back in order."""

    name: str
    permuted_heads: int | None = None
    row_order: torch.Tensor | None = None  # the file's row each row of ours is (DeepSeek's RoPE rows)


# llama.cpp's names of the Hugging Face projections.
_GGUF_PROJECTIONS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# llama.cpp's names of our fused layers where a file stores them fused (Phi-3's qkv_proj and
# gate_up_proj, gate rows first: `ffn_up` then holds both, and there is no `ffn_gate`).
_GGUF_FUSED = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# The GGUF architectures whose q/k rows llama.cpp permutes (transformers' LlamaTensorProcessor).
_PERMUTED_ARCHITECTURES = ("llama",)


def _decoder_sources(config: ModelConfig, tensors: GGUFTensors) -> dict[str, list[_Source]]:
    """Our fused linear layers (module paths) and the GGUF tensors they stack, in order: a
    layer's parts where the file has the first of them, else the file's fused tensor."""
    from pagefleet.engine.models.llama import FUSED_PROJECTIONS  # here: models imports this module

    permuted = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}
    if tensors.architecture not in _PERMUTED_ARCHITECTURES:
        permuted = {}
    sources = {}
    for i in range(config.num_layers):
        for ours, parts in FUSED_PROJECTIONS.items():
            names = [f"blk.{i}.{_GGUF_PROJECTIONS[p]}.weight" for p in parts]
            if ours in _GGUF_FUSED and not tensors.has(names[0]):
                sources[f"layers.{i}.{ours}"] = [_Source(f"blk.{i}.{_GGUF_FUSED[ours]}.weight")]
            else:
                sources[f"layers.{i}.{ours}"] = [_Source(n, permuted.get(p)) for n, p in zip(names, parts, strict=True)]
    return sources


def _gemma4_sources(config: ModelConfig) -> dict[str, list[_Source]]:
    """Gemma 4's layers: q/k/v as the layer has them (a KV-shared layer q alone; a global
    layer whose keys are its values q and k), o, gate/up and down."""
    assert config.gemma4 is not None
    sources = {}
    for i in range(config.num_layers):
        blk, ours = f"blk.{i}.", f"layers.{i}."
        keys_are_values = config.gemma4.attention_k_eq_v and config.layer_window(i) is None
        projections = 1 if config.kv_source(i) != i else 2 if keys_are_values else 3
        sources[ours + "self_attn.qkv_proj"] = [_Source(blk + f"attn_{p}.weight") for p in "qkv"[:projections]]
        sources[ours + "self_attn.o_proj"] = [_Source(blk + "attn_output.weight")]
        sources[ours + "mlp.gate_up_proj"] = [_Source(blk + "ffn_gate.weight"), _Source(blk + "ffn_up.weight")]
        sources[ours + "mlp.down_proj"] = [_Source(blk + "ffn_down.weight")]
    return sources


def _moe_sources(config: ModelConfig, tensors: GGUFTensors) -> dict[str, list[_Source]]:
    """A mixture of experts' attention as Llama's; on a sparse layer, in place of the MLP,
    Qwen2-MoE's shared expert (the routed experts are served by `_serve_experts`)."""
    assert config.moe is not None
    sources = _decoder_sources(config, tensors)
    for i, sparse in enumerate(config.moe.sparse_layers):
        if not sparse:
            continue
        blk, ours = f"blk.{i}.", f"layers.{i}.mlp."
        del sources[ours + "gate_up_proj"], sources[ours + "down_proj"]
        if config.moe.shared_expert_width:
            shared = [_Source(blk + "ffn_gate_shexp.weight"), _Source(blk + "ffn_up_shexp.weight")]
            sources[ours + "shared_expert.gate_up_proj"] = shared
            sources[ours + "shared_expert.down_proj"] = [_Source(blk + "ffn_down_shexp.weight")]
    return sources


def _deepseek_sources(config: ModelConfig) -> dict[str, list[_Source]]:
    """DeepSeek-V3's linear layers: the latent attention's projections (the rows feeding
    RoPE in the order engine/models/deepseek.py loads them), dense layers' MLPs and sparse
    layers' shared experts (the routed experts are served by `_serve_experts`)."""
    assert config.mla is not None and config.moe is not None
    mla = config.mla
    qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    query_rows = _rope_rows(mla, config.num_heads * qk_head_dim, qk_head_dim, mla.qk_nope_head_dim)
    latent_rows = _rope_rows(mla, mla.kv_lora_rank + mla.qk_rope_head_dim, None, mla.kv_lora_rank)
    sources = {}
    for i, sparse in enumerate(config.moe.sparse_layers):
        blk, attention, mlp = f"blk.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        if mla.q_lora_rank:
            sources[attention + "q_a_proj"] = [_Source(blk + "attn_q_a.weight")]
            sources[attention + "q_b_proj"] = [_Source(blk + "attn_q_b.weight", row_order=query_rows)]
        else:
            sources[attention + "q_proj"] = [_Source(blk + "attn_q.weight", row_order=query_rows)]
        sources[attention + "kv_a_proj_with_mqa"] = [_Source(blk + "attn_kv_a_mqa.weight", row_order=latent_rows)]
        sources[attention + "o_proj"] = [_Source(blk + "attn_output.weight")]
        mlp, suffix = (mlp + "shared_experts.", "_shexp") if sparse else (mlp, "")
        if not sparse or config.moe.shared_expert_width:
            gate_up = [_Source(f"{blk}ffn_{kind}{suffix}.weight") for kind in ("gate", "up")]
            sources[mlp + "gate_up_proj"] = gate_up
            sources[mlp + "down_proj"] = [_Source(f"{blk}ffn_down{suffix}.weight")]
    return sources


def _rope_rows(mla: MLAOptions, rows: int, head_size: int | None, kept: int) -> torch.Tensor | None:
    """The file's row for each of ours where DeepSeek's interleaved RoPE rows are reordered
    at load (heads of `head_size` rows, or one head of all): the order the float weights get."""
    if not mla.rope_interleave:
        return None
    return interleaved_rope_rows_as_halves(head_size or rows, kept)(torch.arange(rows))


def _gpt2_sources(config: ModelConfig) -> dict[str, list[_Source]]:
    """GPT-2's linear layers and their GGUF tensors (llama.cpp stores Conv1D's weights
    transposed, [out, in] as our layers are, and q/k/v fused as c_attn is)."""
    sources = {}
    for i in range(config.num_layers):
        blk, ours = f"blk.{i}.", f"h.{i}."
        sources[ours + "qkv"] = [_Source(blk + "attn_qkv.weight")]
        sources[ours + "o"] = [_Source(blk + "attn_output.weight")]
        sources[ours + "fc"] = [_Source(blk + "ffn_up.weight")]
        sources[ours + "proj"] = [_Source(blk + "ffn_down.weight")]
    return sources


def _unpermute_rows(weight: QuantizedWeight, heads: int) -> QuantizedWeight:
    """Undo llama.cpp's q/k row order (per head: the two rotary halves interleaved)."""
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return weight.select_rows(order)


def _fused_weight(
    linear: Linear,
    parts: list[QuantizedWeight | None],
    sources: list[_Source],
    tensors: GGUFTensors,
    kept: Counter[str],
    dequantized: Counter[str],
) -> QuantizedWeight | StackedWeight:
    """One layer's weight from its sources' tensors: consecutive parts of one type fused; a
    part of another type runs on its own, and a part the kernels do not read keeps its rows
    of the loaded float weight."""
    blocks: list[QuantizedWeight | torch.Tensor] = []
    first_row = 0
    for part, source in zip(parts, sources, strict=True):
        rows = tensors.rows(source.name)
        if part is None:
            blocks.append(linear.weight.data[first_row : first_row + rows].clone())
            dequantized[tensors.type_name(source.name)] += 1
        else:
            part = _unpermute_rows(part, source.permuted_heads) if source.permuted_heads else part
            part = part.select_rows(source.row_order) if source.row_order is not None else part
            part = part.to(linear.weight.device)
            last = blocks[-1] if blocks else None
            if isinstance(last, QuantizedWeight) and last.ggml_type == part.ggml_type:
                blocks[-1] = QuantizedWeight.cat([last, part])
            else:
                blocks.append(part)
            kept[GGML_NAMES[part.ggml_type]] += 1
        first_row += rows
    first = blocks[0]
    return first if len(blocks) == 1 and isinstance(first, QuantizedWeight) else StackedWeight(tuple(blocks))


# Our families whose GGUF files are served as stored (any other is served dequantized).
_SERVED_FAMILIES = ("llama", "gemma", "gemma4", "phi3", "gpt2", "moe", "deepseek")


@dataclass(slots=True)
class _Tally:
    """What a load kept as stored and what not, for its log line."""

    kept: Counter[str] = field(default_factory=Counter)
    dequantized: Counter[str] = field(default_factory=Counter)
    float_bytes: int = 0
    quantized_bytes: int = 0

    def serve(self, linear: Linear, weight: QuantizedWeight | StackedWeight) -> None:
        self.float_bytes += linear.weight.numel() * linear.weight.element_size()
        linear.quantize(weight)
        self.quantized_bytes += weight.nbytes


def quantize_from_gguf(model: nn.Module, config: ModelConfig, path: Path) -> None:
    """Put the GGUF file's quantized tensors in `model` (a single-rank model of a family in
    `_SERVED_FAMILIES`, weights loaded, on the CPU or CUDA); logs what was kept quantized
    and what not."""
    if config.family not in _SERVED_FAMILIES:
        logger.info("GGUF: %s weights are served dequantized (no quantized path yet)", config.architecture)
        return
    tensors = GGUFTensors(path)
    modules = dict(model.named_modules())
    tally = _Tally()
    if config.family == "gpt2":
        layer_sources = _gpt2_sources(config)
    elif config.family == "gemma4":
        layer_sources = _gemma4_sources(config)
    elif config.family in ("moe", "deepseek"):
        check_expert_tensors(path, ExpertDims.from_config(config), tensors.shape)
        layer_sources = _moe_sources(config, tensors) if config.family == "moe" else _deepseek_sources(config)
        _serve_experts(model, config, tensors, tally)
    else:
        layer_sources = _decoder_sources(config, tensors)
    for module_name, sources in layer_sources.items():
        linear = modules[module_name]
        assert isinstance(linear, Linear)
        parts = [tensors.quantized(source.name) for source in sources]
        if all(part is None for part in parts):
            tally.dequantized.update(tensors.type_name(source.name) for source in sources)
            continue
        tally.serve(linear, _fused_weight(linear, parts, sources, tensors, tally.kept, tally.dequantized))
    _serve_head_and_embedding(model, config, tensors, tally)
    if config.family == "gemma4":
        _serve_per_layer_embedding(model, tensors, tally)
    logger.info(
        "GGUF %s: served as stored: %s; dequantized: %s (linear weights %.0f MiB, %.0f MiB in float)",
        path.name,
        ", ".join(f"{n} x{c}" for n, c in sorted(tally.kept.items())) or "none",
        ", ".join(f"{n} x{c}" for n, c in sorted(tally.dequantized.items())) or "none",
        tally.quantized_bytes / 2**20,
        tally.float_bytes / 2**20,
    )


def _serve_experts(model: nn.Module, config: ModelConfig, tensors: GGUFTensors, tally: _Tally) -> None:
    """Each sparse layer's routed experts multiplied from the file's slices as stored, in
    place of the float ones; a layer whose expert tensors are of a type the kernels do not
    read keeps its float experts."""
    assert config.moe is not None
    dims = ExpertDims.from_config(config)
    for layer, sparse in enumerate(config.moe.sparse_layers):
        if not sparse:
            continue
        block = model.get_submodule(f"layers.{layer}.mlp")
        names = [f"blk.{layer}.{kind}.weight" for kind in EXPERT_TENSORS]
        float_experts = block.experts
        assert isinstance(float_experts, RoutedExperts)
        # gpt-oss's experts (biases, clamped SwiGLU) stay float; its files store them in MXFP4.
        has_bias = float_experts.gate_up_bias is not None
        served = None if has_bias else quantized_experts(tensors, layer, dims, float_experts.gate_up.device)
        if served is None:
            tally.dequantized.update(tensors.type_name(name) for name in names)
            continue
        tally.float_bytes += sum(p.numel() * p.element_size() for p in float_experts.parameters())
        tally.quantized_bytes += served.nbytes
        tally.kept.update(tensors.type_name(name) for name in names)
        block.experts = served


def _serve_per_layer_embedding(model: nn.Module, tensors: GGUFTensors, tally: _Tally) -> None:
    """Gemma 4's per-layer embedding table (a third of E2B's weights) looked up as stored."""
    table = tensors.quantized("per_layer_token_embd.weight")
    float_table = getattr(model, "embed_tokens_per_layer", None)
    if table is None or not isinstance(float_table, torch.Tensor):
        return
    model.quantized_per_layer_embedding = table.to(float_table.device)  # type: ignore[assignment]
    tally.float_bytes += float_table.numel() * float_table.element_size()
    tally.quantized_bytes += table.nbytes
    tally.kept[GGML_NAMES[table.ggml_type]] += 1
    float_table.data = torch.empty(0, dtype=float_table.dtype)


def _serve_head_and_embedding(model: nn.Module, config: ModelConfig, tensors: GGUFTensors, tally: _Tally) -> None:
    """The output head (token_embd when tied) as stored, and the embedding lookup from the
    same blocks (`quantized_embedding`)."""
    head_name = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    head = tensors.quantized(head_name)
    lm_head = model.get_submodule("lm_head")
    assert isinstance(lm_head, Linear)
    if head is None:
        tally.dequantized[tensors.type_name(head_name)] += 1
    else:
        tally.serve(lm_head, head.to(lm_head.weight.device))
        tally.kept[GGML_NAMES[head.ggml_type]] += 1
    if config.tie_word_embeddings:  # the head's own weight, in its kernel's layout: the rows held once
        embedding = lm_head.quantized
    else:
        untied = tensors.quantized("token_embd.weight")
        embedding = None if untied is None else untied.to(lm_head.weight.device)
    if embedding is not None:
        assert isinstance(embedding, QuantizedWeight | PackedWeight)
        model.quantized_embedding = embedding  # type: ignore[assignment]
        float_embedding = model.embedding
        assert isinstance(float_embedding, torch.Tensor)
        float_embedding.data = torch.empty(0, dtype=float_embedding.dtype)
