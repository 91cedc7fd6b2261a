"""Shared fixtures: tiny random-weight models of every supported architecture, and a Redis.

Each is built from a transformers config, given weights with a large std (the default 0.02
makes tiny tied models repeat one token) and saved with `save_pretrained`, next to a small
byte-level BPE tokenizer trained here, so no file is ever downloaded.
"""

from __future__ import annotations

import os

# Two shared cores: oversubscribed or spin-waiting OpenMP threads make tiny models crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No GPU here: Triton kernels run under its interpreter, which is chosen at @triton.jit time.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.processes import RedisProcess, running_redis  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

TINY_VOCAB = 384
TINY_ARCHITECTURES = [
    *("llama", "mistral", "qwen2", "qwen3"),
    *("gemma2", "gemma3", "gemma4", "smollm3", "granite", "olmo2", "phi3"),
    *("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3", "llama4"),
    "gpt2",
]
# Gated DeltaNet linear-attention layers between full-attention ones (issue 55): their own
# tests (tests/engine/test_linear_attention_models.py), as the KV paths they refuse are many.
LINEAR_ATTENTION_ARCHITECTURES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "granite4", "granite4_dense")
# The families of issue 53: their own code is the model, so the scheduler's and the memory
# paths, which the first families cover in full, run for them in fewer variants.
NEWER_FAMILIES = (
    "gemma2",
    "gemma3",
    "gemma4",
    "smollm3",
    "granite",
    "olmo2",
    "phi3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
    "llama4",
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in blocks.",
    "Hello world! How are you today? I am fine, thank you. Paris is the capital of France.",
    "0123456789 schedulers batch requests continuously; blocks are shared by reference count.",
    "Ünïcödé ✓ 東京 emoji 🚀 test: byte-level BPE must never emit broken UTF-8 characters.",
]


