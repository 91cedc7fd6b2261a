"""DeepSeek-V3 (`deepseek2`) and gpt-oss GGUF files, written here from tiny random models as
llama.cpp's converter lays them out, and served: transformers reads neither, so pagefleet
builds them from the file (engine/loader/gguf_deepseek.py, gguf_gpt_oss.py).

- DeepSeek-V3: MLA as the converter stores it (`head_count_kv` 1, `kv_b_proj` split into
  `attn_k_b`, transposed, and `attn_v_b`; RoPE rows interleaved as in the checkpoint), the
  sigmoid router's correction bias as `exp_probs_b`, YaRN's mscale as a log multiplier. A
  float file generates exactly as transformers on the original checkpoint; a quantized one
  serves its experts, shared experts and projections from the file's blocks.
- gpt-oss: experts de-interleaved into gate and up, with biases, in MXFP4 as ggml-org's
  files have them; sinks; sliding and full layers. With expert weights MXFP4 represents
  exactly, the file generates exactly as transformers on the original checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.errors import UnsupportedModelError
from pagefleet.engine.models.loading import iter_weights
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, hf_greedy, random_prompts
from tests.engine.test_gguf_files import _add_decoder_metadata, _add_tensor, _add_tokenizer, _finish, _served_types
from tests.engine.test_gguf_moe import _assert_serves_the_files_experts

_PROMPT_LENGTHS = [5, 23, 40]


def _add_deepseek_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    """The keys llama.cpp's DeepseekV2Model writes (MLA as multi-query attention)."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    rope = config.rope_parameters
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _deepseek_tensors(model_dir: Path, config: Any) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under llama.cpp's names: `kv_b_proj` split into `attn_k_b`
    ([heads, rank, nope]: each head's key rows transposed) and `attn_v_b`; each layer's
    experts stacked per kind, [E, rows, in]."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, config.num_hidden_layers)
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in iter_weights(model_dir):
        stem, suffix = name.rsplit(".", 1)
        if suffix == "e_score_correction_bias":
            stem, suffix = f"{stem}.e_score_correction", "bias"
        target = name_map.get_name(re.sub(r"\.experts\.\d+\.", ".experts.", stem))
        assert target is not None, f"no llama.cpp name for {name}"
        if stem.endswith("kv_b_proj"):
            per_head = tensor.view(config.num_attention_heads, -1, config.kv_lora_rank)
            keys, values = per_head.split([config.qk_nope_head_dim, config.v_head_dim], dim=1)
            tensors[target.replace("attn_kv_b", "attn_k_b") + ".weight"] = keys.transpose(1, 2).contiguous()
            tensors[target.replace("attn_kv_b", "attn_v_b") + ".weight"] = values.contiguous()
        elif ".experts." in name:
            experts.setdefault(f"{target}.{suffix}", {})[int(name.split(".experts.")[1].split(".")[0])] = tensor
        else:
            tensors[f"{target}.{suffix}"] = tensor
    for target, per_expert in experts.items():
        tensors[target] = torch.stack([per_expert[e] for e in sorted(per_expert)])
    return tensors


def write_deepseek_gguf(model_dir: Path, path: Path, types: dict[str, str]) -> Path:
    """The HF DeepSeek-V3 in `model_dir` as llama.cpp writes it, each tensor kind in the type
    `types` gives (F32 otherwise)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2])
    _add_deepseek_metadata(writer, config)
    _add_tokenizer(writer, model_dir)
    for name, tensor in _deepseek_tensors(model_dir, config).items():
        kind = name.split(".")[-2]
        _add_tensor(writer, name, tensor, gguf.GGMLQuantizationType[types[kind]] if kind in types else None)
    _finish(writer)
    return path


def _add_gpt_oss_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    """The keys llama.cpp's GptOssModel writes."""
    _add_decoder_metadata(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _gpt_oss_experts(blk: str, kind: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A layer's fused expert tensor as the converter splits it: gate_up [E, H, 2I]
    transposed and de-interleaved (gate the even rows), its bias [E, 2I] likewise; down
    [E, I, H] transposed."""
    if kind == "gate_up_proj":
        rows = tensor.transpose(1, 2)
        return {f"{blk}ffn_gate_exps.weight": rows[:, 0::2], f"{blk}ffn_up_exps.weight": rows[:, 1::2]}
    if kind == "gate_up_proj_bias":
        return {f"{blk}ffn_gate_exps.bias": tensor[:, 0::2], f"{blk}ffn_up_exps.bias": tensor[:, 1::2]}
    if kind == "down_proj":
        return {f"{blk}ffn_down_exps.weight": tensor.transpose(1, 2)}
    return {f"{blk}ffn_down_exps.bias": tensor}


def write_gpt_oss_gguf(model_dir: Path, path: Path, types: dict[str, str]) -> Path:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    _add_gpt_oss_metadata(writer, config)
    _add_tokenizer(writer, model_dir)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, config.num_hidden_layers)
    for name, tensor in iter_weights(model_dir):
        parts = {}
        if ".experts." in name:
            parts = _gpt_oss_experts(f"blk.{name.split('.')[2]}.", name.rsplit(".", 1)[1], tensor)
        elif name.endswith("sinks"):
            parts = {f"{name_map.get_name(name)}.weight": tensor}
        else:
            stem, suffix = name.rsplit(".", 1)
            parts = {f"{name_map.get_name(stem)}.{suffix}": tensor}
        for target, value in parts.items():
            kind = target.split(".")[-2]
            quantized = kind in types and target.endswith(".weight")  # biases stay F32
            ggml_type = gguf.GGMLQuantizationType[types[kind]] if quantized else None
            _add_tensor(writer, target, value.contiguous(), ggml_type)
    _finish(writer)
    return path


def _greedy_equals_transformers(path: Path, model_dir: Path, **options: Any) -> LLM:
    """The file, served, generates transformers' greedy tokens on the checkpoint it was
    written from, token for token."""
    llm = LLM(str(path), kv_cache_memory=16 << 20, **options)
    prompts = random_prompts(_PROMPT_LENGTHS, TINY_VOCAB, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        assert output.outputs[0].token_ids == hf_greedy(model_dir, prompt, 10)[0]
    assert_no_block_leaked(llm)
    return llm


@pytest.fixture(scope="module")
def tiny_deepseek(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["deepseek_v3"]


def test_deepseek_float_file_generates_as_transformers_on_its_checkpoint(tiny_deepseek: Path, tmp_path: Path) -> None:
    path = write_deepseek_gguf(tiny_deepseek, tmp_path / "tiny-deepseek-F32.gguf", {})
    llm = _greedy_equals_transformers(path, tiny_deepseek)
    config = llm.engine.parts.model.config
    assert config.architecture == "DeepseekV3ForCausalLM" and config.mla is not None


def test_deepseek_serves_experts_and_projections_from_the_files_blocks(
    tiny_deepseek: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Experts Q8_0 beside Q4_0, the shared expert, the dense layer's MLP and the latent
    projections (the RoPE rows reordered as the float weights are) served as stored."""
    types = {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q4_0"}
    types |= dict.fromkeys(("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate", "ffn_up"), "Q8_0")
    types |= dict.fromkeys(("attn_q_a", "attn_kv_a_mqa", "attn_output", "ffn_down", "attn_k_b"), "Q8_0")
    path = write_deepseek_gguf(tiny_deepseek, tmp_path / "tiny-deepseek-Q8_0.gguf", types)
    quantized = _assert_serves_the_files_experts(path, types, _PROMPT_LENGTHS, monkeypatch)
    served = _served_types(quantized)
    for name in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj", "mlp.gate_up_proj"):
        assert served[f"layers.0.{name}"] == ["Q8_0"], name
    assert served["layers.1.mlp.shared_experts.down_proj"] == ["Q8_0"]
    assert "layers.0.self_attn.q_b_proj" not in served  # 48 columns: no whole block of 32, kept F32


def test_deepseek_v2_files_are_refused(tiny_deepseek: Path, tmp_path: Path) -> None:
    """DeepSeek-V2's files have no sigmoid gating function (softmax routing)."""
    path = write_deepseek_gguf(tiny_deepseek, tmp_path / "tiny-deepseek.gguf", {})
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields["deepseek2.expert_gating_func"]
    field.parts[field.data[0]][...] = gguf.ExpertGatingFuncType.SOFTMAX  # in place, in the memory map
    reader.data.flush()
    with pytest.raises(UnsupportedModelError, match="DeepSeek-V2"):
        LLM(str(path), kv_cache_memory=16 << 20)


def _with_mxfp4_experts(original: Path, model_dir: Path) -> Path:
    """A copy of the checkpoint with each expert weight rounded through MXFP4 along its rows' input
    dimension (as the file's blocks run), so the file holds its values exactly; the
    clamped SwiGLU at gpt-oss's own limit (the file does not store it)."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(original, model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                rows = param.transpose(1, 2).contiguous().numpy()  # [E, out, in]
                exact = gguf.quants.dequantize(gguf.quants.quantize(rows, mxfp4), mxfp4)
                param.copy_(torch.from_numpy(np.array(exact)).transpose(1, 2))
    model.config.swiglu_limit = 7.0
    model.save_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["swiglu_limit"] == 7.0
    return model_dir


def test_gpt_oss_mxfp4_file_generates_as_transformers_on_its_checkpoint(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """Exact where the file holds the checkpoint's values (experts MXFP4-exact, the rest
    F32); with q/k/v/o in Q8_0 those are served as stored, the MXFP4 experts dequantized."""
    model_dir = _with_mxfp4_experts(tiny_models["gpt_oss"], tmp_path / "hf")
    types = {"ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4", "ffn_down_exps": "MXFP4"}
    path = write_gpt_oss_gguf(model_dir, tmp_path / "tiny-gpt-oss-mxfp4.gguf", types)
    llm = _greedy_equals_transformers(path, model_dir)
    assert llm.engine.parts.model.config.architecture == "GptOssForCausalLM"
    types |= dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output"), "Q8_0")
    path = write_gpt_oss_gguf(model_dir, tmp_path / "tiny-gpt-oss-Q8_0.gguf", types)
    served = LLM(str(path), kv_cache_memory=16 << 20)
    assert _served_types(served) == {
        **{f"layers.{i}.self_attn.{p}": ["Q8_0"] for i in range(2) for p in ("qkv_proj", "o_proj")}
    }
    assert served.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
