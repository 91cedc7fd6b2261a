"""GGUF files written here from tiny random models, as llama.cpp's converter lays them out,
are served from their blocks as stored and generate as their dequantized float models do:
GPT-2 (Conv1D weights stored [out, in], q/k/v fused; Q4_1, or the K formats Q4_K, Q5_K and
Q6_K on a model 256 wide, as a Q4_K_M file mixes them), a Llama whose fused layers mix
types (q/k Q4_1 with v F16; gate Q4_1 with up Q8_0), Gemma 3 and Gemma 2 (norms stored plus
one, q/k not permuted, a tied head; sliding and global layers) and Phi-3 (q/k/v and gate/up
stored fused, an untied head); the last three also as transformers generates on that float
model."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.layers.linear import Linear
from pagefleet.engine.layers.quantized import PackedWeight, QuantizedWeight, StackedWeight
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.loading import iter_weights
from tests.conftest import TINY_VOCAB, build_random_model
from tests.engine.helpers import assert_no_block_leaked, hf_greedy, random_prompts
from tests.kernels.test_quantized import random_blocks

_LAYER_TENSORS = {  # HF's GPT-2 names -> llama.cpp's
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# The K formats of the wide GPT-2's projections (random blocks: the gguf package cannot
# quantize to them), which the engine must keep as stored.
_K_QUANT_TYPES = {"attn.c_attn": "Q4_K", "attn.c_proj": "Q5_K", "mlp.c_fc": "Q4_K", "mlp.c_proj": "Q6_K"}
_POSITIONS = 1024


def _add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    """The tiny models' byte-level BPE tokenizer, as llama.cpp stores a "gpt2" tokenizer."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    special = {token["content"] for token in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tokenizer["model"]["vocab"]["<|endoftext|>"])


def _add_tensor(
    writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, ggml_type: gguf.GGMLQuantizationType | None = None
) -> None:
    array = tensor.float().numpy()
    if ggml_type in (None, gguf.GGMLQuantizationType.F32):
        writer.add_tensor(name, array)
    elif ggml_type == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, ggml_type), raw_dtype=ggml_type)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gpt2_gguf(model_dir: Path, path: Path, k_quant_projections: bool = False) -> Path:
    """The HF GPT-2 in `model_dir` as a GGUF file: projections Q4_1 (or random blocks of the
    K formats, which the float model then reads dequantized too), the (tied) embedding Q8_0,
    norms, biases and positions float32; the byte-level BPE tokenizer with it."""
    config = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "gpt2")
    # transformers reads context_length as n_ctx and leaves n_positions at GPT-2's 1024: the
    # position table is padded to that (rows past the tiny model's 512 are never read).
    writer.add_context_length(_POSITIONS)
    writer.add_embedding_length(config["n_embd"])
    writer.add_feed_forward_length(4 * config["n_embd"])
    writer.add_block_count(config["n_layer"])
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    _add_tokenizer(writer, model_dir)
    add = functools.partial(_add_tensor, writer)

    for name, tensor in iter_weights(model_dir):
        parts = name.split(".")
        if name == "transformer.wte.weight":
            add("token_embd.weight", tensor, gguf.GGMLQuantizationType.Q8_0)
        elif name == "transformer.wpe.weight":
            add("position_embd.weight", torch.nn.functional.pad(tensor, (0, 0, 0, _POSITIONS - tensor.shape[0])))
        elif name.startswith("transformer.ln_f."):
            add(f"output_norm.{parts[-1]}", tensor)
        elif name.startswith("transformer.h.") and not name.endswith((".attn.bias", ".attn.masked_bias")):
            layer, module = parts[2], ".".join(parts[3:-1])
            target = f"blk.{layer}.{_LAYER_TENSORS[module]}.{parts[-1]}"
            if module in _CONV1D and parts[-1] == "weight" and k_quant_projections:
                out_features, in_features = tensor.T.shape
                ggml_type = gguf.GGMLQuantizationType[_K_QUANT_TYPES[module]]
                blocks = random_blocks(out_features, in_features, ggml_type, torch.Generator().manual_seed(len(target)))
                writer.add_tensor(target, blocks, raw_dtype=ggml_type)
            elif module in _CONV1D and parts[-1] == "weight":
                add(target, tensor.T.contiguous(), gguf.GGMLQuantizationType.Q4_1)  # [out, in]
            else:
                add(target, tensor)
    _finish(writer)
    return path


