"""An engine's connectors, from its config: P/D always (a role of "both" serves either
side), the file tier with `kv_cache_dir`, peer pulls always (they need the gateway's hint)."""

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
from pagefleet.engine.kv_tiers.file_tier import FileTier
from pagefleet.engine.kv_transfer.cost import TierCost
from pagefleet.engine.kv_transfer.params import KVLayout
from pagefleet.engine.kv_transfer.transport import KVTransport

logger = logging.getLogger(__name__)


def build_connectors(
    config: EngineConfig,
    layout: KVLayout,
    kv_cache: KVCacheManager,
    kv_caches: KVCaches,
    prefill_tokens_per_s: Callable[[], float],
    transport: KVTransport | None = None,
) -> MultiConnector:
    pool = kv_cache.pool
    read = functools.partial(read_blocks, kv_caches)
    connectors: list[KVConnector] = [PrefillDecodeConnector(pool, read, config.kv_pin_timeout, transport)]
    store = None
    if config.kv_cache_dir is not None:
        max_bytes = int(config.kv_cache_dir_size_gib * (1 << 30))
        store = FileStore(config.kv_cache_dir, layout, max_bytes)
        logger.info("kv file tier: %s (up to %d bytes)", config.kv_cache_dir, max_bytes)
        tier = FileTier(store, pool, read, TierCost(prefill_tokens_per_s))
        connectors.append(FileTierConnector(tier, pool))
    one_group = kv_cache.groups.num_groups == 1
    connectors.append(PeerConnector(pool, kv_cache.block_size, read, store, enabled=one_group))
    multi = MultiConnector(connectors, layout)
    kv_cache.collect_full_blocks = multi.wants_filled_blocks
    return multi
