"""The model registry: what docs/engine.md says is supported is what loads, and per-layer
attention settings come from the config as transformers reads them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers as tf

from pagefleet.engine.errors import UnsupportedModelError
from pagefleet.engine.layers.rotary import RotaryEmbedding, rope_inv_freq, rope_rows
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.registry import FAMILIES, SUPPORTED_ARCHITECTURES, model_class

DOCS = Path(__file__).resolve().parents[2] / "docs" / "engine.md"


def test_the_docs_table_lists_every_registered_architecture() -> None:
    table = DOCS.read_text().split("<!-- supported-architectures -->")[1].split("<!-- /supported-architectures -->")[0]
    rows = {m.group(1): set(m.group(2).split(", ")) for m in re.finditer(r"\| `(\w+)\.py` \| ([\w, ]+) \|", table)}
    assert rows == {family.name: set(family.architectures) for family in FAMILIES}
    for family in FAMILIES:
        assert model_class(family.name).__name__ == family.model_class


def _config(hf_config: tf.PretrainedConfig, architecture: str) -> ModelConfig:
    return ModelConfig.from_hf({**hf_config.to_dict(), "architectures": [architecture]})


def test_gemma4s_global_shapes_and_kv_sharing_come_from_either_spelling_of_the_config() -> None:
    """As transformers 5.24 writes it (`per_layer_config`) and as released checkpoints do
    (`global_head_dim`, `num_global_key_value_heads`): global layers' head size and KV heads,
    and each KV-shared layer reading the last unshared layer of its type."""
    gemma4 = tf.Gemma4TextConfig(
        num_hidden_layers=12,
        num_kv_shared_layers=4,
        num_key_value_heads=4,
        attention_k_eq_v=True,
        num_global_key_value_heads=2,
        global_head_dim=512,
    )
    written = {**gemma4.to_dict(), "architectures": ["Gemma4ForCausalLM"]}
    released = {k: v for k, v in written.items() if k != "per_layer_config"}
    released |= {"global_head_dim": 512, "num_global_key_value_heads": 2}
    for raw in (written, released):
        config = ModelConfig.from_hf(raw)
        assert config.layer_windows == ([512] * 5 + [None]) * 2
        assert [config.layer_kv_shape(i) for i in (0, 5, 11)] == [(4, 256), (2, 512), (2, 512)]
        assert config.kv_sources == (*range(8), 7, 7, 7, 5)
        assert config.attention_scale == 1.0 and config.rope_scaling["rope_type"] == "proportional"


def test_gemma_layers_take_their_windows_scales_and_rope_bases_from_the_config() -> None:
    gemma3 = tf.Gemma3TextConfig(num_hidden_layers=7, sliding_window=512, head_dim=64, query_pre_attn_scalar=256)
    config = _config(gemma3, "Gemma3ForCausalLM")
    assert config.layer_windows == [512] * 5 + [None, 512]  # five local per global
    assert (config.rope_theta, config.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert config.attention_scale == 256**-0.5 and config.qk_norm and config.attn_softcap is None
    gemma2 = _config(tf.Gemma2Config(num_hidden_layers=4, sliding_window=4096), "Gemma2ForCausalLM")
    assert gemma2.layer_windows == [4096, None, 4096, None]
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.local_rope_theta) == (50.0, 30.0, None)
    mistral = _config(tf.MistralConfig(num_hidden_layers=2, sliding_window=4096), "MistralForCausalLM")
    assert mistral.layer_windows == [4096, 4096]
    assert SUPPORTED_ARCHITECTURES["Gemma3ForCausalLM"] == "gemma"


def test_smollm3_nope_layers_and_granite_multipliers_come_from_the_config() -> None:
    smollm3 = _config(tf.SmolLM3Config(num_hidden_layers=8, no_rope_layer_interval=4), "SmolLM3ForCausalLM")
    assert [smollm3.layer_uses_rope(i) for i in range(8)] == [True, True, True, False] * 2
    assert smollm3.layer_window(0) is None  # use_sliding_window is off by default
    granite = tf.GraniteConfig(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125)
    config = _config(granite, "GraniteForCausalLM")
    assert (config.embedding_multiplier, config.residual_multiplier, config.attention_scale) == (12.0, 0.22, 0.0078125)
    assert config.logits_scaling == 1.0
    olmo2 = _config(tf.Olmo2Config(num_hidden_layers=2), "Olmo2ForCausalLM")
    assert olmo2.qk_norm and olmo2.attention_scale == olmo2.head_dim**-0.5


def test_phi3_rotates_part_of_each_head_and_takes_longrope_factors_where_transformers_does() -> None:
    phi = _config(tf.Phi3Config(num_hidden_layers=2, partial_rotary_factor=0.75), "Phi3ForCausalLM")
    assert (phi.head_dim, phi.rotary_dim, phi.long_rope_after) == (96, 72, None)
    longrope = tf.Phi3Config(
        num_hidden_layers=2,
        original_max_position_embeddings=4096,
        max_position_embeddings=131072,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
    )
    config = _config(longrope, "Phi3ForCausalLM")
    assert config.long_rope_after == 4096
    assert list(rope_rows(4094, 4098, False, 131072)) == [4094, 4095, 4096, 4097]
    assert list(rope_rows(0, 2, True, 131072)) == [131072, 131073]  # the long set follows the short one
    with pytest.raises(UnsupportedModelError, match="rope type 'dynamic' is not supported"):
        _config(tf.LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "LlamaForCausalLM")


@pytest.mark.parametrize(
    "rope",
    [
        {},  # gpt-oss's own: factor 32 over 4,096 positions, the ramp not truncated
        {"truncate": True},
        {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "truncate": True},  # DeepSeek-V3's
        {"factor": 4.0, "attention_factor": 1.25, "beta_fast": 16.0},
    ],
)
def test_yarn_frequencies_and_scale_equal_transformers(rope: dict) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = tf.GptOssConfig(num_hidden_layers=2)
    hf.rope_parameters = hf.rope_parameters | rope
    config = _config(hf, "GptOssForCausalLM")
    expected_inv_freq, expected_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert torch.equal(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling), expected_inv_freq)
    table = RotaryEmbedding(config.head_dim, 8, config.rope_theta, config.rope_scaling)
    assert table.cos[0, 0].item() == pytest.approx(expected_scale, rel=1e-6)


def test_a_checkpoint_missing_an_expert_is_refused_with_the_tensors_name(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    from pagefleet.engine import LLM

    for item in tiny_models["mixtral"].iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"):
        LLM(str(tmp_path), dtype="float32", separate_process=False)
