"""Peer pulls as a connector (docs/kv-tiers.md).

- Requesting side: a prompt's prefix another replica caches, pulled by the server when the
  gateway named that replica (engine/server/kv_peers.py), is loaded if it still covers more
  than the local prefix cache when the request starts.
- Serving side: this replica's cached blocks of a prefix, held (one reference each) while
  a peer's pull copies them, so no step evicts or rewrites them meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable

from pagefleet.engine.core.kv_cache_manager import KVCacheManager
from pagefleet.engine.core.kv_groups import needed_blocks
from pagefleet.engine.core.request import Request
from pagefleet.engine.kv_connector.base import KVConnector
from pagefleet.engine.kv_connector.worker import KVCaches
from pagefleet.engine.kv_tiers.file_store import FileStore
from pagefleet.engine.kv_transfer.params import RemoteKV


class PeerConnector(KVConnector):
    """`kv_cache`: whose prefix cache a pull is measured against and served from.
    `store`: the file tier's, when it is on (what it holds needs no pull).
    `read_blocks`: the worker side's copy of blocks per KV cache group, for held ones (any
    thread). A prefix counts, and is served, as far as every group can serve it: a sliding
    group sends only the blocks of the last window before the prefix end."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        read_blocks: Callable[[list[list[int]]], KVCaches],
        store: FileStore | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.pool = kv_cache.pool
        self.read_blocks = read_blocks
        self.block_size = kv_cache.block_size
        self.store = store
        self._pulled: dict[str, RemoteKV] = {}  # each request's pulled prefix, until loaded

    # --- requesting side --------------------------------------------------------------------

    def request_added(self, request: Request, given: RemoteKV | None) -> None:
        if given is not None and given.origin == "peer":
            self._pulled[request.request_id] = given

    def external_prefix(self, request: Request, num_local_tokens: int) -> RemoteKV | None:
        pulled = self._pulled.get(request.request_id)
        return pulled if pulled is not None and pulled.num_tokens > num_local_tokens else None

    def drop_staged(self, request: Request) -> None:
        self._pulled.pop(request.request_id, None)

    def count_available(self, hashes: list[int], token_ids: list[int]) -> int:
        """How many of a prompt's full blocks (`hashes`, of `token_ids`) this replica has
        now, in its prefix cache or its file tier: a pull must bring more."""
        local, _ = self.kv_cache.longest_cached_prefix(hashes, token_ids)
        return max(local, self.store.longest_prefix(hashes)) if self.store is not None else local

    # --- serving side -----------------------------------------------------------------------

    def hold_prefix(self, hashes: list[int], token_ids: list[int]) -> tuple[int, list[list[int]]]:
        """The longest prefix of `hashes` the prefix cache serves in every group: its block
        count and per group the cached blocks it needs (`needed_blocks`), each with a
        reference taken (`release` drops them once copied); (0, []) if none."""
        num_blocks, tables = self.kv_cache.longest_cached_prefix(hashes, token_ids)
        ranges = needed_blocks(self.kv_cache.groups, num_blocks * self.block_size, self.block_size)
        held: list[list[int]] = []
        for group, (table, blocks) in enumerate(zip(tables, ranges, strict=True)):
            held.append([])
            for block_id, index in zip(table, blocks, strict=True):
                if not self.pool.try_hold(block_id, hashes[index], group):
                    self.release(held)
                    return 0, []
                held[-1].append(block_id)
        return num_blocks, held

    def release(self, block_ids: list[list[int]]) -> None:
        """Drop the references `hold_prefix` took."""
        for blocks in block_ids:
            self.pool.free(blocks[::-1])
