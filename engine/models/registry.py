"""Which architectures pagefleet serves, and the file under engine/models/ that runs each.

One entry per model family: the next architecture is a file of its own and a line here.
`docs/engine.md`'s list of supported models is this table (tests/engine/test_models.py
checks that they agree).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import nn


@dataclass(slots=True, frozen=True)
class Family:
    name: str  # engine/models/<name>.py
    model_class: str  # the nn.Module class in that file
    architectures: tuple[str, ...]  # the `architectures` of an HF config.json it serves


FAMILIES = (
    Family(
        "llama",
        "LlamaForCausalLM",
        ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM"),
    ),
    Family("granite", "GraniteForCausalLM", ("GraniteForCausalLM",)),
    Family(
        "moe",
        "MoEForCausalLM",
        ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM"),
    ),
    Family("deepseek", "DeepseekV3ForCausalLM", ("DeepseekV3ForCausalLM",)),
    Family(
        "qwen3_next",
        "Qwen3NextForCausalLM",
        (
            "Qwen3NextForCausalLM",
            "Qwen3_5ForCausalLM",
            "Qwen3_5MoeForCausalLM",
            "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForConditionalGeneration",
        ),
    ),
    Family("llama4", "Llama4ForCausalLM", ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")),
    Family("granite_hybrid", "GraniteMoeHybridForCausalLM", ("GraniteMoeHybridForCausalLM",)),
    Family("olmo2", "Olmo2ForCausalLM", ("Olmo2ForCausalLM",)),
    Family("phi3", "Phi3ForCausalLM", ("Phi3ForCausalLM",)),
    Family("gemma", "GemmaForCausalLM", ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")),
    Family("gemma4", "Gemma4ForCausalLM", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")),
    Family("gpt2", "GPT2LMHeadModel", ("GPT2LMHeadModel",)),
)

# Image (and audio) checkpoints whose language model is served, text in and text out: the
# text model's architecture (their towers' weights are skipped, engine/models/loading.py).
LANGUAGE_MODEL_OF = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",  # Qwen3.5 as released
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}

# HF architecture name -> our model family.
SUPPORTED_ARCHITECTURES = {architecture: family.name for family in FAMILIES for architecture in family.architectures}


def model_class(family_name: str) -> type[nn.Module]:
    """The module class of a family, imported on first use (one family's file per model)."""
    family = next(f for f in FAMILIES if f.name == family_name)
    module = importlib.import_module(f"pagefleet.engine.models.{family.name}")
    cls: type[nn.Module] = getattr(module, family.model_class)
    return cls
