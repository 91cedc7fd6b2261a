"""Prefill/decode disaggregation as a connector (docs/disaggregation.md).

- Prefill side: a request with `do_remote_decode` keeps its prompt's blocks when it
  finishes (pinned, one reference each) and answers with the `kv_transfer_params` a decode
  replica pulls them with; a pull checks them out, then releases them (or checks them back
  in when it was cut short); nobody pulling in `timeout` seconds frees them. Per KV cache
  group it keeps what the decode replica needs to compute the prompt's last token: every
  prompt block of a full group, the blocks from that token's window on in a sliding one
  (`remote_block_ids` is one list per group then; a flat list with one group, as vLLM's).
  A model with state layers moves a prompt's blocks up to its last block boundary before
  that token, and the state snapshot kept there (held with the pin); the decode replica
  computes the rest of the prompt.
- Decode side: the prompt's KV, pulled by the server before the request was added, is the
  request's start whatever the local prefix cache holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pagefleet.engine.core.kv_cache_manager import KVCacheManager
from pagefleet.engine.core.kv_groups import NULL_BLOCK, needed_blocks
from pagefleet.engine.core.request import Request
from pagefleet.engine.kv_connector.base import ConnectorStats, KVConnector
from pagefleet.engine.kv_connector.pins import PinnedPrompt, PinnedPrompts
from pagefleet.engine.kv_connector.worker import KVCaches
from pagefleet.engine.kv_transfer.params import KVTransferError, RemoteKV, StateRows
from pagefleet.engine.kv_transfer.transport import KVTransport, tokens_to_pull
from pagefleet.protocol.block_hash import reusable_prefix
from pagefleet.protocol.kv_transfer import prefill_answer

logger = logging.getLogger(__name__)


class PrefillDecodeConnector(KVConnector):
    """`transport`: how the answers say where to pull from (the server's; without one,
    they name no address). `read_blocks`: the worker side's copy of blocks, for a pull of a
    checked-out prompt (any thread: a pinned block is never rewritten), per group;
    `read_state`: of a held snapshot row (a model with state layers)."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        read_blocks: Callable[[list[list[int]]], KVCaches],
        timeout: float,
        transport: KVTransport | None = None,
        read_state: Callable[[int], StateRows] | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.pool = kv_cache.pool
        self.groups = kv_cache.groups
        self.block_size = kv_cache.block_size
        self.read_blocks = read_blocks
        self.read_state = read_state
        self.transport = transport
        self.has_state = kv_cache.states is not None
        self.pins = PinnedPrompts(self.pool.free, timeout, kv_cache.release_snapshot if self.has_state else None)
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

    def request_finished(self, request: Request, prompt_blocks: list[list[int]]) -> dict[str, Any] | None:
        if not request.wants_remote_decode or not any(prompt_blocks):
            return None
        num_tokens = tokens_to_pull(request.num_prompt_tokens, self.block_size if self.has_state else 0)
        # Each group from the first block the decode replica's query of the last token reads.
        ranges = needed_blocks(self.groups, num_tokens, self.block_size)
        kept = [table[blocks.start :] for table, blocks in zip(prompt_blocks, ranges, strict=True)]
        if any(NULL_BLOCK in table for table in kept):  # the request ran on past its prompt
            logger.warning("request %s no longer holds its prompt's KV window; nothing to pull", request.request_id)
            return None
        state_row = self._hold_state(request, num_tokens) if self.has_state else None
        if self.has_state and state_row is None:
            return None
        for table in kept:
            self.pool.incref(table)
        self.pins.pin(request.request_id, kept, request.prompt_token_ids, state_row)
        block_ids: list[int] | list[list[int]] = kept[0] if len(kept) == 1 else kept
        if self.transport is not None:
            return self.transport.transfer_params(request.request_id, block_ids)
        return prefill_answer(request.request_id, block_ids)

    def _hold_state(self, request: Request, num_tokens: int) -> int | None:
        """The held snapshot row of the state after the prompt's first `num_tokens` tokens
        (a block boundary), or None (logged: the decode replica then computes the prompt)."""
        _, hashes = reusable_prefix(request.prompt_token_ids, self.block_size, request.sequences[0].hash_root)
        row = self.kv_cache.hold_snapshot(hashes[num_tokens // self.block_size - 1]) if num_tokens else None
        if row is None:
            logger.info(
                "request %s: no state snapshot at token %d of its prompt (shorter than a block, or prefix "
                "caching off); the decode replica computes the prompt",
                request.request_id,
                num_tokens,
            )
        return row

    def checkout(self, request_id: str, block_ids: list[list[int]]) -> PinnedPrompt:
        """A pinned prompt for a pull to read (expiry spares it until `release` or
        `checkin`); the asked blocks must be the first ones it pinned in each group.

        Raises:
            KVTransferError: unknown, expired, already pulled, or other blocks.
        """
        pinned = self.pins.checkout(request_id)
        if pinned is None:
            raise KVTransferError(f"no KV is pinned for request {request_id!r} (already pulled, or timed out)")
        if len(block_ids) != len(pinned.block_ids) or any(
            held[: len(asked)] != asked for held, asked in zip(pinned.block_ids, block_ids, strict=False)
        ):
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