def _tiny_config(arch: str):  # type: ignore[no-untyped-def]
    import transformers as tf

    tied = arch in ("llama", "qwen3", "gpt2")
    common = dict(vocab_size=TINY_VOCAB, initializer_range=0.3, tie_word_embeddings=tied)
    if arch == "gpt2":
        return tf.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=None, eos_token_id=None, **common
        )
    sizes = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if arch == "llama":
        return tf.LlamaConfig(**sizes, **common)
    if arch in ("llama_kv4", "llama_kv1"):  # for tensor parallelism: KV heads split, or replicated
        return tf.LlamaConfig(**sizes | dict(num_key_value_heads=int(arch[-1])), **common)
    if arch == "llama_slow":  # wide and deep enough that a step takes milliseconds
        wide = sizes | dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8)
        return tf.LlamaConfig(**wide, **common)
    if arch == "mistral":
        return tf.MistralConfig(**sizes, sliding_window=None, **common)
    if arch == "mistral_window":  # each query sees only its last 8 keys
        return tf.MistralConfig(**sizes, sliding_window=8, **common)
    if arch == "qwen2":
        return tf.Qwen2Config(**sizes, **common)
    if arch == "smollm3":  # the second layer has no RoPE
        return tf.SmolLM3Config(**sizes, no_rope_layers=[1, 0], **common)
    if arch == "granite":
        multipliers = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1)
        return tf.GraniteConfig(**sizes, **multipliers, logits_scaling=2.0, **common)
    if arch == "olmo2":
        return tf.Olmo2Config(**sizes, **common)
    if arch == "phi3":  # q/k/v and gate/up stored fused; RoPE on the first half of each head only,
        # LongRoPE's two sets of factors past 24 tokens (of the exactness tests' prompts, those of
        # 33 and 48 tokens rotate by the long set, and one of 17 crosses over as it decodes).
        factors = dict(short_factor=[1.0, 1.3, 2.0, 3.1], long_factor=[1.5, 4.0, 9.0, 17.0])
        longrope = dict(rope_type="longrope", **factors, original_max_position_embeddings=24)
        return tf.Phi3Config(
            **sizes, partial_rotary_factor=0.5, original_max_position_embeddings=24, rope_scaling=longrope, **common
        )
    # Mixtures of experts: 4 experts, 2 a token; Qwen3-MoE's first layer dense (mlp_only_layers),
    # Qwen2-MoE's shared expert, Mixtral's experts as wide as intermediate_size.
    experts = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **sizes, head_dim=16, num_experts=4, **experts, norm_topk_prob=True, mlp_only_layers=[0], **common
        )
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**sizes, num_experts=4, **experts, shared_expert_intermediate_size=48, **common)
    if arch == "mixtral":
        return tf.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2, **common)
    if arch == "gpt_oss":  # a sliding layer (window 8) and a full one, sinks, YaRN past 16
        # positions, experts with biases and a SwiGLU clamped low enough to bite here
        yarn = dict(rope_type="yarn", factor=4.0, beta_fast=8.0, beta_slow=1.0, truncate=False)
        return tf.GptOssConfig(
            **sizes | dict(intermediate_size=32),
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            swiglu_limit=2.0,
            rope_parameters=yarn | dict(rope_theta=10000.0, original_max_position_embeddings=16),
            **common,
        )
    if arch == "llama4":  # layers of 8-position chunks with RoPE (interleaved pairs) and L2-normed
        # q and k, between global NoPE layers whose queries' temperature rises every 4 positions;
        # experts (top 1) and a shared expert on the second and fourth layers
        return tf.Llama4TextConfig(
            **sizes | dict(num_hidden_layers=4, intermediate_size=32),
            head_dim=16,
            intermediate_size_mlp=128,
            num_local_experts=4,
            num_experts_per_tok=1,
            moe_layers=[1, 3],
            no_rope_layers=[1, 0, 1, 0],
            attention_chunk_size=8,
            floor_scale=4,
            attn_scale=0.5,
            architectures=["Llama4ForCausalLM"],
            **common,
        )
    if arch == "deepseek_v3":  # latent attention (a 32-wide latent, 16 RoPE dims, interleaved),
        # YaRN with mscale past 16 positions, 8 experts in 4 groups (the best 2 eligible), top 2,
        # a shared expert, the first layer dense
        yarn = dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=16)
        latent = dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24)
        return tf.DeepseekV3Config(
            **sizes | dict(num_key_value_heads=4),
            **latent,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            rope_parameters=yarn | dict(rope_theta=10000.0),
            **common,
        )
    if arch in LINEAR_ATTENTION_ARCHITECTURES:  # linear, full, linear, full; two value heads per
        # key head; Qwen3-Next's first layer dense, then experts with a shared one; Qwen3.5-MoE's
        # experts on every layer
        linear = dict(
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            layer_types=["linear_attention", "full_attention"] * 2,
        )
        four_layers = sizes | dict(num_hidden_layers=4)
        if arch.startswith("granite4"):  # Mamba-2: 8 heads of 16 in 2 groups, a 16-wide state; no
            # RoPE and experts beside the shared MLP, or RoPE and the shared MLP alone
            mamba = dict(mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=16, mamba_expand=2)
            multipliers = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1)
            moe = dict(num_local_experts=4, num_experts_per_tok=2, position_embedding_type="nope")
            return tf.GraniteMoeHybridConfig(
                **four_layers | dict(intermediate_size=32),
                **mamba,
                **multipliers,
                layer_types=["mamba", "attention"] * 2,
                shared_intermediate_size=48,
                logits_scaling=2.0,
                **(dict(num_local_experts=0, position_embedding_type="rope") if arch == "granite4_dense" else moe),
                **common,
            )
        experts = experts | dict(num_experts=4, shared_expert_intermediate_size=48)
        if arch == "qwen3_next":
            return tf.Qwen3NextConfig(**four_layers, **linear, **experts, mlp_only_layers=[0], **common)
        if arch == "qwen3_5_moe":
            return tf.Qwen3_5MoeTextConfig(**four_layers, **linear, **experts, **common)
        return tf.Qwen3_5TextConfig(**four_layers, **linear, **common)
    # Gemma: a sliding layer (window 8, shorter than most test prompts) and a global one,
    # a scale from query_pre_attn_scalar unlike head_dim's.
    gemma = sizes | dict(
        head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8
    )
    if arch == "gemma2":  # soft-capped scores and logits (caps low enough to bite here)
        return tf.Gemma2Config(**gemma, attn_logit_softcapping=5.0, final_logit_softcapping=8.0, **common)
    if arch == "gemma3":  # q/k norms; sliding layers on their own RoPE base
        return tf.Gemma3TextConfig(**gemma, **common)
    if arch == "gemma4":  # global layers of another head size and fewer KV heads, keys as values,
        # proportional RoPE; the last two layers read the first two's KV; per-layer embeddings,
        # double-wide MLPs, routed experts beside them
        global_layers = dict(global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True)
        shared = dict(num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8)
        experts = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
        return tf.Gemma4TextConfig(
            **gemma | dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2),
            **global_layers,
            **shared,
            **experts,
            vocab_size_per_layer_input=TINY_VOCAB,
            final_logit_softcapping=8.0,
            architectures=["Gemma4ForCausalLM"],
            **common,
        )
    return tf.Qwen3Config(**sizes, head_dim=32, **common)  # head_dim != hidden / heads


def _build_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast


def build_tiny_model(arch: str, directory: Path, seed: int = 0) -> Path:
    # GPT-2 keeps transformers' own init (std 0.3 from the config); random LayerNorm and
    # bias values make it collapse to one token.
    # Gemma 4's many branches saturate at the others' scale: every prompt would repeat one token.
    std = 0.1 if arch.startswith("gemma4") else 0.3
    return build_random_model(_tiny_config(arch), directory, seed, randomise=arch != "gpt2", std=std)


def build_random_model(config, directory: Path, seed: int = 0, randomise: bool = True, std: float = 0.3) -> Path:  # type: ignore[no-untyped-def]
    """A model of `config` with large random weights, norms and Gemma 4's layer scalars
    around 1 (and random biases, so that Qwen2's qkv bias and Qwen3's q/k norms are really
    exercised), saved to `directory` beside the tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters() if randomise else []:
            if "norm" in name or ".ln_" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("sinks"):  # gpt-oss: some heads' sinks above their scores
                param.uniform_(-2.0, 6.0)
            else:
                param.normal_(0.0, std)
        for name, buffer in model.named_buffers() if randomise else []:
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):  # DeepSeek's routing bias
                buffer.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    _build_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(arch, root / arch) for arch in TINY_ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_mistral_window(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("mistral_window", tmp_path_factory.mktemp("tiny-mistral-window"))


@pytest.fixture(scope="session")
def slow_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama slow enough (several ms a token) that a test can leave a request mid-way."""
    return build_tiny_model("llama_slow", tmp_path_factory.mktemp("slow-llama"))


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    """Debian's redis-server on a free loopback port, for one test."""
    with running_redis() as server:
        yield server
