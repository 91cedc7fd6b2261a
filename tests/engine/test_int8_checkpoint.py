"""int8 W8A8 checkpoints in compressed-tensors form (written by our converter as
llm-compressor writes them): every projection runs as int8 and the model generates what
transformers generates with the same int8 weights and per-token int8 activations; with
quantization="none" it is the dequantized float model; SmolLM2 in W8A8 predicts a fixed
text as well as float32; what cannot be served is refused, naming the option."""

from __future__ import annotations

import json
import math
from pathlib import Path
from pydoc_data.topics import topics

import pytest
import torch
from torch import nn

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.layers.int8 import Int8Weight, PackedInt8Weight, int8_linear_torch
from pagefleet.engine.layers.linear import Linear
from pagefleet.engine.loader import resolve_model_dir
from pagefleet.engine.loader.int8_convert import convert, quantize_channels, smooth
from pagefleet.engine.models.loading import iter_weights
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, random_prompts


@pytest.fixture(scope="module")
def int8_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Round to nearest only (no smoothing): the reference rebuilds the same int8 weights."""
    target = tmp_path_factory.mktemp("tiny-llama-w8a8")
    convert(tiny_llama, target, smoothing=0)
    return target


def _transformers(model_dir: Path, int8_activations: bool) -> nn.Module:
    """The float checkpoint in transformers with each projection's weight replaced by its
    int8 dequantization and, with `int8_activations`, run as the reference int8 layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.endswith("_proj"):
            quants, scales = quantize_channels(module.weight.data)
            weight = Int8Weight(quants, scales.reshape(-1))
            module.weight.data = weight.dequantize()
            if int8_activations:
                module.forward = lambda x, w=weight: int8_linear_torch(x.reshape(-1, x.shape[-1]), w).reshape(
                    *x.shape[:-1], -1
                )
    return model


def _greedy(model: nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _linears(llm: LLM) -> list[Linear]:
    return [m for m in llm.engine.parts.model.modules() if isinstance(m, Linear)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("quantization", [None, "compressed-tensors"])
def test_int8_layers_generate_what_transformers_does_with_int8_weights_and_activations(
    int8_llama: Path, tiny_llama: Path, quantization: str | None
) -> None:
    llm = LLM(str(int8_llama), quantization=quantization, kv_cache_memory=16 << 20)
    linears = _linears(llm)
    assert (
        sum(isinstance(linear.quantized, (Int8Weight, PackedInt8Weight)) for linear in linears) == 2 * 4
    )  # lm_head stays float
    assert all(linear.weight.numel() == 0 for linear in linears if linear.quantized is not None)
    reference = _transformers(tiny_llama, int8_activations=True)
    prompts = random_prompts([5, 17, 33], TINY_VOCAB, seed=11)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == _greedy(reference, prompt, 16)
    assert_no_block_leaked(llm)


def test_quantization_none_serves_the_dequantized_float_model(int8_llama: Path, tiny_llama: Path) -> None:
    llm = LLM(str(int8_llama), quantization="none", kv_cache_memory=16 << 20)
    assert all(linear.quantized is None for linear in _linears(llm))
    reference = _transformers(tiny_llama, int8_activations=False)
    prompts = random_prompts([9, 24], TINY_VOCAB, seed=12)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == _greedy(reference, prompt, 16)


def _perplexity(llm: LLM, token_ids: list[int]) -> float:
    output = llm.generate([token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert output.prompt_logprobs is not None
    nlls = [-position[t].logprob for t, position in zip(token_ids[1:], output.prompt_logprobs[1:], strict=True)]
    return math.exp(sum(nlls) / len(nlls))


@pytest.mark.slow
def test_smollm2_in_w8a8_predicts_a_fixed_text_within_one_percent_of_float32(smollm2: LLM, tmp_path: Path) -> None:
    convert(resolve_model_dir("smollm2-135m-instruct"), tmp_path / "w8a8", calibration_tokens=512)
    int8 = LLM(str(tmp_path / "w8a8"), kv_cache_memory=64 << 20)
    assert sum(isinstance(linear.quantized, (Int8Weight, PackedInt8Weight)) for linear in _linears(int8)) == 30 * 4
    token_ids = int8.tokenizer.encode(topics["assignment"])[:512]  # Python's own reference text
    ratio = _perplexity(int8, token_ids) / _perplexity(smollm2, token_ids)
    assert abs(ratio - 1) <= 0.01, ratio
    # A question with one clear answer, which float32 answers right too ("What is 2 + 3?"
    # is a near tie for this small model: int8 answered "Two and three are two different
    # numbers." once the prompt's attention changed in its last bits).
    prompt = int8.apply_chat_template([{"role": "user", "content": "What is the capital of Japan?"}])
    answer = int8.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert "Tokyo" in answer.outputs[0].text
    assert_no_block_leaked(int8)


def test_smoothing_keeps_the_float_model(tiny_llama: Path) -> None:
    """SmoothQuant moves range from activations to weights, folding each channel's division
    into the norm (or up_proj) before: the smoothed float model gives the same logits."""
    from transformers import AutoModelForCausalLM

    tensors = dict(iter_weights(tiny_llama))
    smooth(tiny_llama, tensors, 0.5, calibration_tokens=256)
    original = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    smoothed = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    smoothed.load_state_dict(tensors, strict=False)
    changed = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(smoothed.state_dict()[changed], original.state_dict()[changed])
    ids = torch.tensor([random_prompts([40], TINY_VOCAB, seed=5)[0]])
    with torch.no_grad():
        torch.testing.assert_close(smoothed(ids).logits, original(ids).logits, rtol=1e-4, atol=1e-4)


def _with_quantization_config(source: Path, target: Path, change) -> Path:  # type: ignore[no-untyped-def]
    convert(source, target, smoothing=0)
    config = json.loads((target / "config.json").read_text())
    change(config["quantization_config"])
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_what_cannot_be_served_is_refused_naming_the_option(tiny_llama: Path, int8_llama: Path, tmp_path: Path) -> None:
    def awq(config: dict) -> None:
        config["quant_method"] = "awq"

    def asymmetric(config: dict) -> None:
        config["config_groups"]["group_0"]["input_activations"]["symmetric"] = False

    def weight_only(config: dict) -> None:
        config["config_groups"]["group_0"]["input_activations"] = None

    for change, message in [(awq, "'awq'"), (asymmetric, "symmetric"), (weight_only, "W8A16")]:
        model = _with_quantization_config(tiny_llama, tmp_path / change.__name__, change)
        with pytest.raises(InvalidParameterError, match=message) as error:
            LLM(str(model))
        assert error.value.param == "quantization"
    with pytest.raises(InvalidParameterError, match="not one"):
        LLM(str(tiny_llama), quantization="compressed-tensors")
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size=1"):
        LLM(str(int8_llama), quantization="compressed-tensors", tensor_parallel_size=2)