def write_mixed_llama_gguf(model_dir: Path, path: Path, uniform: str | None = None) -> Path:
    """The HF Llama in `model_dir` as llama.cpp writes it (q and k rows permuted for its
    rotary layout), its layers mixing types: q/k Q4_1 and v F16 (a type the kernels do not
    read), gate Q4_1 and up Q8_0, o and down Q4_1, the tied embedding Q8_0; or, with
    `uniform` (a GGML type's name), every projection in that type."""
    config = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    _add_tokenizer(writer, model_dir)
    q4_1, q8_0, f16 = (gguf.GGMLQuantizationType[t] for t in ("Q4_1", "Q8_0", "F16"))
    names = {  # HF -> (llama.cpp, type)
        "self_attn.q_proj": ("attn_q", q4_1),
        "self_attn.k_proj": ("attn_k", q4_1),
        "self_attn.v_proj": ("attn_v", f16),
        "self_attn.o_proj": ("attn_output", q4_1),
        "mlp.gate_proj": ("ffn_gate", q4_1),
        "mlp.up_proj": ("ffn_up", q8_0),
        "mlp.down_proj": ("ffn_down", q4_1),
        "input_layernorm": ("attn_norm", None),
        "post_attention_layernorm": ("ffn_norm", None),
    }
    if uniform is not None:
        names = {
            hf: (target, t if t is None else gguf.GGMLQuantizationType[uniform]) for hf, (target, t) in names.items()
        }

    def permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:  # llama.cpp's q/k row order
        return weight.reshape(num_heads, 2, -1, weight.shape[1]).transpose(1, 2).reshape(weight.shape)

    for name, tensor in iter_weights(model_dir):
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            _add_tensor(writer, "token_embd.weight", tensor, q8_0)
        elif name == "model.norm.weight":
            _add_tensor(writer, "output_norm.weight", tensor)
        elif name.startswith("model.layers."):
            layer, module = parts[2], ".".join(parts[3:-1])
            target, ggml_type = names[module]
            if module == "self_attn.q_proj":
                tensor = permute(tensor, heads)
            elif module == "self_attn.k_proj":
                tensor = permute(tensor, kv_heads)
            _add_tensor(writer, f"blk.{layer}.{target}.weight", tensor, ggml_type)
    _finish(writer)
    return path


def _add_decoder_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    """The keys llama.cpp's converter writes for every Llama-shaped decoder."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def _add_decoder_tensors(
    writer: gguf.GGUFWriter, model_dir: Path, arch: gguf.MODEL_ARCH, types: dict[str, str], norm_shift: float = 0.0
) -> None:
    """The checkpoint's tensors under llama.cpp's names (gguf's own map, which its converter
    and transformers' reader use): a tensor in the type `types` gives for its kind (`attn_q`,
    `ffn_up`, `output`, ...), float32 otherwise; every norm weight plus `norm_shift`. No q/k
    row is permuted: llama.cpp does that for its "llama" architecture only."""
    config = json.loads((model_dir / "config.json").read_text())
    name_map = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    for name, tensor in iter_weights(model_dir):
        stem, suffix = name.rsplit(".", 1)
        target = name_map.get_name(stem)
        assert target is not None, f"no llama.cpp name for {name}"
        kind = target.rsplit(".", 1)[-1]
        if kind.endswith("norm"):
            tensor = tensor + norm_shift
        ggml_type = gguf.GGMLQuantizationType[types[kind]] if kind in types else None
        _add_tensor(writer, f"{target}.{suffix}", tensor, ggml_type)


# Gemma's types: fused q/k/v and gate/up each of two runs, the tied head Q8_0.
_GEMMA_TYPES = {
    **dict.fromkeys(("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_down"), "Q4_1"),
    **dict.fromkeys(("attn_v", "ffn_up", "token_embd"), "Q8_0"),
}
# Phi-3's: its fused attn_qkv and ffn_up (gate rows, then up) one type each; an untied head.
_PHI3_TYPES = {"attn_qkv": "Q4_1", "attn_output": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_1"}
_PHI3_TYPES |= {"output": "Q4_1", "token_embd": "Q8_0"}


def write_gemma_gguf(model_dir: Path, path: Path) -> Path:
    """The HF Gemma 2 or Gemma 3 (text) in `model_dir` as llama.cpp's Gemma2Model and
    Gemma3Model converters write it: every norm weight plus one (Gemma scales by 1 + w;
    transformers subtracts it again), q/k as they are (NEOX rotary), no `output` (tied), head
    dims and the window in the metadata. The layer pattern (Gemma 2 alternating, Gemma 3
    five sliding layers then a global one) and Gemma 3's sliding RoPE base are fixed in
    llama.cpp and transformers alike, so the file does not hold them."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    arch = gguf.MODEL_ARCH.GEMMA3 if config.model_type == "gemma3_text" else gguf.MODEL_ARCH.GEMMA2
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _add_decoder_metadata(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if arch == gguf.MODEL_ARCH.GEMMA3:
        full_rope = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full_rope["rope_theta"])
        if full_rope["rope_type"] == "linear":  # Gemma 3 4B and larger: their global layers' scaling
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full_rope["factor"])
    else:  # read by llama.cpp, not by transformers (which keeps Gemma 2's defaults)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)
    _add_tokenizer(writer, model_dir)
    _add_decoder_tensors(writer, model_dir, arch, _GEMMA_TYPES, norm_shift=1.0)
    _finish(writer)
    return path


