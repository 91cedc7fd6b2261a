"""Assemble an engine's parts from its config: tokenizer, model, KV cache, scheduler.

This is where the memory budget becomes a block count, printed at start-up.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.host_memory import keep_freed_memory
from pagefleet.engine.kv_cache_manager import KVCacheManager
from pagefleet.engine.layers.attention import CacheSpec
from pagefleet.engine.layers.backends import select_backend
from pagefleet.engine.loader import resolve_model_dir
from pagefleet.engine.lora.manager import LoRAManager
from pagefleet.engine.model_runner import ModelRunner, kv_bytes_per_block
from pagefleet.engine.models import ModelConfig, load_model
from pagefleet.engine.models.loading import CausalLM
from pagefleet.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    model_dir: Path
    tokenizer: Any
    model: CausalLM
    model_config: ModelConfig
    max_model_len: int
    kv_cache: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    lora: LoRAManager | None  # with enable_lora


def build_engine_parts(config: EngineConfig) -> EngineParts:
    from transformers import AutoTokenizer

    if config.torch_device.type == "cpu":
        keep_freed_memory()
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, os.cpu_count() or 1))
    model_dir = resolve_model_dir(config.model)
    tokenizer = None
    if not config.skip_tokenizer_init:
        tokenizer_dir = resolve_model_dir(config.tokenizer) if config.tokenizer else model_dir
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        except (OSError, ValueError) as error:
            raise InvalidParameterError(
                "tokenizer",
                f"no usable tokenizer in {tokenizer_dir} ({error}); name one with tokenizer=..., "
                "or pass skip_tokenizer_init=True to run on token ids alone",
            ) from error
    dtype, device = config.torch_dtype, config.torch_device
    model, model_config = load_model(model_dir, dtype, device)
    block_bytes = kv_bytes_per_block(model_config, config.block_size, dtype)
    num_blocks = config.num_kv_blocks or config.kv_cache_bytes() // block_bytes
    if num_blocks < 1:
        knob = "gpu_memory_utilization" if config.gpu_memory_utilization is not None else "kv_cache_memory"
        raise InvalidParameterError(knob, f"the KV budget holds no block of {block_bytes} bytes; raise {knob}")
    max_model_len = _resolve_max_model_len(config, model_config, num_blocks)
    num_host_blocks = config.swap_space // block_bytes if config.preemption_mode == "swap" else 0
    logger.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens), max_model_len=%d, swap blocks=%d",
        num_blocks,
        config.block_size,
        num_blocks * block_bytes / 2**20,
        num_blocks * config.block_size,
        max_model_len,
        num_host_blocks,
    )
    kv_cache = KVCacheManager(
        num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks, config.enable_block_sharing
    )
    spec = CacheSpec(
        num_blocks,
        config.block_size,
        model_config.num_kv_heads,
        model_config.head_dim,
        dtype,
        device,
        model_config.sliding_window,
    )
    lora = None
    if config.enable_lora:
        lora = LoRAManager(model.lora_targets(), config.max_loras, config.max_lora_rank, dtype, device)
        logger.info(
            "LoRA: %d slots of rank <= %d, %.1f MiB each",
            config.max_loras,
            config.max_lora_rank,
            lora.bytes_per_slot / 2**20,
        )
    backend = select_backend(config.attention_backend, spec)
    logger.info("attention backend: %s", backend.name)
    runner = ModelRunner(
        model,
        model_config,
        backend,
        num_blocks,
        num_host_blocks,
        config.block_size,
        dtype,
        device,
        config.seed,
        lora,
    )
    scheduler = Scheduler(config, kv_cache, lora)
    return EngineParts(model_dir, tokenizer, model, model_config, max_model_len, kv_cache, scheduler, runner, lora)


def _resolve_max_model_len(config: EngineConfig, model_config: ModelConfig, num_blocks: int) -> int:
    model_limit = model_config.max_position_embeddings
    cache_limit = num_blocks * config.block_size
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
