"""The state cache's share of the memory budget, for a model with state layers (engine/
worker/state_cache.py): one slot per sequence `max_num_seqs` lets run, taken from the KV
budget before it becomes blocks, and what such a model cannot run with yet.

A real Qwen3.5's state is tens of MiB per sequence, so `max_num_seqs`' default of 256 slots
(and as many prefix snapshots) would not fit a default budget: the slots are then lowered
until the state cache takes at most half of it, with a warning, so that such a model serves
at its defaults; the engine runs no more sequences at once than it has slots."""

from __future__ import annotations

import logging

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.worker.state_cache import state_bytes_per_slot

logger = logging.getLogger(__name__)

STATE_SHARE = 0.5  # of the KV budget, at most, when max_num_seqs' slots are lowered to fit


def state_cache_budget(config: EngineConfig, model_config: ModelConfig, log: bool = True) -> tuple[int, int, int]:
    """(running slots, snapshot rows, bytes of both) of the state cache; zeros for a model
    without state layers. With prefix caching, as many snapshots as slots."""
    if not model_config.state_layers:
        return 0, 0, 0
    check_state_model(config)
    rows_per_slot = 2 if config.enable_prefix_caching else 1  # a slot and a snapshot row
    row_bytes = state_bytes_per_slot(model_config, config.torch_dtype)
    num_slots = config.max_num_seqs
    if not config.num_kv_blocks:
        budget = config.kv_cache_bytes()
        fitting = int(budget * STATE_SHARE) // (rows_per_slot * row_bytes)
        if fitting < 1:
            raise InvalidParameterError(
                "kv_cache_memory",
                f"one sequence's state takes {rows_per_slot * row_bytes / 2**20:.0f} MiB, more than half the "
                f"KV budget of {budget / 2**20:.0f} MiB: raise kv_cache_memory",
            )
        if fitting < num_slots:
            logger.warning(
                "max_num_seqs lowered from %d to %d: the state cache of this model's %d state layers takes "
                "%.1f MiB per sequence, and at most half the KV budget (raise kv_cache_memory for more)",
                num_slots,
                fitting,
                len(model_config.state_layers),
                rows_per_slot * row_bytes / 2**20,
            )
            num_slots = fitting
    num_snapshots = num_slots if config.enable_prefix_caching else 0
    num_bytes = (num_slots + num_snapshots) * row_bytes
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
