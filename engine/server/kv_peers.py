"""Peer pulls: a replica asked for a prompt whose prefix another live replica caches pulls
those blocks from it instead of computing them (docs/kv-tiers.md).

- The gateway names the holder when it routes a request away from it (the holder was
  saturated): the `x-pagefleet-kv-peer` header, the holder's URL (`PeerHint` keeps it for
  the request's generation).
- `PeerPrefixes.pull` hashes the prompt's full blocks, and asks only if the peer may hold
  more than this replica (its prefix cache and file tier) and the cost model says a pull
  beats computing the difference. The pull is `POST /kv/prefix` on the holder, in the
  frames of a prefill/decode pull (wire.py); anything short of a sound answer (the holder
  gone, another layout, fewer blocks than asked, a broken stream) leaves the prompt to be
  computed here: a pull never fails a request.
- `POST /kv/prefix` serves this replica's cached blocks of a prefix: each is referenced
  only while it is copied, and the layouts are checked before any byte moves.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from pagefleet.engine.front.async_engine import AsyncEngine
from pagefleet.engine.kv_transfer import wire
from pagefleet.engine.kv_transfer.cost import TierCost
from pagefleet.engine.kv_transfer.params import KVLayout, KVTransferError, RemoteKV
from pagefleet.engine.kv_transfer.transport import PullRefusedError, assemble, post_for_frames
from pagefleet.engine.server.metrics import ServerMetrics
from pagefleet.protocol.block_hash import reusable_prefix
from pagefleet.protocol.headers import KV_PEER_HEADER
from pagefleet.runtime.http import error_json

if TYPE_CHECKING:
    from pagefleet.engine.server.kv_transfer import KVTransfers

logger = logging.getLogger(__name__)

PREFIX_PATH = "/kv/prefix"
PEER_HINT: contextvars.ContextVar[str | None] = contextvars.ContextVar("kv_peer", default=None)
PULL_LOOKUP_S = 0.03  # a pull's fixed cost: the round trip and the holder's copy


class PeerHint:
    """Keeps the gateway's `x-pagefleet-kv-peer` header (an http URL) for the request's
    generation."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == KV_PEER_HEADER.encode():
                    peer = value.decode("latin-1")
                    if peer.startswith(("http://", "https://")):
                        PEER_HINT.set(peer)
                    break
        await self.app(scope, receive, send)


class PrefixRequest(BaseModel):
    hashes: list[str]  # the full blocks' chained hashes, 16 hex digits each
    token_ids: list[int]  # their tokens
    min_blocks: int = 1  # fewer than this is not worth sending
    layout: dict[str, Any]


class PeerPrefixes:
    """This replica's pulls from its peers (the requesting side)."""

    def __init__(
        self,
        metrics: ServerMetrics,
        layout_of: Callable[[AsyncEngine], KVLayout],
        mode: str,
        session: Callable[[], aiohttp.ClientSession],
    ) -> None:
        self.metrics = metrics
        self.layout_of = layout_of
        self.mode = mode  # "auto" (the cost model decides), "always" or "off"
        self.session = session  # the replica's session for KV transfers
        self._cost: TierCost | None = None

    def cost(self, engine: AsyncEngine) -> TierCost:
        if self._cost is None:
            self._cost = TierCost(lambda: engine.stats().prefill_tokens_per_s, 0.005, PULL_LOOKUP_S)
        return self._cost

    async def pull(self, engine: AsyncEngine, token_ids: list[int], root: int) -> RemoteKV | None:
        """The prompt's prefix from the peer the gateway named, or None (compute it here)."""
        peer = PEER_HINT.get()
        if peer is None or self.mode == "off":
            return None
        layout = self.layout_of(engine)
        size = layout.block_size
        full, hashes = reusable_prefix(token_ids, size, root)
        have = await engine.count_cached_prefix(hashes, full)
        cost = self.cost(engine)
        if len(hashes) <= have:
            self.metrics.kv_peer_pull("not_needed")
            return None
        if self.mode == "auto" and not cost.worth_reading(len(hashes), (len(hashes) - have) * size):
            self.metrics.kv_peer_pull("refused")
            return None
        body = {
            "hashes": [f"{h:016x}" for h in hashes],
            "token_ids": full,
            "min_blocks": have + 1,
            "layout": layout.as_dict(),
        }
        started = time.monotonic()
        try:
            pulled = await self._request(f"{peer.rstrip('/')}{PREFIX_PATH}", body, layout, full)
        except KVTransferError as error:
            logger.info("no prefix pulled from %s, computing it: %s", peer, error)
            self.metrics.kv_peer_pull("failed")
            return None
        if pulled is None:
            self.metrics.kv_peer_pull("miss")
            return None
        seconds = time.monotonic() - started
        cost.observe_read(pulled.num_blocks, seconds)
        self.metrics.kv_peer_pull("hit")
        self.metrics.kv_transferred("peer_received", pulled.num_blocks, pulled.num_bytes, seconds)
        return pulled

    async def _request(self, url: str, body: dict[str, Any], layout: KVLayout, full: list[int]) -> RemoteKV | None:
        try:
            frames = await post_for_frames(self.session(), url, body)
        except PullRefusedError as error:
            if error.status == 404:
                return None  # the peer holds no more than this replica
            raise KVTransferError(f"HTTP {error.status}: {error.reason}") from None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
            raise KVTransferError(repr(error)) from None
        if not frames:
            raise KVTransferError("an empty answer")
        num_blocks = int(frames[0][0].get("num_blocks", 0))
        if not 0 < num_blocks <= len(full) // layout.block_size:
            raise KVTransferError(f"an answer of {num_blocks} blocks")
        pulled = assemble(frames, layout, full[: num_blocks * layout.block_size], f"the peer at {url}")
        pulled.origin = "peer"
        return pulled


def add_peer_routes(app: FastAPI, transfers: KVTransfers, engine_of: Any) -> None:
    """`POST /kv/prefix`; `engine_of()` is the loaded engine (or raises the 503)."""

    @app.post(PREFIX_PATH)
    async def prefix(body: PrefixRequest) -> Response:
        engine: AsyncEngine = engine_of()
        ours, refusal = transfers.check_layout(engine, body.layout, "the pulling replica")
        if refusal is not None:
            return refusal
        try:
            hashes = [int(h, 16) for h in body.hashes]
        except ValueError as error:
            return error_json(400, str(error))
        if len(body.token_ids) != len(hashes) * ours.block_size:
            return error_json(400, "token_ids must be the hashed blocks' tokens")
        started = time.monotonic()
        num_blocks, blocks, state = await engine.read_cached_prefix(hashes, body.token_ids)
        if num_blocks < body.min_blocks:
            return error_json(404, f"this replica caches {num_blocks} blocks of that prefix")
        tokens = body.token_ids[: num_blocks * ours.block_size]
        hello = {"kind": "hello", "layout": ours.as_dict(), "token_ids": tokens, "num_blocks": num_blocks}
        frames = [wire.frame(hello), *wire.kv_frames(blocks, state), wire.frame({"kind": "end"})]
        transfers.metrics.kv_transferred(
            "peer_sent", num_blocks, sum(len(f) for f in frames), time.monotonic() - started
        )
        return StreamingResponse(_stream(frames), media_type="application/octet-stream")


async def _stream(frames: list[bytes]) -> Any:
    for data in frames:
        yield data
        await asyncio.sleep(0)