def write_phi3_gguf(model_dir: Path, path: Path) -> Path:
    """The HF Phi-3 in `model_dir` as llama.cpp's Phi3MiniModel converter writes it: q/k/v in
    one `attn_qkv`, gate and up in one `ffn_up`, q/k as they are (NEOX rotary), an `output`;
    LongRoPE's factors as the tensors `rope_factors_long`/`short`, its pretraining length and
    attention factor as metadata."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "phi3")
    _add_decoder_metadata(writer, config)
    writer.add_rope_dimension_count(int(config.rope_parameters.get("partial_rotary_factor", 1.0) * head_dim))
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    if rope["rope_type"] == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    _add_tokenizer(writer, model_dir)
    # Phi-3's files name a padding token; without one transformers keeps Phi3Config's 32000,
    # past this vocabulary (an error building the embedding).
    writer.add_pad_token_id(json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]["<|endoftext|>"])
    _add_decoder_tensors(writer, model_dir, gguf.MODEL_ARCH.PHI3, _PHI3_TYPES)
    _finish(writer)
    return path


def write_gemma4_gguf(model_dir: Path, path: Path, types: dict[str, str] | None = None) -> Path:
    """The HF Gemma 4 in `model_dir` as llama.cpp's Gemma4Model converter writes it (float32,
    as `--outtype f32`, but for each tensor kind `types` names): norms as they are; the
    global layers' head size as `key_length`, the sliding ones' as `key_length_swa`;
    per-layer arrays for the KV heads and, with double-wide MLPs, the feed-forward width;
    the layer pattern, the KV-shared layers and the per-layer embeddings' width;
    proportional RoPE as `rope_freqs` (1 for the angles that turn, 1e30 for the rest); the
    layer scalars as `layer_output_scale`, the router's scale and per-expert scales as
    `.scale` tensors of `ffn_gate_inp` and `ffn_down_exps`."""
    raw = json.loads((model_dir / "config.json").read_text())
    config = ModelConfig.from_dir(model_dir)
    assert config.gemma4 is not None
    num_layers, windows = config.num_layers, config.layer_windows
    sliding = [window is not None for window in windows]
    global_kv_heads, global_head_dim = config.layer_kv_shape(sliding.index(False))
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(num_layers)
    writer.add_head_count(config.num_heads)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    first_shared = num_layers - raw["num_kv_shared_layers"]
    wide = [2 if config.gemma4.double_wide_mlp and i >= first_shared else 1 for i in range(num_layers)]
    writer.add_feed_forward_length([config.intermediate_size * w for w in wide])
    writer.add_head_count_kv([config.num_kv_heads if s else global_kv_heads for s in sliding])
    writer.add_key_length(global_head_dim)
    writer.add_value_length(global_head_dim)
    writer.add_key_length_swa(config.head_dim)
    writer.add_value_length_swa(config.head_dim)
    writer.add_rope_dimension_count(global_head_dim)
    writer.add_rope_dimension_count_swa(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_final_logit_softcapping(config.final_softcap)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern(sliding)
    writer.add_shared_kv_layers(raw["num_kv_shared_layers"])
    writer.add_embedding_length_per_layer_input(config.gemma4.per_layer_input_size)
    writer.add_expert_count(config.gemma4.num_experts)
    writer.add_expert_used_count(config.gemma4.top_k_experts)
    writer.add_expert_feed_forward_length(config.gemma4.moe_intermediate_size)
    _add_tokenizer(writer, model_dir)
    turning = int(global_head_dim * config.rope_scaling["partial_rotary_factor"] / 2)
    rope_freqs = [1.0] * turning + [1e30] * (global_head_dim // 2 - turning)
    writer.add_tensor("rope_freqs.weight", np.array(rope_freqs, dtype=np.float32))
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, num_layers)
    for name, tensor in iter_weights(model_dir):
        if name.endswith("router.scale"):
            target = name_map.get_name(name.replace("router.scale", "router.proj")) + ".scale"
        elif name.endswith("router.per_expert_scale"):
            target = name_map.get_name(name.replace("router.per_expert_scale", "experts.down_proj")) + ".scale"
        elif name_map.get_name(name) is not None:  # the layer scalars and experts: no suffix in the checkpoint
            target = name_map.get_name(name) + ".weight"
        else:
            stem, suffix = name.rsplit(".", 1)
            target = f"{name_map.get_name(stem)}.{suffix}"
        kind = target.rsplit(".", 2)[-2]
        ggml_type = gguf.GGMLQuantizationType[types[kind]] if types and kind in types else None
        _add_tensor(writer, target, tensor, ggml_type)
    _finish(writer)
    return path


@pytest.fixture(scope="module")
def gpt2_gguf(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gpt2_gguf(tiny_models["gpt2"], tmp_path_factory.mktemp("gguf") / "tiny-gpt2-Q4_1.gguf")


@pytest.fixture(scope="module")
def wide_gpt2_k_quants(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer GPT-2 256 wide (the K formats' super-blocks are 256 weights), its
    projections in Q4_K, Q5_K and Q6_K."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.conftest import _build_tokenizer

    root = tmp_path_factory.mktemp("wide-gpt2")
    torch.manual_seed(0)
    config = GPT2Config(n_embd=256, n_layer=1, n_head=4, n_positions=512, vocab_size=TINY_VOCAB, bos_token_id=None)
    GPT2LMHeadModel(config).save_pretrained(root / "hf")
    _build_tokenizer().save_pretrained(root / "hf")
    return write_gpt2_gguf(root / "hf", root / "wide-gpt2-K.gguf", k_quant_projections=True)


def _assert_generates_as_its_float_model(gguf_path: Path, layer_types: list[str]) -> None:
    """`layer_types`: the GGML types of every layer's four projections, in module order."""
    quantized = LLM(str(gguf_path), kv_cache_memory=16 << 20)
    model = quantized.engine.parts.model
    types = {
        name: gguf.GGMLQuantizationType(module.quantized.ggml_type).name
        for name, module in model.named_modules()
        if isinstance(module, Linear) and module.quantized is not None
    }
    assert types.pop("lm_head") == "Q8_0"  # the tied head
    assert list(types.values()) == layer_types
    assert model.quantized_embedding is not None and model.wte.numel() == 0
    dequantized = LLM(str(gguf_path), quantization="none", kv_cache_memory=16 << 20)
    prompts = random_prompts([4, 11, 29], TINY_VOCAB, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    ours = quantized.generate(prompts, params, use_tqdm=False)
    reference = dequantized.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, reference, strict=True):
        first_a, first_b = a.outputs[0], b.outputs[0]
        assert first_a.token_ids[0] == first_b.token_ids[0]
        token = first_b.token_ids[0]
        # Every row's activations are quantized to int8 per block of 32, as llama.cpp does (up
        # to 0.11 here on this random model's sharp logits; a misread block moves them by units).
        assert np.isclose(first_a.logprobs[0][token].logprob, first_b.logprobs[0][token].logprob, atol=0.15)
    assert_no_block_leaked(quantized)


