"""An engine's connectors, from its config: P/D always (a role of "both" serves either
side), the file tier with `kv_cache_dir`, peer pulls always (they need the gateway's hint).
A model with state layers moves, with a prefix's blocks, the state snapshot after them."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.core.kv_cache_manager import KVCacheManager
from pagefleet.engine.kv_connector.base import KVConnector
from pagefleet.engine.kv_connector.file_tier import FileTierConnector
from pagefleet.engine.kv_connector.multi import MultiConnector
from pagefleet.engine.kv_connector.peer import PeerConnector
from pagefleet.engine.kv_connector.prefill_decode import PrefillDecodeConnector
from pagefleet.engine.kv_connector.worker import KVCaches, read_blocks
from pagefleet.engine.kv_tiers.file_store import FileStore
from pagefleet.engine.kv_tiers.file_tier import FileTier, StateAccess
from pagefleet.engine.kv_transfer.cost import TierCost
from pagefleet.engine.kv_transfer.params import KVLayout
from pagefleet.engine.kv_transfer.transport import KVTransport
from pagefleet.engine.worker.state_cache import StateCache

logger = logging.getLogger(__name__)


def build_connectors(
    config: EngineConfig,
    layout: KVLayout,
    kv_cache: KVCacheManager,
    kv_caches: KVCaches,
    state_cache: StateCache | None,
    prefill_tokens_per_s: Callable[[], float],
    transport: KVTransport | None = None,
) -> MultiConnector:
    """`state_cache`: a model with state layers' (its snapshots move with their prefixes)."""
    pool, groups = kv_cache.pool, kv_cache.groups
    read = functools.partial(read_blocks, kv_caches, groups.layer_groups)
    read_state = state_cache.read_row if state_cache is not None else None
    connectors: list[KVConnector] = [
        PrefillDecodeConnector(kv_cache, read, config.kv_pin_timeout, transport, read_state)
    ]
    store = None
    if config.kv_cache_dir is not None:
        max_bytes = int(config.kv_cache_dir_size_gib * (1 << 30))
        store = FileStore(config.kv_cache_dir, layout, max_bytes)
        logger.info("kv file tier: %s (up to %d bytes)", config.kv_cache_dir, max_bytes)
        state = StateAccess(read_state, kv_cache.release_snapshot) if read_state is not None else None
        tier = FileTier(store, pool, read, TierCost(prefill_tokens_per_s), state)
        connectors.append(FileTierConnector(tier, kv_cache))
    connectors.append(PeerConnector(kv_cache, read, store, read_state))
    multi = MultiConnector(connectors, layout)
    kv_cache.collect_full_blocks = multi.wants_filled_blocks
    return multi
