"""Random-weight models in a real model's shape, for speed comparisons (no model hub here).

Built once with transformers from its own config class and saved as an HF directory under
the pagefleet cache (`$PAGEFLEET_CACHE_DIR/bench-models/<name>`), with a word-level
tokenizer as wide as the model's vocabulary, so that every token id either engine samples
decodes. Both engines read the same directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import progress


def _gemma3_270m() -> Any:
    """Gemma 3 270M's published config (google/gemma-3-270m): 18 layers, every sixth global,
    the others a 512-token window; one KV head of 256 dims; a 262,144-token vocabulary."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
        max_position_embeddings=32768,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )


SHAPES: dict[str, Callable[[], Any]] = {"gemma3-270m": _gemma3_270m}


def shaped_model_dir(name: str) -> Path:
    """The directory of the random-weight model `name` (one of SHAPES), built on first use."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagefleet.engine.loader.gguf_cache import cache_root

    target = cache_root() / "bench-models" / name
    if (target / "config.json").exists():
        return target
    progress(f"building a random-weight {name} in {target} (once)")
    config = SHAPES[name]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    staging = target.with_name(target.name + ".partial")
    model.save_pretrained(staging)
    _word_tokenizer(config.vocab_size).save_pretrained(staging)
    staging.rename(target)
    return target


def _word_tokenizer(vocab_size: int) -> Any:
    """A tokenizer with one word per token id ("<t17>"), so any sampled id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<t3>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<t2>", eos_token="<t1>", pad_token="<t0>", unk_token="<t3>"
    )
