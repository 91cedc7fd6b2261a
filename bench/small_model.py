"""The small random-weight Llama some benchmarks serve: SmolLM2's tokenizer (so prompts are
real text) over 4 layers, so replicas are quick but real and a hop's cost stands out."""

from __future__ import annotations

from pathlib import Path


def build_model(directory: Path) -> Path:
    """A 4-layer random Llama with SmolLM2's tokenizer, saved to `directory`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pagefleet.engine.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct"))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
