"""Our own model code (not transformers' modules), one file per family."""

from __future__ import annotations

from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.gpt2 import GPT2LMHeadModel
from pagefleet.engine.models.llama import LlamaForCausalLM
from pagefleet.engine.models.loading import load_model
from pagefleet.engine.models.registry import SUPPORTED_ARCHITECTURES

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "load_model", "GPT2LMHeadModel", "LlamaForCausalLM"]
