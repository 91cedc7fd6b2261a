"""SmolLM2 served from its GGUF's Q4_1/Q8_0 tensors as stored (the default for a GGUF on a
CPU): the weights are the file's, in Hugging Face's row order, at under a quarter of float32's
memory, and the model predicts a fixed text as well as the float32 dequantized one."""

from __future__ import annotations

import math
from pydoc_data.topics import topics

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.layers.linear import Linear
from pagefleet.engine.models.loading import iter_weights
from tests.engine.helpers import assert_no_block_leaked

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quantized() -> LLM:
    return LLM("smollm2-135m-instruct", kv_cache_memory=64 << 20)


def _linears(llm: LLM) -> list[Linear]:
    return [m for m in llm.engine.parts.model.modules() if isinstance(m, Linear)]  # type: ignore[attr-defined]


def test_every_linear_layer_serves_the_files_blocks_in_a_quarter_of_float32s_memory(quantized: LLM) -> None:
    linears = _linears(quantized)
    assert len(linears) == 30 * 4 + 1 and all(linear.quantized is not None for linear in linears)
    types = [linear.quantized.ggml_type for linear in linears if linear.quantized is not None]
    assert types.count(8) == 1 and types.count(3) == 120  # the tied head Q8_0, the layers Q4_1
    model = quantized.engine.parts.model
    weight_bytes = sum(linear.quantized.nbytes for linear in linears if linear.quantized is not None)
    weight_bytes += sum(p.numel() * p.element_size() for p in model.parameters())  # type: ignore[attr-defined]
    float32_bytes = 134_515_008 * 4  # SmolLM2-135M's parameters
    assert weight_bytes <= 0.25 * float32_bytes


def test_rows_are_in_hugging_faces_order(quantized: LLM) -> None:
    """llama.cpp permutes q and k rows for its rotary layout; dequantized, the fused qkv
    equals transformers' own dequantization of the file, row for row."""
    model_dir = quantized.engine.parts.model_dir
    names = {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"}
    hf = {name: tensor for name, tensor in iter_weights(model_dir) if name in names}
    expected = torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    qkv = quantized.engine.parts.model.layers[1].self_attn.qkv_proj.quantized  # type: ignore[attr-defined]
    torch.testing.assert_close(qkv.dequantize(), expected, rtol=1e-6, atol=1e-7)


def _negative_log_likelihoods(llm: LLM, token_ids: list[int]) -> list[float]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    output = llm.generate([token_ids], params, use_tqdm=False)[0]
    assert output.prompt_logprobs is not None
    return [-position[token].logprob for token, position in zip(token_ids[1:], output.prompt_logprobs[1:], strict=True)]


def test_perplexity_within_one_percent_of_the_float32_model(quantized: LLM, smollm2: LLM) -> None:
    text = topics["assignment"]  # the Python 3.11 reference's "Assignment statements", from the standard library
    token_ids = quantized.tokenizer.encode(text)[:512]
    ours = _negative_log_likelihoods(quantized, token_ids)
    reference = _negative_log_likelihoods(smollm2, token_ids)
    perplexity, reference_perplexity = math.exp(sum(ours) / len(ours)), math.exp(sum(reference) / len(reference))
    assert abs(perplexity / reference_perplexity - 1) <= 0.01, (perplexity, reference_perplexity)
    assert_no_block_leaked(quantized)
    assert_no_block_leaked(smollm2)


def test_greedy_answers_agree_with_the_float32_model(quantized: LLM, smollm2: LLM) -> None:
    questions = [
        "What is the capital of France? Answer in one sentence.",
        "Name three colours.",
        "What is 2 + 3?",
        "Who wrote Hamlet?",
    ]
    prompts = [quantized.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    ours = [o.outputs[0].token_ids for o in quantized.generate(prompts, params, use_tqdm=False)]
    reference = [o.outputs[0].token_ids for o in smollm2.generate(prompts, params, use_tqdm=False)]
    # int8 activations move logits a little: a near tie may break the other way later on.
    agreeing = sum(a[:8] == b[:8] for a, b in zip(ours, reference, strict=True))
    assert agreeing >= 3, (ours, reference)
    assert "Paris" in quantized.tokenizer.decode(ours[0])


def test_quantization_is_refused_where_it_cannot_apply(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidParameterError, match="quantization"):
        LLM(str(tiny_llama), quantization="gguf")
    with pytest.raises(InvalidParameterError, match="quantization"):
        LLM("smollm2-135m-instruct", quantization="awq")
