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
    pool, groups = kv_cache.pool, kv_cache.groups
    read = functools.partial(read_blocks, kv_caches, groups.layer_groups)
    connectors: list[KVConnector] = [
        PrefillDecodeConnector(pool, read, config.kv_pin_timeout, transport, groups, kv_cache.block_size)
    ]
    store = None
    if config.kv_cache_dir is not None:
        max_bytes = int(config.kv_cache_dir_size_gib * (1 << 30))
        store = FileStore(config.kv_cache_dir, layout, max_bytes)
        logger.info("kv file tier: %s (up to %d bytes)", config.kv_cache_dir, max_bytes)
        tier = FileTier(store, pool, read, TierCost(prefill_tokens_per_s))
        connectors.append(FileTierConnector(tier, kv_cache))
    connectors.append(PeerConnector(kv_cache, read, store))
    # A state layer's KV is its state, which no connector moves yet: such a model computes
    # every prompt here (and its requests' kv_transfer_params are refused, request_checks.py).
    multi = MultiConnector(connectors, layout, offers_prefixes=kv_cache.states is None)
    kv_cache.collect_full_blocks = multi.wants_filled_blocks
    return multi
