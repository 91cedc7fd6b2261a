"""gpt-oss as released: experts in MXFP4 (`_blocks` and `_scales` tensors), dequantized at
load to the values transformers' own dequantization gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.errors import UnsupportedModelError
from pagefleet.engine.loader.mxfp4 import dequantize_mxfp4, dequantized_mxfp4
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import hf_greedy, random_prompts


def _random_mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks and scales for a float [E, columns, rows] (x @ W) tensor: random codes, groups
    scaled by 2^-6 .. 2^-2."""
    experts, columns, rows = shape
    blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(121, 126, (experts, rows, columns // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the checkpoint with MXFP4 experts, the same model in float32 for transformers)."""
    root = tmp_path_factory.mktemp("mxfp4")
    floats, packed = root / "float", root / "mxfp4"
    shutil.copytree(tiny_models["gpt_oss"], floats)
    shutil.copytree(tiny_models["gpt_oss"], packed)
    tensors = load_file(floats / "model.safetensors")
    quantized = dict(tensors)
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _random_mxfp4(tuple(tensors[name].shape), generator)
        tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
    save_file(tensors, floats / "model.safetensors", metadata={"format": "pt"})
    save_file(quantized, packed / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(config))
    return packed, floats


def test_mxfp4_dequantizes_to_transformers_values_bit_for_bit() -> None:
    blocks, scales = _random_mxfp4((3, 64, 48), torch.Generator().manual_seed(1))
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks, scales), expected)


def test_gpt_oss_with_mxfp4_experts_equals_transformers_on_its_values(mxfp4_gpt_oss: tuple[Path, Path]) -> None:
    packed, floats = mxfp4_gpt_oss
    llm = LLM(str(packed), dtype="float32", block_size=8)
    prompts = random_prompts([5, 17, 33], TINY_VOCAB, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
        assert output.outputs[0].token_ids == hf_greedy(floats, prompt, 10)[0]


def test_an_mxfp4_tensor_without_its_scales_is_refused_by_name() -> None:
    blocks, _ = _random_mxfp4((1, 32, 8), torch.Generator().manual_seed(2))
    with pytest.raises(UnsupportedModelError, match="layers.0.mlp.experts.down_proj"):
        list(dequantized_mxfp4([("model.layers.0.mlp.experts.down_proj_blocks", blocks)]))