def test_gpt2_serves_its_gguf_blocks_and_generates_as_its_float_model(gpt2_gguf: Path) -> None:
    _assert_generates_as_its_float_model(gpt2_gguf, ["Q4_1"] * 8)  # two layers


def test_k_quant_blocks_are_served_as_stored(wide_gpt2_k_quants: Path) -> None:
    _assert_generates_as_its_float_model(wide_gpt2_k_quants, list(_K_QUANT_TYPES.values()))


def test_fused_layers_of_mixed_types_run_each_part_as_stored(tiny_llama: Path, tmp_path: Path) -> None:
    path = write_mixed_llama_gguf(tiny_llama, tmp_path / "tiny-llama-mixed.gguf")
    quantized = LLM(str(path), kv_cache_memory=16 << 20)
    layer = quantized.engine.parts.model.layers[1]
    qkv, gate_up = layer.self_attn.qkv_proj.quantized, layer.mlp.gate_up_proj.quantized
    assert isinstance(qkv, StackedWeight) and isinstance(gate_up, StackedWeight)
    blocks = QuantizedWeight | PackedWeight  # PackedWeight: repacked for the AVX2 kernel
    assert [isinstance(p, blocks) for p in qkv.parts] == [True, False]  # q and k fused, v float
    assert [p.ggml_type for p in gate_up.parts] == [3, 8]  # type: ignore[union-attr]
    assert isinstance(layer.mlp.down_proj.quantized, blocks)
    # Row for row the weights of the float model that transformers dequantized from the file.
    dequantized = LLM(str(path), quantization="none", kv_cache_memory=16 << 20)
    reference = dequantized.engine.parts.model.layers[1]
    for stacked, linear in ((qkv, reference.self_attn.qkv_proj), (gate_up, reference.mlp.gate_up_proj)):
        rows = [p.dequantize() if isinstance(p, blocks) else p for p in stacked.parts]
        torch.testing.assert_close(torch.cat(rows), linear.weight, rtol=1e-6, atol=1e-6)
    prompts = random_prompts([6, 21], TINY_VOCAB, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
    for a, b in zip(quantized.generate(prompts, params), dequantized.generate(prompts, params), strict=True):
        token = b.outputs[0].token_ids[0]
        assert a.outputs[0].token_ids[0] == token
        # int8 activations, as above
        assert np.isclose(a.outputs[0].logprobs[0][token].logprob, b.outputs[0].logprobs[0][token].logprob, atol=0.15)
    assert quantized.engine.parts.model.compiled is None  # a float part (v): the Python loop runs
    assert_no_block_leaked(quantized)


_SIZES: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
_NO_IDS: dict[str, Any] = dict(vocab_size=TINY_VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def tiny_gemma3_windows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Gemma 3 of six layers, which transformers reads back from GGUF as five
    sliding layers (window 16) and a global one: the pattern it assumes for every such file;
    its global layers' RoPE scaled linearly, as Gemma 3 4B's and larger."""
    from transformers import Gemma3TextConfig

    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    config = Gemma3TextConfig(
        **_SIZES, **_NO_IDS, num_hidden_layers=6, head_dim=16, sliding_window=16, rope_parameters=rope
    )
    return build_random_model(config, tmp_path_factory.mktemp("gemma3-windows"))


@pytest.fixture(scope="module")
def tiny_gemma2_windows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Gemma 2: a sliding layer (window 16), then a global one."""
    from transformers import Gemma2Config

    config = Gemma2Config(**_SIZES, **_NO_IDS, num_hidden_layers=2, head_dim=16, sliding_window=16)
    return build_random_model(config, tmp_path_factory.mktemp("gemma2-windows"))


def _parts(weight: Any) -> tuple[Any, ...]:
    """A quantized layer's weights, one per run of one type it stacks."""
    return weight.parts if isinstance(weight, StackedWeight) else (weight,)


def _served_types(llm: LLM) -> dict[str, list[str]]:
    """Each quantized linear layer's GGML types, one per run of one type it stacks."""
    types = {}
    for name, module in llm.engine.parts.model.named_modules():
        if isinstance(module, Linear) and module.quantized is not None:
            parts = _parts(module.quantized)
            assert all(isinstance(p, QuantizedWeight | PackedWeight) for p in parts), f"{name}: a float part"
            types[name] = [gguf.GGMLQuantizationType(p.ggml_type).name for p in parts]  # type: ignore[union-attr]
    return types


def _assert_weights_are_the_float_models(quantized: LLM, dequantized: LLM) -> None:
    """Every layer served as stored holds, dequantized, its float weight in the model that
    transformers dequantized from the file, row for row: the parts in order, none permuted."""
    reference = dict(dequantized.engine.parts.model.named_modules())
    for name, module in quantized.engine.parts.model.named_modules():
        if isinstance(module, Linear) and module.quantized is not None:
            parts = _parts(module.quantized)
            rows = torch.cat([p.dequantize() for p in parts])  # type: ignore[union-attr]
            torch.testing.assert_close(rows, reference[name].weight, rtol=1e-6, atol=1e-6, msg=name)


def _assert_generates_as_the_float_model_and_transformers(path: Path, quantized: LLM, lengths: list[int]) -> None:
    """The engine as stored against itself on the float model transformers dequantized from
    the file, and that against transformers' own greedy tokens on it. The int8 activations
    (per block of 32, as llama.cpp) move these sharp random models' logprobs by 0.1 on
    average and up to 1 at a few positions (Llama's Q4_1 file as much: measured), so later
    greedy tokens may part at a near-tie: the first token must agree, and over a whole
    sequence the logprobs stay within 0.2 on average (a misread block moves them by units)."""
    from pagefleet.engine.loader.gguf_cache import converted_dir

    dequantized = LLM(str(path), quantization="none", kv_cache_memory=16 << 20)
    _assert_weights_are_the_float_models(quantized, dequantized)
    prompts = random_prompts(lengths, TINY_VOCAB, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    ours = quantized.generate(prompts, params, use_tqdm=False)
    reference = dequantized.generate(prompts, params, use_tqdm=False)
    for prompt, a, b in zip(prompts, ours, reference, strict=True):
        first_a, first_b = a.outputs[0], b.outputs[0]
        assert first_b.token_ids == hf_greedy(converted_dir(path), prompt, 8)[0]
        token = first_b.token_ids[0]
        assert first_a.token_ids[0] == token
        assert np.isclose(first_a.logprobs[0][token].logprob, first_b.logprobs[0][token].logprob, atol=0.15)
    sequence = random_prompts([96], TINY_VOCAB, seed=6)[0]
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    scored = [llm.generate([sequence], scoring, use_tqdm=False)[0].prompt_logprobs for llm in (quantized, dequantized)]
    deviations = [abs(a[t].logprob - b[t].logprob) for a, b, t in zip(*scored, sequence, strict=True) if a and b]
    assert len(deviations) == len(sequence) - 1 and np.mean(deviations) < 0.2, np.mean(deviations)
    assert_no_block_leaked(quantized)
    assert_no_block_leaked(dequantized)


@pytest.mark.parametrize(
    ("fixture", "layer_types"),
    [
        ("tiny_gemma3_windows", ("sliding_attention",) * 5 + ("full_attention",)),
        ("tiny_gemma2_windows", ("sliding_attention", "full_attention")),
    ],
)
def test_gemma_serves_its_gguf_blocks_as_stored(
    fixture: str, layer_types: tuple[str, ...], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    path = write_gemma_gguf(request.getfixturevalue(fixture), tmp_path / "tiny-gemma.gguf")
    quantized = LLM(str(path), kv_cache_memory=16 << 20)
    model = quantized.engine.parts.model
    assert model.config.layer_types == layer_types and model.config.sliding_window == 16
    original = ModelConfig.from_dir(request.getfixturevalue(fixture))
    assert model.config.rope_scaling == original.rope_scaling  # Gemma 3's linear scaling, read from the file
    layer = {"self_attn.qkv_proj": ["Q4_1", "Q8_0"], "self_attn.o_proj": ["Q4_1"]}
    layer |= {"mlp.gate_up_proj": ["Q4_1", "Q8_0"], "mlp.down_proj": ["Q4_1"]}
    expected = {f"layers.{i}.{name}": types for i in range(len(layer_types)) for name, types in layer.items()}
    assert _served_types(quantized) == expected | {"lm_head": ["Q8_0"]}  # the tied head
    assert model.quantized_embedding is not None and model.embed_tokens.numel() == 0  # looked up in the head's blocks
    _assert_generates_as_the_float_model_and_transformers(path, quantized, [5, 23, 40])  # past the window


def test_phi3_serves_its_fused_gguf_blocks_as_stored_with_its_longrope(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """The tiny Phi-3 (LongRoPE past 24 tokens, RoPE on half of each head): what
    transformers' GGUF reader leaves out (the factors, the rotary dims) is read from the file,
    so that the model runs as the checkpoint it was converted from."""
    from pagefleet.engine.loader.gguf_cache import converted_dir

    path = write_phi3_gguf(tiny_models["phi3"], tmp_path / "tiny-phi3.gguf")
    quantized = LLM(str(path), kv_cache_memory=16 << 20)
    layer = {"self_attn.qkv_proj": ["Q4_1"], "self_attn.o_proj": ["Q8_0"]}
    layer |= {"mlp.gate_up_proj": ["Q8_0"], "mlp.down_proj": ["Q4_1"]}
    expected = {f"layers.{i}.{name}": types for i in range(2) for name, types in layer.items()}
    assert _served_types(quantized) == expected | {"lm_head": ["Q4_1"]}  # the untied head
    model = quantized.engine.parts.model
    assert model.quantized_embedding is not None and model.embed_tokens.numel() == 0  # token_embd as stored
    original = ModelConfig.from_dir(tiny_models["phi3"])
    converted = ModelConfig.from_dir(converted_dir(path))
    assert (converted.long_rope_after, converted.rotary_dim) == (original.long_rope_after, original.rotary_dim)
    assert (converted.long_rope_after, converted.rotary_dim) == (24, 8)
    for factors in ("long_factor", "short_factor"):
        assert converted.rope_scaling[factors] == pytest.approx(original.rope_scaling[factors])
    _assert_generates_as_the_float_model_and_transformers(path, quantized, [5, 23, 40])


def test_a_gemma4_gguf_file_runs_as_the_checkpoint_it_was_converted_from(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """transformers' GGUF reader refuses llama.cpp's Gemma 4 files (their per-layer arrays)
    and leaves the layer scalars and the experts unread: the config comes from the file's
    metadata and those tensors from the file (engine/loader/gguf_gemma4.py). The tiny Gemma 4
    (global layers of another shape, keys as values, KV-shared layers with double-wide MLPs,
    per-layer embeddings, experts), written as llama.cpp does in float32, equals its
    checkpoint: the same config and transformers' greedy tokens of the checkpoint."""
    from pagefleet.engine.loader.gguf_cache import converted_dir

    path = write_gemma4_gguf(tiny_models["gemma4"], tmp_path / "tiny-gemma4.gguf")
    llm = LLM(str(path), dtype="float32", kv_cache_memory=16 << 20)
    original = ModelConfig.from_dir(tiny_models["gemma4"])
    converted = ModelConfig.from_dir(converted_dir(path))
    for field in ("layer_kv_shapes", "kv_sources", "gemma4", "layer_windows", "rope_scaling", "local_rope_theta"):
        assert getattr(converted, field) == getattr(original, field), field
    prompts = random_prompts([5, 23, 40], TINY_VOCAB, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        assert output.outputs[0].token_ids == hf_greedy(tiny_models["gemma4"], prompt, 10)[0]
    assert_no_block_leaked(llm)


def test_gemma4_serves_its_gguf_blocks_as_stored(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Each layer's q/k/v as it has them (q alone in the KV-shared layers, q and k in the
    global ones, whose keys are their values), o, gate/up and down, the untied head, the
    embedding and the per-layer embedding table, all looked up or multiplied as stored."""
    types = dict.fromkeys(("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_down", "output"), "Q4_1")
    types |= dict.fromkeys(("attn_v", "ffn_up", "token_embd", "per_layer_token_embd"), "Q8_0")
    path = write_gemma4_gguf(tiny_models["gemma4"], tmp_path / "tiny-gemma4-q.gguf", types)
    quantized = LLM(str(path), kv_cache_memory=16 << 20)
    qkv = [["Q4_1", "Q8_0"], ["Q4_1"], ["Q4_1"], ["Q4_1"]]  # sliding; global (k as v); shared; shared
    expected = {"lm_head": ["Q4_1"]}
    for i, parts in enumerate(qkv):
        expected |= {f"layers.{i}.self_attn.qkv_proj": parts, f"layers.{i}.self_attn.o_proj": ["Q4_1"]}
        expected |= {f"layers.{i}.mlp.gate_up_proj": ["Q4_1", "Q8_0"], f"layers.{i}.mlp.down_proj": ["Q4_1"]}
    assert _served_types(quantized) == expected
    model = quantized.engine.parts.model
    assert model.quantized_embedding is not None and model.embed_tokens.numel() == 0
    assert model.quantized_per_layer_embedding is not None and model.embed_tokens_per_layer.numel() == 0
    _assert_generates_as_the_float_model_and_transformers(path, quantized, [5, 23, 40])
