"""What a GGUF file says of its model that transformers' GGUF reader leaves out of the config.

transformers builds the config of a GGUF file from a fixed table of metadata keys per
architecture, and some settings llama.cpp's converter writes are not in it, so the model
would run otherwise than the file's: Phi-3's LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini:
the `rope_factors_long`/`short` tensors and the pretraining length), its partial rotary
dimensions and sliding window, and Gemma 3's linear RoPE scaling of its global layers (4B
and larger). `complete_config` writes them into the config.json of the converted directory
(engine/loader/gguf_cache.py), in transformers 5's spelling, which transformers and the
engine then both read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The tokenizer's arrays: hundreds of thousands of values, which no config setting needs.
_TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
)


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A GGUF file's metadata values (but the tokenizer's arrays) and its tensors (gguf's
    ReaderTensor) by name: read once per conversion."""
    import gguf  # the reader parses every metadata array: only here, once per conversion

    reader = gguf.GGUFReader(path)
    metadata = {name: field.contents() for name, field in reader.fields.items() if name not in _TOKENIZER_ARRAYS}
    return metadata, {tensor.name: tensor for tensor in reader.tensors}


def complete_config(metadata: dict[str, Any], tensors: dict[str, Any], config_path: Path) -> None:
    """Add to the config.json at `config_path` what the GGUF file (`read_gguf`) sets and
    transformers did not read."""
    architecture = metadata["general.architecture"]
    config = json.loads(config_path.read_text())
    if architecture == "phi3":
        factors = {name: [float(v) for v in t.data] for name, t in tensors.items() if name.startswith("rope_factors")}
        _complete_phi3(config, metadata, factors)
    elif architecture == "gemma3":
        _complete_gemma3(config, metadata)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _complete_phi3(config: dict[str, Any], metadata: dict[str, Any], factors: dict[str, list[float]]) -> None:
    rope = dict(config.get("rope_parameters") or {})
    rope.setdefault("rope_type", "default")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary = metadata.get("phi3.rope.dimension_count", head_dim)
    if rotary != head_dim:
        rope["partial_rotary_factor"] = rotary / head_dim
    if "rope_factors_long.weight" in factors:
        original = metadata["phi3.rope.scaling.original_context_length"]
        rope |= {
            "rope_type": "longrope",
            "long_factor": factors["rope_factors_long.weight"],
            "short_factor": factors["rope_factors_short.weight"],
            "original_max_position_embeddings": original,
        }
        if "phi3.rope.scaling.attn_factor" in metadata:
            rope["attention_factor"] = float(metadata["phi3.rope.scaling.attn_factor"])
        config["original_max_position_embeddings"] = original
    config["rope_parameters"] = rope
    if "phi3.attention.sliding_window" in metadata:
        config["sliding_window"] = metadata["phi3.attention.sliding_window"]


def _complete_gemma3(config: dict[str, Any], metadata: dict[str, Any]) -> None:
    if metadata.get("gemma3.rope.scaling.type") != "linear":
        return
    parameters = config.setdefault("rope_parameters", {})
    full = parameters.get("full_attention") or {"rope_theta": metadata.get("gemma3.rope.freq_base", 1_000_000.0)}
    factor = float(metadata["gemma3.rope.scaling.factor"])
    parameters["full_attention"] = full | {"rope_type": "linear", "factor": factor}
