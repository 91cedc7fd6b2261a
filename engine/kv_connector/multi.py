"""Several connectors as one, asked in order (P/D, then the file tier, then a peer)."""

from __future__ import annotations

from typing import Any, TypeVar

from pagefleet.engine.core.kv_cache_manager import FullBlock, KeptSnapshot
from pagefleet.engine.core.request import Request
from pagefleet.engine.kv_connector.base import ConnectorStats, KVConnector
from pagefleet.engine.kv_transfer.params import KVLayout, RemoteKV

C = TypeVar("C", bound=KVConnector)


class MultiConnector(KVConnector):
    """The engine's connectors. A request starts on the longest prefix any of them offers,
    except that a prefill replica's KV always wins (it is the whole prompt but its last
    token). `layout`: what a transfer with this engine must agree on (never changes)."""

    def __init__(self, connectors: list[KVConnector], layout: KVLayout) -> None:
        self.connectors = connectors
        self.layout = layout

    def member(self, kind: type[C]) -> C | None:
        """The connector of that class, if this engine has one."""
        return next((c for c in self.connectors if isinstance(c, kind)), None)

    def request_added(self, request: Request, given: RemoteKV | None) -> None:
        for connector in self.connectors:
            connector.request_added(request, given)

    def external_prefix(self, request: Request, num_local_tokens: int) -> RemoteKV | None:
        best: RemoteKV | None = None
        for connector in self.connectors:
            offer = connector.external_prefix(request, num_local_tokens)
            if offer is None:
                continue
            if offer.origin == "prefill" or best is None or offer.num_tokens > best.num_tokens:
                best = offer
            if offer.origin == "prefill":
                break
        return best

    def is_loading(self, request: Request) -> bool:
        return any(connector.is_loading(request) for connector in self.connectors)

    def wait_for_load(self, request: Request, timeout: float) -> None:
        for connector in self.connectors:
            connector.wait_for_load(request, timeout)

    def request_finished(self, request: Request, prompt_blocks: list[list[int]]) -> dict[str, Any] | None:
        answers = [connector.request_finished(request, prompt_blocks) for connector in self.connectors]
        return next((answer for answer in answers if answer is not None), None)

    def drop_staged(self, request: Request) -> None:
        for connector in self.connectors:
            connector.drop_staged(request)

    @property
    def wants_filled_blocks(self) -> bool:
        return any(connector.wants_filled_blocks for connector in self.connectors)

    def blocks_filled(self, blocks: list[FullBlock]) -> None:
        for connector in self.connectors:
            if connector.wants_filled_blocks:
                connector.blocks_filled(blocks)

    def snapshots_kept(self, snapshots: list[KeptSnapshot]) -> None:
        """To the one connector that saves (the KV cache holds them only for a saver)."""
        savers = [connector for connector in self.connectors if connector.wants_filled_blocks]
        assert len(savers) == 1 or not snapshots, "one saving connector takes the held snapshots"
        if snapshots:
            savers[0].snapshots_kept(snapshots)

    def between_steps(self, wait: bool = False) -> bool:
        pending = [connector.between_steps(wait) for connector in self.connectors]
        return any(pending)

    def fill_stats(self, stats: ConnectorStats) -> None:
        for connector in self.connectors:
            connector.fill_stats(stats)

    def close(self) -> None:
        for connector in self.connectors:
            connector.close()
