"""Peer pulls as a connector (docs/kv-tiers.md).

- Requesting side: a prompt's prefix another replica caches, pulled by the server when the
  gateway named that replica (engine/server/kv_peers.py), is loaded if it still covers more
  than the local prefix cache when the request starts.
- Serving side: this replica's cached blocks of a prefix, held (one reference each) while
  a peer's pull copies them, so no step evicts or rewrites them meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable

from pagefleet.engine.core.block_pool import BlockPool
from pagefleet.engine.core.request import Request
from pagefleet.engine.kv_connector.base import KVConnector
from pagefleet.engine.kv_connector.worker import KVCaches
from pagefleet.engine.kv_tiers.file_store import FileStore
from pagefleet.engine.kv_transfer.params import RemoteKV


class PeerConnector(KVConnector):
    """`store`: the file tier's, when it is on (what it holds needs no pull).
    `read_blocks`: the worker side's copy of blocks, for held ones (any thread).
    `enabled`: False for a cache of several KV groups (a pull moves one group's blocks),
    which then neither pulls nor serves pulls."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        read_blocks: Callable[[list[int]], KVCaches],
        store: FileStore | None = None,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.pool = pool
        self.read_blocks = read_blocks
        self.block_size = block_size
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
        now, in its prefix cache or its file tier: a pull must bring more (disabled: it
        can use nothing more)."""
        if not self.enabled:
            return len(hashes)
        local = self.pool.count_cached(hashes, token_ids, self.block_size)
        return max(local, self.store.count_present(hashes)) if self.store is not None else local

    # --- serving side -----------------------------------------------------------------------

    def hold_prefix(self, hashes: list[int], token_ids: list[int]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`, each with a reference taken
        (`release` drops them once copied)."""
        size = self.block_size
        held: list[int] = []
        if not self.enabled:
            return held
        for index, block_hash in enumerate(hashes):
            block_id = self.pool.try_lookup(block_hash, tuple(token_ids[index * size : (index + 1) * size]))
            if block_id is None or not self.pool.try_hold(block_id, block_hash):
                break
            held.append(block_id)
        return held

    def release(self, block_ids: list[int]) -> None:
        """Drop the references `hold_prefix` took."""
        self.pool.free(block_ids[::-1])
