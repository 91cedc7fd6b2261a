"""Peer pulls as a connector (docs/kv-tiers.md).

- Requesting side: a prompt's prefix another replica caches, pulled by the server when the
  gateway named that replica (engine/server/kv_peers.py), is loaded if it still covers more
  than the local prefix cache when the request starts.
- Serving side: this replica's cached blocks of a prefix, held (one reference each) while
  a peer's pull copies them, so no step evicts or rewrites them meanwhile. A model with
  state layers serves a prefix only as far as it keeps the state after it (a snapshot,
  held the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagefleet.engine.core.kv_cache_manager import KVCacheManager
from pagefleet.engine.core.kv_groups import needed_blocks
from pagefleet.engine.core.request import Request
from pagefleet.engine.kv_connector.base import KVConnector
from pagefleet.engine.kv_connector.worker import KVCaches
from pagefleet.engine.kv_tiers.file_store import FileStore
from pagefleet.engine.kv_transfer.params import RemoteKV, StateRows


@dataclass(slots=True)
class HeldPrefix:
    """A cached prefix held for a peer's copy: its block count, per group the blocks it
    needs (a reference each) and, for a model with state layers, its snapshot row (held)."""

    num_blocks: int
    block_ids: list[list[int]]
    state_row: int | None = None


NOTHING_HELD = HeldPrefix(0, [])


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
        read_state: Callable[[int], StateRows] | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.pool = kv_cache.pool
        self.read_blocks = read_blocks
        self.read_state = read_state
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

    def hold_prefix(self, hashes: list[int], token_ids: list[int]) -> HeldPrefix:
        """The longest prefix of `hashes` the prefix cache serves in every group (and whose
        state it keeps, for a model with state layers), held until `release`."""
        num_blocks, tables = self.kv_cache.longest_cached_prefix(hashes, token_ids)
        if num_blocks == 0:
            return NOTHING_HELD
        ranges = needed_blocks(self.kv_cache.groups, num_blocks * self.block_size, self.block_size)
        held = HeldPrefix(num_blocks, [])
        if self.kv_cache.states is not None:
            held.state_row = self.kv_cache.hold_snapshot(hashes[num_blocks - 1])
            if held.state_row is None:
                return NOTHING_HELD
        for group, (table, blocks) in enumerate(zip(tables, ranges, strict=True)):
            held.block_ids.append([])
            for block_id, index in zip(table, blocks, strict=True):
                if not self.pool.try_hold(block_id, hashes[index], group):
                    self.release(held)
                    return NOTHING_HELD
                held.block_ids[-1].append(block_id)
        return held

    def release(self, held: HeldPrefix) -> None:
        """Drop the references and the hold `hold_prefix` took."""
        for blocks in held.block_ids:
            self.pool.free(blocks[::-1])
        if held.state_row is not None:
            self.kv_cache.release_snapshot(held.state_row)
