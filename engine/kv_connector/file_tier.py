"""The file tier as a connector (docs/kv-tiers.md): it saves the blocks each step fills,
and loads a prompt's longest stored prefix when reading it beats computing it.

A request's lookup starts when it is added (the engine thread counts the blocks the local
prefix cache holds then) and runs on this connector's reader thread; the scheduler waits
for it before admitting the request, then compares again with the local cache, which may
have gained the same blocks meanwhile.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait

from pagefleet.engine.core.kv_cache_manager import FullBlock, KeptSnapshot, KVCacheManager
from pagefleet.engine.core.request import Request
from pagefleet.engine.kv_connector.base import ConnectorStats, KVConnector
from pagefleet.engine.kv_tiers.file_tier import FileTier
from pagefleet.engine.kv_transfer.params import RemoteKV
from pagefleet.protocol.block_hash import reusable_prefix

logger = logging.getLogger(__name__)


class FileTierConnector(KVConnector):
    def __init__(self, tier: FileTier, kv_cache: KVCacheManager) -> None:
        self.tier = tier
        self.kv_cache = kv_cache
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagefleet-kv-reader")
        self._reads: dict[str, Future[RemoteKV | None]] = {}  # each request's lookup, until loaded

    @property
    def block_size(self) -> int:
        return self.tier.block_size

    # --- loading ----------------------------------------------------------------------------

    def request_added(self, request: Request, given: RemoteKV | None) -> None:
        if request.prompt_logprobs is not None:
            return  # skipped positions would have no prompt logprobs
        full, hashes = reusable_prefix(request.prompt_token_ids, self.block_size, request.sequences[0].hash_root)
        if not hashes:
            return
        local, _ = self.kv_cache.longest_cached_prefix(hashes, full)
        self._reads[request.request_id] = self._reader.submit(self._read, hashes, full, local)

    def _read(self, hashes: list[int], full: list[int], local: int) -> RemoteKV | None:
        try:
            return self.tier.read_prefix(hashes, full, local)
        except Exception:  # a task boundary: a failed read is a miss, the prompt is computed
            logger.exception("kv file tier: reading a prefix failed")
            return None

    def is_loading(self, request: Request) -> bool:
        read = self._reads.get(request.request_id)
        return read is not None and not read.done()

    def wait_for_load(self, request: Request, timeout: float) -> None:
        read = self._reads.get(request.request_id)
        if read is not None:
            wait([read], timeout)

    def external_prefix(self, request: Request, num_local_tokens: int) -> RemoteKV | None:
        read = self._reads.get(request.request_id)
        if read is None or not read.done():
            return None
        stored = read.result()
        return stored if stored is not None and stored.num_tokens > num_local_tokens else None

    def drop_staged(self, request: Request) -> None:
        read = self._reads.pop(request.request_id, None)
        if read is not None:
            read.cancel()

    # --- saving -----------------------------------------------------------------------------

    @property
    def wants_filled_blocks(self) -> bool:
        return True

    def blocks_filled(self, blocks: list[FullBlock]) -> None:
        self.tier.offer(blocks)

    def snapshots_kept(self, snapshots: list[KeptSnapshot]) -> None:
        self.tier.offer_snapshots(snapshots)

    def between_steps(self, wait: bool = False) -> bool:
        if wait:
            self.tier.flush()
        self.tier.release_written()
        return self.tier.has_pending_writes

    def fill_stats(self, stats: ConnectorStats) -> None:
        stats.kv_tier = self.tier.snapshot()

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self.tier.close()
