"""Mixture-of-experts GGUF files written here from tiny random models as llama.cpp's
converter lays them out (the experts of a layer stacked in three 3-D tensors, the router
F32): Qwen3-MoE with its experts in Q8_0, Qwen2-MoE with its shared expert (gate and up of
different types), Mixtral as a `llama` file (q/k permuted), and a Qwen3-MoE 256 wide whose
experts are Q4_K and Q6_K blocks. Each expert is served from the file's slices as stored,
and generates as the float model transformers dequantizes from the file; a file whose
expert tensors are missing or misshapen is refused by name."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.errors import UnsupportedModelError
from pagefleet.engine.layers.experts import RoutedExperts
from pagefleet.engine.layers.quantized import PackedWeight, QuantizedWeight, StackedWeight
from pagefleet.engine.layers.quantized_experts import QuantizedRoutedExperts
from pagefleet.engine.models.loading import iter_weights
from tests.conftest import TINY_VOCAB, build_random_model, build_tiny_model
from tests.engine.helpers import assert_no_block_leaked, hf_greedy, random_prompts
from tests.engine.test_gguf_files import (
    _add_decoder_metadata,
    _add_tensor,
    _add_tokenizer,
    _assert_weights_are_the_float_models,
    _finish,
    _served_types,
)
from tests.kernels.test_quantized import random_blocks

_ARCHITECTURES = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE}
_K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # the gguf package cannot quantize to them: random blocks


def _add_moe_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    """The keys llama.cpp's Qwen2MoeModel, Qwen3MoeModel and LlamaModel (Mixtral) write."""
    _add_decoder_metadata(writer, config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if config.model_type == "mixtral":
        writer.add_rope_dimension_count(head_dim)
        writer.add_expert_count(config.num_local_experts)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_count(config.num_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _add_experts(
    writer: gguf.GGUFWriter, name: str, stacked: torch.Tensor, type_name: str, drop_last_expert: bool
) -> None:
    """One layer's experts of one kind, [E, rows, in]: quantized from their values, or
    random blocks of a K format (which the float model then reads dequantized too)."""
    if drop_last_expert:  # a misshapen file: one expert short
        stacked = stacked[:-1]
    ggml_type = gguf.GGMLQuantizationType[type_name]
    if type_name not in _K_TYPES:
        _add_tensor(writer, name, stacked, ggml_type)
        return
    experts, rows, in_features = stacked.shape
    blocks = random_blocks(experts * rows, in_features, ggml_type, torch.Generator().manual_seed(len(name)))
    writer.add_tensor(name, blocks.reshape(experts, rows, -1), raw_dtype=ggml_type)


def write_moe_gguf(
    model_dir: Path,
    path: Path,
    types: dict[str, str],
    omit: str | None = None,
    one_expert_short: str | None = None,
    add_tokenizer: Callable[[gguf.GGUFWriter, Path], None] = _add_tokenizer,
) -> Path:
    """The HF Qwen3-MoE, Qwen2-MoE or Mixtral in `model_dir` as llama.cpp's converter writes
    it: each tensor kind (`ffn_gate_exps`, `attn_q`, ...) in the type `types` gives, F32
    otherwise; a layer's experts stacked per kind, [E, rows, in] in numpy's order; Qwen2-MoE's
    shared expert gate as a vector; Mixtral as `llama`, its q/k rows permuted. Without the
    tensor `omit`, or with `one_expert_short`'s experts one short, for the refusals. The
    tokenizer is written by `add_tokenizer` (the tiny models' byte-level BPE by default;
    bench/moe_gguf.py passes its own)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    arch = _ARCHITECTURES.get(config.model_type, gguf.MODEL_ARCH.LLAMA)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _add_moe_metadata(writer, config)
    add_tokenizer(writer, model_dir)
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in iter_weights(model_dir):
        stem, suffix = name.rsplit(".", 1)
        target = name_map.get_name(re.sub(r"\.experts\.\d+\.", ".experts.", stem))
        assert target is not None, f"no llama.cpp name for {name}"
        target, kind = f"{target}.{suffix}", target.rsplit(".", 1)[-1]
        if ".experts." in name:
            experts.setdefault(target, {})[int(name.split(".experts.")[1].split(".")[0])] = tensor
            continue
        if kind == "ffn_gate_inp_shexp":
            tensor = tensor.reshape(-1)  # llama.cpp stores it [H]
        if kind in heads and arch == gguf.MODEL_ARCH.LLAMA:  # llama.cpp's rotary row order
            tensor = tensor.reshape(heads[kind], 2, -1, tensor.shape[1]).transpose(1, 2).reshape(tensor.shape)
        if target != omit:
            _add_tensor(writer, target, tensor, gguf.GGMLQuantizationType[types[kind]] if kind in types else None)
    for target, per_expert in experts.items():
        if target != omit:
            stacked = torch.stack([per_expert[e] for e in sorted(per_expert)])
            _add_experts(writer, target, stacked, types[target.split(".")[2]], target == one_expert_short)
    _finish(writer)
    return path


_TINY_SIZES: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    vocab_size=TINY_VOCAB,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _tiny_qwen3_moe_dir(folder: Path) -> Path:
    """A random Qwen3-MoE whose every layer is sparse, as llama.cpp runs the architecture."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(**_TINY_SIZES, head_dim=16, num_experts=4, norm_topk_prob=True)
    return build_random_model(config, folder)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_qwen3_moe_dir(tmp_path_factory.mktemp("qwen3-moe"))


@pytest.fixture(scope="module")
def tiny_qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2-MoE (q/k/v biases), its shared expert 64 wide: a whole number of
    blocks of 32 in its down projection's rows."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(**_TINY_SIZES, num_experts=4, shared_expert_intermediate_size=64)
    return build_random_model(config, tmp_path_factory.mktemp("qwen2-moe"))


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("mixtral", tmp_path_factory.mktemp("mixtral"))


def _experts(llm: LLM) -> dict[int, Any]:
    """Each sparse layer's routed experts (DeepSeek's first layers are dense)."""
    layers = llm.engine.parts.model.layers
    return {i: layer.mlp.experts for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")}


def _blocks(weight: Any) -> list[QuantizedWeight | PackedWeight]:
    parts = list(weight.parts) if isinstance(weight, StackedWeight) else [weight]
    assert all(isinstance(p, QuantizedWeight | PackedWeight) for p in parts), "a float part"
    return parts


def _layout_bytes(tensor: Any, planes: bool) -> int:
    """A file tensor's bytes in the unpacked served layout (engine/layers/quantized.py):
    codes a nibble (the 4-bit formats) or a byte, a float16 scale and min per group of 32
    weights (16 for Q6_K); with `planes` (VNNI's layout) 5- and 6-bit codes take their bits
    and Q6_K no mins."""
    name, weights = tensor.tensor_type.name, int(np.prod(tensor.shape))
    in_planes = planes and name in ("Q5_0", "Q5_1", "Q5_K", "Q6_K") and int(tensor.shape[0]) % 64 == 0
    code_bits = 4 if name in ("Q4_0", "Q4_1", "Q4_K") else 8
    if in_planes:
        code_bits = 6 if name == "Q6_K" else 5
    group = 16 if name == "Q6_K" else 32
    return weights * code_bits // 8 + weights // group * (2 if in_planes and name == "Q6_K" else 4)


def _assert_dequantizes_to(weight: Any, expected: torch.Tensor, what: str) -> None:
    """`weight`'s rows, dequantized, are `expected`: bit for bit, but for the K formats,
    whose scales and mins the served layout rounds to float16 (engine/layers/quantized.py:
    2^-11 of each at most)."""
    parts = _blocks(weight)
    k_format = any(gguf.GGMLQuantizationType(p.ggml_type).name in _K_TYPES for p in parts)
    atol = 2**-10 * expected.abs().max().item() if k_format else 0.0
    rows = torch.cat([p.dequantize() for p in parts])
    torch.testing.assert_close(rows, expected, rtol=0, atol=atol, msg=what)


def _assert_experts_are_the_files_blocks(path: Path, quantized: LLM, dequantized: LLM, types: dict[str, str]) -> None:
    """Every layer's experts are served from quantized blocks of the file's types, which
    dequantize to the file's slices (the float model's experts), hold no float weight, and
    take the file's blocks' bytes in the served layout."""
    file = {t.name: t for t in gguf.GGUFReader(path).tensors}
    gate_up_types = [types["ffn_gate_exps"], types["ffn_up_exps"]]
    if gate_up_types[0] == gate_up_types[1]:
        gate_up_types = gate_up_types[:1]  # one run of blocks per expert
    references = _experts(dequantized)
    for layer, served in _experts(quantized).items():
        reference = references[layer]
        assert isinstance(served, QuantizedRoutedExperts) and isinstance(reference, RoutedExperts)
        assert list(served.parameters()) == [], "a float copy of the experts"
        gate_up = reference.gate_up.view(served.num_experts, 2 * served.width, -1)
        down = reference.down.view(served.num_experts, -1, served.width)
        for e in range(served.num_experts):
            assert [gguf.GGMLQuantizationType(p.ggml_type).name for p in _blocks(served.gate_up[e])] == gate_up_types
            assert [gguf.GGMLQuantizationType(p.ggml_type).name for p in _blocks(served.down[e])] == [
                types["ffn_down_exps"]
            ]
            _assert_dequantizes_to(served.gate_up[e], gate_up[e], f"layer {layer} expert {e}'s gate and up")
            _assert_dequantizes_to(served.down[e], down[e], f"layer {layer} expert {e}'s down")
        names = [f"blk.{layer}.{kind}.weight" for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
        blocks = [p for w in (*served.gate_up, *served.down) for p in _blocks(w)]
        if all(isinstance(p, QuantizedWeight) for p in blocks):  # not repacked (AVX2)
            planes = any(p.planes for p in blocks)
            assert served.nbytes == sum(_layout_bytes(file[name], planes) for name in names)


def _assert_greedy_tokens_are_the_dequantized_models(
    path: Path, quantized: LLM, dequantized: LLM, lengths: list[int]
) -> None:
    """With every quantized matmul in float32 on the dequantized blocks (the operator's
    reference), the engine's greedy tokens are those of the float model transformers
    dequantized from the file, run by the engine and by transformers, token for token."""
    from pagefleet.engine.loader.gguf_cache import converted_dir

    prompts = random_prompts(lengths, TINY_VOCAB, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ours = quantized.generate(prompts, params, use_tqdm=False)
    reference = dequantized.generate(prompts, params, use_tqdm=False)
    for prompt, a, b in zip(prompts, ours, reference, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        expected = hf_greedy(converted_dir(path), prompt, 10)[0]  # up to the file's end of text, if generated
        assert a.outputs[0].token_ids[: len(expected)] == expected


def _mean_logprob_deviation(quantized: LLM, dequantized: LLM) -> float:
    sequence = random_prompts([96], TINY_VOCAB, seed=6)[0]
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    scored = [llm.generate([sequence], scoring, use_tqdm=False)[0].prompt_logprobs for llm in (quantized, dequantized)]
    deviations = [abs(a[t].logprob - b[t].logprob) for a, b, t in zip(*scored, sequence, strict=True) if a and b]
    assert len(deviations) == len(sequence) - 1
    return float(np.mean(deviations))


def _assert_serves_the_files_experts(
    path: Path, types: dict[str, str], lengths: list[int], monkeypatch: pytest.MonkeyPatch
) -> LLM:
    """The experts are the file's blocks (`_assert_experts_are_the_files_blocks`); served
    through the operator's float32 reference they generate exactly as the dequantized file;
    through the compiled int8 operator (activations quantized per block of 32, as llama.cpp
    does) the logprobs stay within 0.2 of it on average. Token for token equality is not
    asked there: int8 activations move a router's logits too, and at a near-tie a token
    takes another expert (a step of up to ~1.3 in one logprob, measured)."""
    from pagefleet.kernels import cpu_ops

    dequantized = LLM(str(path), quantization="none", kv_cache_memory=16 << 20)
    with monkeypatch.context() as patch:
        patch.setattr(cpu_ops, "has_quantized_linear", lambda: False)  # the float32 reference
        patch.setattr(cpu_ops, "quantized_packed_layout", lambda: False)
        reference = LLM(str(path), kv_cache_memory=16 << 20)
        _assert_experts_are_the_files_blocks(path, reference, dequantized, types)
        _assert_weights_are_the_float_models(reference, dequantized)
        _assert_greedy_tokens_are_the_dequantized_models(path, reference, dequantized, lengths)
        # The K formats' scales are float16 in the served layout (the float model's are not).
        k_format = any(name in _K_TYPES for name in types.values())
        assert _mean_logprob_deviation(reference, dequantized) < (2e-3 if k_format else 1e-4)
    quantized = LLM(str(path), kv_cache_memory=16 << 20)
    _assert_experts_are_the_files_blocks(path, quantized, dequantized, types)
    assert _mean_logprob_deviation(quantized, dequantized) < 0.2  # a misread block moves them by units
    for llm in (reference, quantized, dequantized):
        assert_no_block_leaked(llm)
    return quantized


_QWEN3_TYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "output": "Q8_0"}
_QWEN3_TYPES |= dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), "Q8_0")


def test_qwen3_moe_serves_each_expert_from_the_files_q8_0_blocks(
    tiny_qwen3_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_moe_gguf(tiny_qwen3_moe, tmp_path / "tiny-qwen3-moe-Q8_0.gguf", _QWEN3_TYPES)
    quantized = _assert_serves_the_files_experts(path, _QWEN3_TYPES, [5, 23, 40], monkeypatch)
    layer = {"self_attn.qkv_proj": ["Q8_0"], "self_attn.o_proj": ["Q8_0"]}
    expected = {f"layers.{i}.{name}": types for i in range(2) for name, types in layer.items()}
    assert _served_types(quantized) == expected | {"lm_head": ["Q8_0"]}  # the routers stay F32


def test_qwen2_moe_serves_its_experts_and_shared_expert_as_stored(
    tiny_qwen2_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gate and up of different types (two runs per expert), down in a third; the shared
    expert an MLP of its own types, its sigmoid gate F32."""
    types = {"ffn_gate_exps": "Q4_1", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q5_0"}
    types |= {"ffn_gate_shexp": "Q8_0", "ffn_up_shexp": "Q8_0", "ffn_down_shexp": "Q4_0"}
    types |= {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q4_1", "attn_output": "Q8_0"}
    path = write_moe_gguf(tiny_qwen2_moe, tmp_path / "tiny-qwen2-moe.gguf", types)
    quantized = _assert_serves_the_files_experts(path, types, [5, 23, 40], monkeypatch)
    shared = {"mlp.shared_expert.gate_up_proj": ["Q8_0"], "mlp.shared_expert.down_proj": ["Q4_0"]}
    served = _served_types(quantized)
    assert {name: served[f"layers.1.{name}"] for name in shared} == shared
    assert served["layers.1.self_attn.qkv_proj"] == ["Q8_0", "Q4_1"]  # q and k fused, v on its own


def test_mixtral_written_as_llama_serves_its_experts_as_stored(
    tiny_mixtral: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers does not read Mixtral's GGUF files (a `llama` file with experts): its
    config and float model come from the file (engine/loader/gguf_moe.py), q/k rows back in
    Hugging Face's order."""
    types = {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q4_0", "attn_q": "Q4_0"}
    types |= {"attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0"}
    path = write_moe_gguf(tiny_mixtral, tmp_path / "tiny-mixtral.gguf", types)
    quantized = _assert_serves_the_files_experts(path, types, [5, 23, 40], monkeypatch)
    assert quantized.engine.parts.model.config.architecture == "MixtralForCausalLM"
    assert _served_types(quantized)["layers.0.self_attn.qkv_proj"] == ["Q4_0", "Q8_0"]


def test_k_quant_experts_are_served_as_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3-MoE 256 wide (the K formats' super-blocks), its experts as a Q4_K_M file
    has them: gate and up Q4_K, down Q6_K."""
    from transformers import Qwen3MoeConfig

    wide = _TINY_SIZES | dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=1)
    config = Qwen3MoeConfig(**wide, head_dim=64, num_experts=4, norm_topk_prob=True)
    model_dir = build_random_model(config, tmp_path / "hf", std=0.1)
    types = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"}
    path = write_moe_gguf(model_dir, tmp_path / "wide-qwen3-moe-K.gguf", types)
    _assert_serves_the_files_experts(path, types, [5, 23], monkeypatch)


@pytest.mark.parametrize(
    ("omit", "one_expert_short", "message"),
    [
        ("blk.1.ffn_down_exps.weight", None, r"blk\.1\.ffn_down_exps\.weight is missing"),
        ("blk.0.ffn_gate_inp.weight", None, r"blk\.0\.ffn_gate_inp\.weight is missing"),
        (None, "blk.1.ffn_up_exps.weight", r"blk\.1\.ffn_up_exps\.weight has shape \(64, 32, 3\)"),
    ],
)
def test_a_file_with_missing_or_misshapen_experts_is_refused_by_name(
    tiny_qwen3_moe: Path, tmp_path: Path, omit: str | None, one_expert_short: str | None, message: str
) -> None:
    path = write_moe_gguf(tiny_qwen3_moe, tmp_path / "broken.gguf", _QWEN3_TYPES, omit, one_expert_short)
    for quantization in ("gguf", "none"):  # refused before anything is converted or served
        with pytest.raises(UnsupportedModelError, match=message):
            LLM(str(path), quantization=quantization, kv_cache_memory=16 << 20, separate_process=False)
