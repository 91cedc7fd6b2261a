"""Prefill/decode disaggregation as a connector (docs/disaggregation.md).

- Prefill side: a request with `do_remote_decode` keeps its prompt's blocks when it
  finishes (pinned, one reference each) and answers with the `kv_transfer_params` a decode
  replica pulls them with; a pull checks them out, then releases them (or checks them back
  in when it was cut short); nobody pulling in `timeout` seconds frees them.
- Decode side: the prompt's KV, pulled by the server before the request was added, is the
  request's start whatever the local prefix cache holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagefleet.engine.core.block_pool import BlockPool
from pagefleet.engine.core.request import Request
from pagefleet.engine.kv_connector.base import ConnectorStats, KVConnector
from pagefleet.engine.kv_connector.pins import PinnedPrompt, PinnedPrompts
from pagefleet.engine.kv_connector.worker import KVCaches
from pagefleet.engine.kv_transfer.params import KVTransferError, RemoteKV
from pagefleet.engine.kv_transfer.transport import KVTransport
from pagefleet.protocol.kv_transfer import prefill_answer


class PrefillDecodeConnector(KVConnector):
    """`transport`: how the answers say where to pull from (the server's; without one,
    they name no address). `read_blocks`: the worker side's copy of blocks, for a pull of a
    checked-out prompt (any thread: a pinned block is never rewritten)."""

    def __init__(
        self,
        pool: BlockPool,
        read_blocks: Callable[[list[int]], KVCaches],
        timeout: float,
        transport: KVTransport | None = None,
    ) -> None:
        self.pool = pool
        self.read_blocks = read_blocks
        self.transport = transport
        self.pins = PinnedPrompts(pool.free, timeout)
        self._pulled: dict[str, RemoteKV] = {}  # decode side: each request's prompt KV, until loaded

    # --- decode side ------------------------------------------------------------------------

    def request_added(self, request: Request, given: RemoteKV | None) -> None:
        if given is not None and given.origin == "prefill":
            self._pulled[request.request_id] = given

    def external_prefix(self, request: Request, num_local_tokens: int) -> RemoteKV | None:
        return self._pulled.get(request.request_id)

    def drop_staged(self, request: Request) -> None:
        self._pulled.pop(request.request_id, None)

    # --- prefill side -----------------------------------------------------------------------

    def request_finished(self, request: Request, prompt_block_ids: list[int]) -> dict[str, Any] | None:
        if not request.wants_remote_decode or not prompt_block_ids:
            return None
        self.pool.incref(prompt_block_ids)
        self.pins.pin(request.request_id, list(prompt_block_ids), request.prompt_token_ids)
        if self.transport is not None:
            return self.transport.transfer_params(request.request_id, prompt_block_ids)
        return prefill_answer(request.request_id, prompt_block_ids)

    def checkout(self, request_id: str, block_ids: list[int]) -> PinnedPrompt:
        """A pinned prompt for a pull to read (expiry spares it until `release` or
        `checkin`); the asked blocks must be its first ones.

        Raises:
            KVTransferError: unknown, expired, already pulled, or other blocks.
        """
        pinned = self.pins.checkout(request_id)
        if pinned is None:
            raise KVTransferError(f"no KV is pinned for request {request_id!r} (already pulled, or timed out)")
        if pinned.block_ids[: len(block_ids)] != block_ids:
            self.pins.checkin(request_id)
            raise KVTransferError(f"request {request_id!r} holds blocks {pinned.block_ids}, not {block_ids}")
        return pinned

    def release(self, request_id: str) -> bool:
        """Free a pulled prompt's blocks; False if it was not pinned."""
        return self.pins.release(request_id)

    def checkin(self, request_id: str) -> None:
        """A pull that failed part-way: the blocks stay pinned for another."""
        self.pins.checkin(request_id)

    def between_steps(self, wait: bool = False) -> bool:
        if len(self.pins):
            self.pins.expire()
        return False

    def fill_stats(self, stats: ConnectorStats) -> None:
        stats.num_pinned_blocks = self.pins.num_blocks
        stats.num_pinned_requests = len(self.pins)
        stats.num_pin_timeouts = self.pins.num_timeouts
