"""What a simulated replica models: the model's KV layout and the hardware's step costs.

A step's time (cost_model.py) is

    overhead + max(weights_read, tokens * token_compute)
             + sum over chunks of (kv_tokens_read * kv_read + query_key_pairs * attention_pair)

`weights_read` is the floor of any forward pass (every weight read once: what bounds a
decode step on a GPU), `token_compute` the linear layers' cost per token (what bounds a
prefill), and the attention terms grow with each chunk's context. The KV capacity is what
vLLM's default budget leaves for the cache on that hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagefleet.engine.errors import InvalidParameterError

# Llama-3-8B and -70B as their config.json says (Meta's model cards: 8.03B and 70.6B
# parameters; grouped-query attention with 8 KV heads of 128 dims).
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
}
LLAMA3_70B: dict[str, Any] = LLAMA3_8B | {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}
# SmolLM2-135M's config (the model pagefleet up serves).
SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
}

# NVIDIA's H100 SXM5 datasheet: 3.35 TB/s of HBM3, 989 TFLOPS of dense bfloat16.
H100_BYTES_PER_S = 3.35e12
H100_FLOPS = 989e12
# What serving engines reach of those peaks (assumed, as is common in roofline estimates):
# 70% of the bandwidth in decode, 45% of the FLOPs in prefill.
BANDWIDTH_EFFICIENCY = 0.70
FLOPS_EFFICIENCY = 0.45


@dataclass(frozen=True, slots=True)
class SimProfile:
    """One replica's hardware and model, as the cost model and the KV cache see them."""

    name: str
    description: str
    model: dict[str, Any]  # the KV layout's model, as a config.json (ModelConfig.from_hf)
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    step_overhead_s: float  # scheduling and launching: every step pays it
    weights_read_s: float  # the least a forward pass takes
    token_compute_s: float  # per token computed
    kv_read_s: float  # per cached token a chunk's attention reads
    attention_pair_s: float  # per (query, key) pair attention computes
    swap_block_s: float  # per KV block copied to or from host memory
    answer_tokens: int = 128  # a request without ignore_eos ends with EOS after this many tokens
    block_size: int = 16


def _gpu_profile(
    name: str, model: dict[str, Any], params: float, gpus: int, kv_tokens: int, overhead_s: float
) -> SimProfile:
    """A dense model's roofline on `gpus` H100s with tensor parallelism (weights and FLOPs
    split evenly), in bfloat16."""
    layers, kv_heads = model["num_hidden_layers"], model["num_key_value_heads"]
    head_dim = model["hidden_size"] // model["num_attention_heads"]
    bandwidth, flops = gpus * H100_BYTES_PER_S * BANDWIDTH_EFFICIENCY, gpus * H100_FLOPS * FLOPS_EFFICIENCY
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * 2  # keys and values, bfloat16
    pair_flops = 4 * layers * model["num_attention_heads"] * head_dim  # QK^T and PV
    return SimProfile(
        name=name,
        description=f"{name}: {params / 1e9:.0f}B parameters on {gpus} H100, {kv_tokens} KV tokens",
        model=model,
        num_kv_blocks=kv_tokens // 16,
        max_num_seqs=256,  # vLLM's defaults on a GPU
        max_num_batched_tokens=8192,
        step_overhead_s=overhead_s,
        weights_read_s=2 * params / bandwidth,
        token_compute_s=2 * params / flops,
        kv_read_s=kv_bytes_per_token / bandwidth,
        attention_pair_s=pair_flops / flops,
        swap_block_s=16 * kv_bytes_per_token / 25e9,  # PCIe 5 x16 at about 25 GB/s each way
    )


PROFILES: dict[str, SimProfile] = {
    # Llama-3-8B on one H100 80GB: vLLM's gpu_memory_utilization 0.9 leaves 72 GB, the
    # bfloat16 weights take 16 GB and activations a few: about 450,000 tokens of 128 KiB.
    # The roofline gives 8.4 ms a decode step at small batches (6.9 ms reading the weights)
    # and 25,000 tokens/s for a 6,000-token prefill (28,000 for the linear layers alone).
    "gpu-8b": _gpu_profile("gpu-8b", LLAMA3_8B, 8.03e9, 1, 450_000, 1.5e-3),
    # Llama-3-70B on four H100s (tensor parallel): 288 GB budget, 141 GB of weights, KV of
    # 320 KiB a token: about 420,000 tokens; all-reduces add to every step.
    "gpu-70b-tp4": _gpu_profile("gpu-70b-tp4", LLAMA3_70B, 70.6e9, 4, 420_000, 3.0e-3),
    # SmolLM2-135M-Instruct as `pagefleet up` serves it on this repository's CI machine (2
    # vCPU, AVX2; Q4_1 weights, float32, one thread): fitted by bench/sim_calibrate.py.
    "cpu-smollm2": SimProfile(
        name="cpu-smollm2",
        description="cpu-smollm2: SmolLM2-135M on one core of this machine (bench/sim_calibrate.py)",
        model=SMOLLM2_135M,
        num_kv_blocks=4096,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        # Fitted 2026-12-02 on a quiet machine: 328 steps, |model/measured - 1| p50 7% (decode)
        # and 3% (prefill), the grid's total 0.98x. One core does about 215 prompt tokens/s.
        step_overhead_s=9.4e-3,
        weights_read_s=0.0,
        token_compute_s=3.0e-3,
        kv_read_s=6.5e-6,
        attention_pair_s=3.3e-6,
        swap_block_s=2.0e-5,
    ),
}


def profile(name: str) -> SimProfile:
    """The profile called `name`.

    Raises:
        InvalidParameterError: no such profile (naming the ones there are).
    """
    if name not in PROFILES:
        raise InvalidParameterError("simulate", f"no profile {name!r}; profiles: {', '.join(PROFILES)}")
    return PROFILES[name]
