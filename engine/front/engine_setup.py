"""Assemble an engine's parts from its config: tokenizer, model, KV cache, runner (the
engine adds its KV connectors and the scheduler over them).

This is where the memory budget becomes a block count, printed at start-up, and where a
tensor-parallel engine starts its workers (engine/distributed/workers.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.core.host_memory import keep_freed_memory
from pagefleet.engine.core.kv_cache_manager import KVCacheManager
from pagefleet.engine.core.kv_groups import KVGroups
from pagefleet.engine.distributed.shard import Shard
from pagefleet.engine.distributed.workers import Workers, init_group
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.front.state_setup import check_state_model, state_cache_budget
from pagefleet.engine.layers.attention import CacheSpec
from pagefleet.engine.layers.backends import select_backend
from pagefleet.engine.loader import resolve_model_dir
from pagefleet.engine.loader.compressed_tensors import is_int8_checkpoint
from pagefleet.engine.loader.source import gguf_file
from pagefleet.engine.loader.tokenizer import load_tokenizer
from pagefleet.engine.lora.manager import LoRAManager
from pagefleet.engine.models import ModelConfig, load_model
from pagefleet.engine.models.loading import CausalLM
from pagefleet.engine.spec_decode.speculator import Speculator
from pagefleet.engine.worker.model_runner import ModelRunner, cache_layer_shapes, kv_bytes_per_block

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    model_dir: Path
    tokenizer: Any
    model: CausalLM
    model_config: ModelConfig
    max_model_len: int
    kv_cache: KVCacheManager
    runner: ModelRunner
    lora: LoRAManager | None  # with enable_lora
    speculator: Speculator | None  # with speculative_config


@dataclass(slots=True)
class DeviceParts:
    """What every tensor-parallel rank builds for itself: its part of the model and of the
    KV cache, and the runner over them."""

    model: CausalLM
    model_config: ModelConfig
    num_blocks: int
    num_host_blocks: int
    runner: ModelRunner
    lora: LoRAManager | None  # rank 0's adapter slots, with enable_lora
    # A model with state layers: (running slots, prefix snapshots, host slots for swapping).
    state_rows: tuple[int, int, int] = (0, 0, 0)


def build_engine_parts(config: EngineConfig) -> EngineParts:
    if config.simulate is not None:  # engine/sim: a cost model in the model's place
        from pagefleet.engine.sim.parts import build_simulated_parts

        return build_simulated_parts(config)
    if config.torch_device.type == "cpu":
        keep_freed_memory()
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, os.cpu_count() or 1))
    model_dir = resolve_model_dir(config.model)
    served_quantization(config, model_dir)  # refused before any worker starts
    tokenizer = None
    if not config.skip_tokenizer_init:
        tokenizer_dir = resolve_model_dir(config.tokenizer) if config.tokenizer else model_dir
        try:
            tokenizer = load_tokenizer(tokenizer_dir)
        except (OSError, ValueError) as error:
            raise InvalidParameterError(
                "tokenizer",
                f"no usable tokenizer in {tokenizer_dir} ({error}); name one with tokenizer=..., "
                "or pass skip_tokenizer_init=True to run on token ids alone",
            ) from error
    workers = _start_workers(config, model_dir) if config.tensor_parallel_size > 1 else None
    try:
        shared_memory = workers.shared_memory if workers is not None else None
        shard = Shard(0, config.tensor_parallel_size, shared_memory=shared_memory)
        device = build_device(config, model_dir, shard, workers)
    except Exception:
        if workers is not None:
            workers.stop()
        raise
    if workers is not None:
        workers.stepping = True
    model, model_config, num_blocks = device.model, device.model_config, device.num_blocks
    groups = device.runner.groups
    cache_limit = groups.admissible_tokens(num_blocks, config.block_size, model_config.max_position_embeddings)
    max_model_len = _resolve_max_model_len(config, model_config, cache_limit)
    num_state_slots, num_snapshots, num_host_state_slots = device.state_rows
    kv_cache = KVCacheManager(
        num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        device.num_host_blocks,
        config.enable_block_sharing,
        groups,
        num_state_slots,
        num_host_state_slots,
        num_snapshots,
        device.runner.state_chunk_size,
        cache_generated_blocks=not device.runner.expand_latent_prefill,
    )
    lora = device.lora
    speculative = config.speculative
    speculator = Speculator(speculative, max_model_len) if speculative is not None else None
    runner = device.runner
    return EngineParts(model_dir, tokenizer, model, model_config, max_model_len, kv_cache, runner, lora, speculator)


def _start_workers(config: EngineConfig, model_dir: Path) -> Workers:
    """The tensor-parallel ranks but rank 0, joined in one process group with this one."""
    if (model_dir / "config.json").is_file() and ModelConfig.from_dir(model_dir).state_layers:
        check_state_model(config)  # before any worker starts
    if dist.is_initialized():
        raise InvalidParameterError(
            "tensor_parallel_size", "one tensor-parallel engine per process, and this process has one running"
        )
    workers = Workers(config, str(model_dir))
    try:
        init_group(0, config.tensor_parallel_size, workers.port, config.torch_device)
    except Exception:
        workers.stop()
        raise
    return workers


def build_device(config: EngineConfig, model_dir: Path, shard: Shard, workers: Workers | None = None) -> DeviceParts:
    """This rank's model part, KV cache and runner (with rank 0's `workers`, and its LoRA
    slots with enable_lora). The block count is the least any rank can hold (each computes
    its own from its budget), so all ranks write the same slots."""
    dtype, device = config.torch_dtype, config.torch_device
    quantization = served_quantization(config, model_dir)
    gguf = gguf_file(config.model) if quantization == "gguf" else None
    model, model_config = load_model(model_dir, dtype, device, shard, gguf, int8=quantization == "compressed-tensors")
    groups = KVGroups.of(model_config.cache_layer_windows, config.hybrid_kv_cache)
    block_bytes = kv_bytes_per_block(model_config, config.block_size, dtype, shard, groups)
    num_state_slots, num_snapshots, state_bytes = state_cache_budget(config, model_config, log=shard.rank == 0)
    num_blocks = config.num_kv_blocks or (config.kv_cache_bytes() - state_bytes) // block_bytes
    if shard.size > 1:
        least = torch.tensor([num_blocks], dtype=torch.int64)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        num_blocks = int(least.item())
    if num_blocks < 1:
        knob = "gpu_memory_utilization" if config.gpu_memory_utilization is not None else "kv_cache_memory"
        raise InvalidParameterError(knob, f"the KV budget holds no block of {block_bytes} bytes; raise {knob}")
    num_host_blocks, num_host_state_slots = _host_swap_space(
        config, block_bytes, num_state_slots, num_snapshots, state_bytes
    )
    state_rows = (num_state_slots, num_snapshots, num_host_state_slots)
    if shard.rank == 0:
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB%s), %d group(s) of %d layers (windows %s), swap blocks=%d",
            num_blocks,
            config.block_size,
            num_blocks * block_bytes / 2**20,
            f" on each of {shard.size} ranks" if shard.size > 1 else "",
            groups.num_groups,
            groups.num_tensors,
            ",".join("full" if w is None else str(w) for w in groups.windows),
            num_host_blocks,
        )
    num_kv_heads, head_dim = map(max, zip(*cache_layer_shapes(model_config, shard), strict=True))
    spec = CacheSpec(num_blocks, config.block_size, num_kv_heads, head_dim, dtype, device)
    backend = select_backend(config.attention_backend, spec)
    if shard.rank == 0:
        logger.info("attention backend: %s", backend.name)
    lora = _lora_slots(config, model) if config.enable_lora and shard.rank == 0 else None
    runner = ModelRunner(
        model,
        model_config,
        groups,
        backend,
        num_blocks,
        num_host_blocks,
        config.block_size,
        dtype,
        device,
        config.seed,
        shard,
        lora,
        workers,
        state_rows,
        expand_latent_prefill=config.mla_prefill == "expanded" and model_config.mla is not None,
    )
    return DeviceParts(model, model_config, num_blocks, num_host_blocks, runner, lora, state_rows)


def _host_swap_space(
    config: EngineConfig, block_bytes: int, num_state_slots: int, num_snapshots: int, state_bytes: int
) -> tuple[int, int]:
    """(host blocks, host state slots) for swap preemption: a state model's swapped-out
    sequences keep their state in a host slot each, out of swap_space; (0, 0) without it."""
    if config.preemption_mode != "swap":
        return 0, 0
    host_state_bytes = state_bytes * num_state_slots // max(1, num_state_slots + num_snapshots)
    return max(0, config.swap_space - host_state_bytes) // block_bytes, num_state_slots


def served_quantization(config: EngineConfig, model_dir: Path) -> str:
    """How the model's weights run: "gguf" (a GGUF file's blocks as stored),
    "compressed-tensors" (an int8 W8A8 checkpoint as int8) or "none" (float). By default
    the model's own on a CPU with one rank (tensor parallelism splits float weights), else
    "none"; "gguf" may also be chosen on one CUDA device (a Triton kernel); a choice that
    cannot apply is refused."""
    own = "gguf" if gguf_file(config.model) else "compressed-tensors" if is_int8_checkpoint(model_dir) else "none"
    device = config.torch_device.type
    single_cpu = device == "cpu" and config.tensor_parallel_size == 1
    if config.quantization is None:
        return own if single_cpu else "none"
    chosen = config.quantization
    if chosen != "none" and chosen != own:
        needs = "a GGUF model" if chosen == "gguf" else "an int8 W8A8 checkpoint"
        raise InvalidParameterError("quantization", f"{chosen} needs {needs}; {config.model!r} is not one")
    if chosen == "gguf" and (device not in ("cpu", "cuda") or config.tensor_parallel_size > 1):
        raise InvalidParameterError("quantization", "gguf runs on a CPU or one CUDA device, tensor_parallel_size=1")
    if chosen == "compressed-tensors" and not single_cpu:
        raise InvalidParameterError("quantization", "compressed-tensors runs on a CPU with tensor_parallel_size=1")
    return chosen


def _lora_slots(config: EngineConfig, model: CausalLM) -> LoRAManager:
    lora = LoRAManager(
        model.lora_targets(), config.max_loras, config.max_lora_rank, config.torch_dtype, config.torch_device
    )
    logger.info(
        "LoRA: %d slots of rank <= %d, %.1f MiB each",
        config.max_loras,
        config.max_lora_rank,
        lora.bytes_per_slot / 2**20,
    )
    return lora


def _resolve_max_model_len(config: EngineConfig, model_config: ModelConfig, cache_limit: int) -> int:
    """`cache_limit`: the longest context the whole cache holds (every group's blocks)."""
    model_limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return min(model_limit, cache_limit)
    if config.max_model_len > model_limit:
        raise InvalidParameterError(
            "max_model_len", f"{config.max_model_len} exceeds the model's limit of {model_limit} tokens"
        )
    if config.max_model_len > cache_limit:
        raise InvalidParameterError(
            "max_model_len",
            f"KV cache too small for max_model_len={config.max_model_len} ({cache_limit} token slots): "
            "raise kv_cache_memory or num_kv_blocks, or lower max_model_len",
        )
    return config.max_model_len
