"""The compiled decoder layers (csrc/cpu_decoder.cpp) give the Python loop's bits: the same
tokens and the same logprobs to the last bit, for prompts prefilled together and decoded in
a batch, in float32 and bfloat16, with Qwen2's qkv bias, Qwen3's q/k norms and a fused
projection whose parts are stored in different formats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.layers.linear import Linear
from pagefleet.engine.layers.quantized import QuantizedWeight, StackedWeight
from pagefleet.kernels import cpu_ops
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, random_prompts

pytestmark = pytest.mark.skipif(
    not cpu_ops.has_compiled_layers(), reason="needs the AVX2 or AVX-512 build of the operators"
)


def _blocks(weight: torch.Tensor, name: str) -> QuantizedWeight:
    kind = gguf.GGMLQuantizationType[name]
    raw = gguf.quants.quantize(weight.float().numpy(), kind)
    return QuantizedWeight.from_blocks(torch.from_numpy(raw), int(kind))


def _quantize(linear: Linear, formats: tuple[str, ...]) -> None:
    """The projection's weight in `formats[0]`, or split in two row blocks of the two formats."""
    weight = linear.weight.data
    if len(formats) == 1:
        linear.quantize(_blocks(weight, formats[0]))
        return
    half = weight.shape[0] // 2
    linear.quantize(StackedWeight((_blocks(weight[:half], formats[0]), _blocks(weight[half:], formats[1]))))


def _answers(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    assert llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    answers = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [lp for position in completion.logprobs or [] for lp in sorted(v.logprob for v in position.values())]
        answers.append((list(completion.token_ids), logprobs))
    return answers


def _assert_the_compiled_layers_give_the_python_loops_answers(llm: LLM, model: Any) -> None:
    """Every layer compiled, and the Python loop's tokens and logprobs to the last bit."""
    prompts = random_prompts([5, 23, 40], TINY_VOCAB, seed=7)
    compiled = _answers(llm, prompts)
    assert model.compiled is not None and model.compiled.num_layers() == len(model.layers)
    model.compiled = None  # the Python loop
    assert _answers(llm, prompts) == compiled
    assert_no_block_leaked(llm)


@pytest.mark.parametrize(
    ("arch", "dtype", "formats"),
    [("llama", "float32", ("Q4_1",)), ("qwen2", "bfloat16", ("Q8_0",)), ("qwen3", "float32", ("Q4_1", "Q8_0"))],
)
def test_compiled_layers_compute_the_python_loops_bits(
    tiny_models: dict[str, Path], arch: str, dtype: str, formats: tuple[str, ...]
) -> None:
    llm = LLM(str(tiny_models[arch]), dtype=dtype, quantization="none", kv_cache_memory=16 << 20)
    model = llm.engine.parts.model  # type: ignore[attr-defined]
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            _quantize(linear, formats)
    model.compiled = False  # made again from the quantized layers at the next step
    _assert_the_compiled_layers_give_the_python_loops_answers(llm, model)


def test_a_mixture_of_experts_gguf_runs_its_sparse_layers_compiled_with_the_python_loops_bits(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A Qwen3-MoE file whose every projection and expert is Q8_0: the compiled loop runs
    its router and the quantized-experts operator, and gives the Python loop's tokens and
    logprobs to the last bit."""
    from tests.engine.test_gguf_moe import _QWEN3_TYPES, _tiny_qwen3_moe_dir, write_moe_gguf

    folder = tmp_path_factory.mktemp("qwen3-moe-compiled")
    path = write_moe_gguf(_tiny_qwen3_moe_dir(folder / "model"), folder / "tiny-qwen3-moe-Q8_0.gguf", _QWEN3_TYPES)
    llm = LLM(str(path), kv_cache_memory=16 << 20)
    model = llm.engine.parts.model  # type: ignore[attr-defined]
    _assert_the_compiled_layers_give_the_python_loops_answers(llm, model)
