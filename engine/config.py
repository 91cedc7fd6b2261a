"""Engine settings: one dataclass that checks itself and says how to fix a bad value."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.kv_transfer.params import ROLES
from pagefleet.engine.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_CPU_KV_BYTES = 1 << 30


def _fail(param: str, message: str) -> NoReturn:
    raise InvalidParameterError(param, message)


@dataclass(slots=True)
class EngineConfig:
    """Settings of one engine instance (constructor arguments of `LLM` and `AsyncEngine`).

    Args:
        model: a built-in name (`smollm2-135m-instruct`), a Hugging Face directory or a
            `.gguf` file.
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16".
        block_size: token slots per KV block.
        kv_cache_memory: KV budget; a value <= 1 is a fraction of free device memory, a
            larger one is bytes. Default: 1 GiB on CPU, 0.8 of free memory on CUDA.
        num_kv_blocks: an explicit block count; overrides `kv_cache_memory`.
        max_model_len: longest prompt + output; default the model's own limit, capped at
            what the cache holds.
        max_num_seqs: most sequences running in one step.
        max_num_batched_tokens: most tokens computed in one step (long prompts are
            prefilled in chunks of at most this).
        enable_prefix_caching: reuse the KV of full blocks whose tokens were seen before.
        enable_block_sharing: samples and beams of one request share their common blocks
            (copy-on-write). Turn off only to measure what sharing saves.
        disable_hybrid_kv_cache_manager: as vLLM's flag, keep every block of sliding-window
            layers too (one KV cache group). By default layers are grouped by window and a
            sliding group frees the blocks that fall behind its window (docs/engine.md).
            Turned on by itself with `kv_cache_dir` or a `kv_role` other than "both": KV
            transfers move one group's blocks.
        preemption_mode: "recompute" or "swap" (to a host pool of `swap_space` bytes).
        seed: seed of the engine's own random generator (requests without a seed).
        device: "auto", "cpu" or "cuda".
        attention_backend: "auto" (Triton on CUDA; on a CPU the compiled operator, or plain
            torch if it cannot be built), "cpu", "torch" or "triton".
        mla_prefill: how latent-attention models (DeepSeek-V3) attend in a prompt's rows.
            "expanded" (default, as vLLM): over keys and values expanded per head, about 2x
            the prompt throughput; generated tokens stay absorbed and only prompt blocks
            serve the prefix cache, so that an answer never depends on the path.
            "absorbed": in the latent space, as decodes do, every block cached (docs/engine.md).
        tokenizer: a directory (or built-in name) to take the tokenizer from; default the
            model's own.
        skip_tokenizer_init: load no tokenizer: prompts must be token ids, outputs carry
            token ids and no text (as vLLM's option).
        gpu_memory_utilization: vLLM's memory knob. On CUDA, the fraction of the device's
            memory for weights and KV cache together (the KV cache gets what the loaded
            model leaves of it); on CPU, the fraction of free host memory for the KV cache.
            Give it or `kv_cache_memory`, not both.
        enforce_eager: accepted for vLLM's sake: the engine never captures graphs.
        trust_remote_code: only False: the engine runs its own code for the architectures
            it knows and never a checkpoint's Python.
        kv_role: "both" (default: whole requests, and either side of a KV transfer),
            "prefill" (prompts whose KV decode replicas pull: `do_remote_decode`) or
            "decode" (requests whose prompt KV is pulled from a prefill replica).
        kv_pin_timeout: seconds a prefill replica keeps a finished prompt's blocks for a
            decode replica to pull before it frees them.
        enable_lora: serve LoRA adapters (`LoRARequest`) over the base model, mixed in one
            batch; `max_loras` adapters sit in device slots at once, of rank at most
            `max_lora_rank`.
        tensor_parallel_size: devices (on a CPU: processes) the model is split across,
            Megatron-style; this process is rank 0 and starts the others (docs/engine.md).
        max_logprobs: the most `logprobs` and `prompt_logprobs` a request may ask for (as
            vLLM's, 20 by default); -1 for the whole vocabulary.
        kv_cache_dir: a directory for the file tier of the KV cache, shared by a model's
            replicas: full blocks are written there in the background and a prompt's
            stored prefix is read back when that beats computing it (docs/kv-tiers.md).
            None (default): no file tier.
        kv_cache_dir_size_gib: the most the file tier's directory holds, in GiB (least
            recently used blocks are evicted first).
        speculative_config: speculative decoding without a draft model, in vLLM's shape:
            `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
            "prompt_lookup_max": 5}`; the engine verifies the drafts only while that is
            faster on the current load (docs/engine.md). None (default): off.
        quantization: how a quantized model's weights are served (vLLM's `--quantization`):
            "gguf" keeps a GGUF file's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K tensors as stored and
            multiplies them with int8 dot products on a CPU (a Triton kernel on one CUDA
            device; other types are dequantized); "compressed-tensors" runs an int8 W8A8 checkpoint's layers as
            int8 GEMMs; "none" dequantizes every weight to `dtype`. Default: the model's
            own ("gguf" for a `.gguf` file or a built-in, "compressed-tensors" for a
            checkpoint whose config says so) on a CPU with one rank, else "none".
        simulate: a cost-model profile (engine/sim/profiles.py: `gpu-8b`, `gpu-70b-tp4`,
            `cpu-smollm2`): the scheduler, KV cache and prefix cache run for real, the model
            does not; each step sleeps for the profile's time of it, and `model` gives only the
            tokenizer (docs/routing.md). None (default): a real model.
        time_scale: with `simulate`, every modelled duration is stretched this many times (a
            fleet of fast GPUs then fits a few CPU cores).
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: float | None = None
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_block_sharing: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    preemption_mode: str = "recompute"
    swap_space: int = 1 << 30
    seed: int = 0
    device: str = "auto"
    attention_backend: str = "auto"
    mla_prefill: str = "expanded"
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    trust_remote_code: bool = False
    kv_role: str = "both"
    kv_pin_timeout: float = 60.0
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    tensor_parallel_size: int = 1
    max_logprobs: int = 20
    kv_cache_dir: str | None = None
    kv_cache_dir_size_gib: float = 10.0
    speculative_config: dict[str, Any] | None = None
    quantization: str | None = None
    simulate: str | None = None
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_choices()
        self._check_combinations()

    def _check_sizes(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            _fail("block_size", f"must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            _fail("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            _fail("kv_cache_memory", f"must be > 0, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len < 1:
            _fail("max_model_len", f"must be >= 1, got {self.max_model_len}")
        if self.kv_cache_dir_size_gib <= 0:
            _fail("kv_cache_dir_size_gib", f"must be > 0, got {self.kv_cache_dir_size_gib}")
        if self.max_logprobs < -1:
            _fail("max_logprobs", f"must be >= 0, or -1 for the whole vocabulary; got {self.max_logprobs}")
        if self.max_num_seqs < 1:
            _fail("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            _fail("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        if self.swap_space < 0:
            _fail("swap_space", f"must be >= 0 bytes, got {self.swap_space}")
        if self.max_loras < 1:
            _fail("max_loras", f"must be >= 1, got {self.max_loras}")
        if self.kv_pin_timeout <= 0:
            _fail("kv_pin_timeout", f"must be > 0 seconds, got {self.kv_pin_timeout}")
        if self.tensor_parallel_size < 1:
            _fail("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")

    def _check_choices(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            _fail("dtype", f"must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.mla_prefill not in ("absorbed", "expanded"):
            _fail("mla_prefill", f"must be 'absorbed' or 'expanded', got {self.mla_prefill!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            _fail("preemption_mode", f"must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            _fail("device", f"must be auto, cpu or cuda; got {self.device!r}")
        if self.trust_remote_code:
            _fail(
                "trust_remote_code",
                "remote code is never run: only the built-in architectures are supported (leave it False)",
            )
        if self.kv_role not in ROLES:
            _fail("kv_role", f"must be prefill, decode or both; got {self.kv_role!r}")
        if self.max_lora_rank not in (8, 16, 32, 64, 128, 256, 320, 512):
            _fail(
                "max_lora_rank",
                f"must be one of 8, 16, 32, 64, 128, 256, 320, 512 (as vLLM's); got {self.max_lora_rank}",
            )
        if self.quantization not in (None, "gguf", "compressed-tensors", "none"):
            _fail("quantization", f"must be gguf, compressed-tensors or none; got {self.quantization!r}")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            _fail("attention_backend", f"must be auto, cpu, torch or triton; got {self.attention_backend!r}")

    def _check_combinations(self) -> None:
        if self.kv_cache_dir is not None and self.tensor_parallel_size > 1:
            _fail("kv_cache_dir", "the file tier serves one process's cache: not with tensor_parallel_size > 1")
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                _fail("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
            if self.kv_cache_memory is not None:
                _fail("gpu_memory_utilization", "give it or kv_cache_memory, not both")
        if self.tensor_parallel_size > 1 and self.enable_lora:
            _fail("tensor_parallel_size", "LoRA adapters are not yet served with tensor parallelism (enable_lora)")
        if self.tensor_parallel_size > 1 and self.kv_role != "both":
            _fail("tensor_parallel_size", "prefill/decode disaggregation (kv_role) needs tensor_parallel_size=1")
        if self.speculative_config is not None:
            self.speculative  # noqa: B018 (parsing checks it)
        if self.time_scale <= 0:
            _fail("time_scale", f"must be > 0, got {self.time_scale}")
        if self.simulate is not None:
            self._check_simulated()

    def _check_simulated(self) -> None:
        """A simulated replica holds no KV to move and no weights to adapt."""
        from pagefleet.engine.sim.profiles import profile

        profile(self.simulate or "")
        unmodelled = {
            "kv_cache_dir": self.kv_cache_dir is not None,
            "kv_role": self.kv_role != "both",
            "enable_lora": self.enable_lora,
            "tensor_parallel_size": self.tensor_parallel_size > 1,
            "speculative_config": self.speculative_config is not None,
        }
        for name, asked in unmodelled.items():
            if asked:
                _fail(name, "a simulated replica (simulate) holds no KV or weights: not with it")

    @property
    def hybrid_kv_cache(self) -> bool:
        """Whether layers of different windows get KV cache groups of their own (the KV
        connectors move blocks per group)."""
        return not self.disable_hybrid_kv_cache_manager

    @property
    def speculative(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    def kv_cache_bytes(self) -> int:
        """The KV budget in bytes, resolving a fraction against free device memory (called
        once the model's weights are loaded)."""
        device = self.torch_device
        if self.gpu_memory_utilization is not None:
            if device.type == "cuda":
                total = torch.cuda.get_device_properties(device).total_memory
                return max(0, int(self.gpu_memory_utilization * total) - torch.cuda.memory_allocated(device))
            return int(self.gpu_memory_utilization * _free_device_memory(device))
        budget = self.kv_cache_memory
        if budget is None:
            budget = 0.8 if device.type == "cuda" else _DEFAULT_CPU_KV_BYTES
        if budget > 1:
            return int(budget)
        return int(budget * _free_device_memory(device))


def simulated_defaults(profile_name: str) -> dict[str, int]:
    """The batch limits a simulated replica takes from its profile (engine/sim/profiles.py)
    where its caller gave none: vLLM's defaults on the hardware it models. Empty for an
    unknown profile (EngineConfig refuses it, naming the ones there are)."""
    from pagefleet.engine.sim.profiles import PROFILES

    profile = PROFILES.get(profile_name)
    if profile is None:
        return {}
    return {"max_num_seqs": profile.max_num_seqs, "max_num_batched_tokens": profile.max_num_batched_tokens}


def _free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
