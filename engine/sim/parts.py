"""A simulated replica's engine parts: the real tokenizer and KV cache manager, sized as
its profile says, over `SimulatedRunner` instead of a model."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.core.kv_cache_manager import KVCacheManager
from pagefleet.engine.core.kv_groups import KVGroups
from pagefleet.engine.loader import resolve_model_dir
from pagefleet.engine.loader.tokenizer import load_tokenizer
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.sim.profiles import profile as find_profile
from pagefleet.engine.sim.runner import SimulatedRunner

if TYPE_CHECKING:
    from pagefleet.engine.front.engine_setup import EngineParts

logger = logging.getLogger(__name__)


def build_simulated_parts(config: EngineConfig) -> EngineParts:
    """The parts of `config.simulate`'s replica; `config.model` gives only the tokenizer
    (and chat template) its requests are read with."""
    from pagefleet.engine.front.engine_setup import EngineParts, _resolve_max_model_len

    assert config.simulate is not None, "a simulated replica's config"
    sim = find_profile(config.simulate)
    model_dir = resolve_model_dir(config.tokenizer or config.model)
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(model_dir)
    vocab_size = len(tokenizer) if tokenizer is not None else 1 << 17
    eos = [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []
    model_config = ModelConfig.from_hf(sim.model | {"vocab_size": vocab_size, "eos_token_id": eos})
    groups = KVGroups.of(model_config.cache_layer_windows, config.hybrid_kv_cache)
    num_blocks = config.num_kv_blocks or sim.num_kv_blocks
    max_model_len = _resolve_max_model_len(
        config,
        model_config,
        groups.admissible_tokens(num_blocks, config.block_size, model_config.max_position_embeddings),
    )
    kv_bytes = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * 2 * config.block_size
    num_host_blocks = config.swap_space // kv_bytes if config.preemption_mode == "swap" else 0
    kv_cache = KVCacheManager(
        num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        num_host_blocks,
        config.enable_block_sharing,
        groups,
    )
    runner = SimulatedRunner(sim, model_config, groups, tokenizer, config.time_scale)
    logger.info(
        "simulated replica %s: %d blocks of %d tokens, swap blocks=%d, time scale %g",
        sim.description,
        num_blocks,
        config.block_size,
        num_host_blocks,
        config.time_scale,
    )
    return EngineParts(model_dir, tokenizer, None, model_config, max_model_len, kv_cache, runner, None, None)  # type: ignore[arg-type]
