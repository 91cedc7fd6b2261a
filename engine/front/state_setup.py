"""The state cache's share of the memory budget, for a model with state layers (engine/
worker/state_cache.py): one slot per sequence `max_num_seqs` lets run, taken from the KV
budget before it becomes blocks, and what such a model cannot run with yet."""

from __future__ import annotations

import logging

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.worker.state_cache import state_bytes_per_slot

logger = logging.getLogger(__name__)


def state_cache_budget(config: EngineConfig, model_config: ModelConfig, log: bool = True) -> tuple[int, int, int]:
    """(running slots, snapshot rows, bytes of both) of the state cache; zeros for a model
    without state layers. With prefix caching, as many snapshots as slots."""
    if not model_config.state_layers:
        return 0, 0, 0
    check_state_model(config)
    num_slots = config.max_num_seqs
    num_snapshots = num_slots if config.enable_prefix_caching else 0
    num_bytes = (num_slots + num_snapshots) * state_bytes_per_slot(model_config, config.torch_dtype)
    if num_bytes >= config.kv_cache_bytes() and not config.num_kv_blocks:
        raise InvalidParameterError(
            "max_num_seqs",
            f"the state cache's {num_slots} slots and {num_snapshots} prefix snapshots take "
            f"{num_bytes / 2**20:.0f} MiB, the whole KV budget: lower max_num_seqs or raise kv_cache_memory",
        )
    if log:
        logger.info(
            "state cache: %d slots and %d prefix snapshots for %d state layers (%.1f MiB)",
            num_slots,
            num_snapshots,
            len(model_config.state_layers),
            num_bytes / 2**20,
        )
    return num_slots, num_snapshots, num_bytes


def check_state_model(config: EngineConfig) -> None:
    """What a model with state layers cannot run with yet, refused by the setting's name:
    each shards or branches KV without the state beside it. KV that leaves the replica (P/D,
    the file tier) moves with the state snapshots the prefix cache keeps, so it needs them."""
    refused = {
        "tensor_parallel_size": config.tensor_parallel_size > 1,
        "speculative_config": config.speculative is not None,
        "enable_lora": config.enable_lora,
    }
    for name, is_set in refused.items():
        if is_set:
            raise InvalidParameterError(name, f"{name} is not supported yet for models with linear-attention layers")
    moving = {"kv_role": config.kv_role != "both", "kv_cache_dir": config.kv_cache_dir is not None}
    for name, is_set in moving.items():
        if is_set and not config.enable_prefix_caching:
            raise InvalidParameterError(
                name,
                f"{name} needs enable_prefix_caching for models with linear-attention layers: their state "
                "moves as the prefix cache's state snapshots",
            )
