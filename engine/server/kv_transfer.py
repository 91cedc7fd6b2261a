"""This replica's side of prefill/decode disaggregation (engine/kv_transfer).

- A decode request (`kv_transfer_params.do_remote_prefill`) pulls its prompt's KV from the
  prefill replica named in them before it is queued (`KVTransfers.prepare`); a pull that
  fails is a 502 `kv_transfer_error`, so a router can fall back to computing the prompt.
- `POST /kv/pull` serves the prompts this replica pinned as a prefill replica: it checks
  the caller's KV layout first (409 naming the difference), streams the blocks as frames,
  and frees them once the last frame is out. A pull cut short leaves them pinned for
  another try until the pin timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.front.async_engine import AsyncEngine
from pagefleet.engine.front.inputs import PromptType
from pagefleet.engine.kv_transfer import wire
from pagefleet.engine.kv_transfer.params import KVLayout, KVTransferError, RemoteKV, transfer_params
from pagefleet.engine.kv_transfer.transport import PULL_PATH, HTTPTransport
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.server.errors import OpenAIError
from pagefleet.engine.server.kv_peers import PeerPrefixes
from pagefleet.engine.server.metrics import ServerMetrics
from pagefleet.engine.server.settings import ServerSettings
from pagefleet.protocol.kv_transfer import per_group
from pagefleet.runtime.http import error_json

logger = logging.getLogger(__name__)


class PullRequest(BaseModel):
    request_id: str
    block_ids: list[int] | list[list[int]]  # one list per KV cache group, or one group's
    layout: dict[str, Any]

    @property
    def group_block_ids(self) -> list[list[int]]:
        return per_group(self.block_ids)

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids in self.group_block_ids)


class KVTransfers:
    def __init__(self, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.role = settings.role
        self.model_name = settings.model_name
        self.metrics = metrics
        self.transport = HTTPTransport(settings.replica, settings.url, settings.kv_transfer_timeout)
        self.peers = PeerPrefixes(metrics, self.layout, settings.kv_peer_pulls, self.transport.client)

    async def prepare(
        self, engine: AsyncEngine, prompt: PromptType, params: SamplingParams
    ) -> tuple[PromptType, RemoteKV | None]:
        """For a decode request: its prompt as token ids and the KV pulled for it; other
        requests pass unchanged.

        Raises:
            InvalidParameterError: bad `kv_transfer_params`, or a prefill replica asked to decode.
            OpenAIError: 502 when the pull fails.
        """
        transfer = transfer_params(params)
        if transfer is None or transfer.remote_prefill is None:
            return prompt, None
        if self.role == "prefill":
            raise InvalidParameterError(
                "kv_transfer_params",
                "this replica prefills (--role prefill): send do_remote_prefill to a decode replica",
            )
        remote = transfer.remote_prefill
        token_ids = await asyncio.to_thread(engine.prompt_token_ids, prompt, params)  # once, off the loop
        started = time.monotonic()
        try:
            pulled = await self.transport.pull(remote, self.layout(engine), token_ids)
        except KVTransferError as error:
            self.metrics.kv_transfer_failures.inc()
            logger.warning("KV pull failed: %s", error)
            raise OpenAIError(502, f"KV transfer failed: {error}", "kv_transfer_params") from None
        self.metrics.kv_transferred("received", pulled.num_blocks, pulled.num_bytes, time.monotonic() - started)
        return token_ids, pulled

    def layout(self, engine: AsyncEngine) -> KVLayout:
        """The engine's KV layout under the served model name (which both roles share; their
        model paths may differ)."""
        return dataclasses.replace(engine.kv_layout(), model=self.model_name)

    def check_layout(
        self, engine: AsyncEngine, theirs: dict[str, Any], caller: str
    ) -> tuple[KVLayout, Response | None]:
        """This replica's layout, and the answer to give instead of sending a byte if the
        caller's differs: 400 when it is unreadable, 409 naming the difference."""
        ours = self.layout(engine)
        try:
            difference = ours.mismatch(KVLayout.from_dict(theirs), "this replica", caller)
        except KVTransferError as error:
            return ours, error_json(400, str(error))
        if difference:
            self.metrics.kv_transfer_failures.inc()
            return ours, error_json(409, f"the KV layouts differ, nothing was sent: {difference}")
        return ours, None

    async def close(self) -> None:
        await self.transport.close()


def add_kv_routes(app: FastAPI, transfers: KVTransfers, engine_of: Any) -> None:
    """`POST /kv/pull`; `engine_of()` is the loaded engine (or raises the 503)."""

    @app.post(PULL_PATH)
    async def pull(body: PullRequest) -> Response:
        engine: AsyncEngine = engine_of()
        ours, refusal = transfers.check_layout(engine, body.layout, "the decode replica")
        if refusal is not None:
            return refusal
        try:
            token_ids, blocks, state = await engine.read_pinned(body.request_id, body.group_block_ids)
        except KVTransferError as error:
            return error_json(404, str(error))
        frames = wire.kv_frames(blocks, state)
        return StreamingResponse(
            _send(engine, transfers.metrics, body, ours, token_ids, frames), media_type="application/octet-stream"
        )


async def _send(
    engine: AsyncEngine,
    metrics: ServerMetrics,
    body: PullRequest,
    layout: KVLayout,
    token_ids: list[int],
    frames: list[bytes],
) -> AsyncIterator[bytes]:
    started, sent = time.monotonic(), 0
    done = False
    try:
        hello = {"kind": "hello", "layout": layout.as_dict(), "token_ids": token_ids, "num_blocks": body.num_blocks}
        yield wire.frame(hello)
        for data in frames:
            sent += len(data)
            yield data
        yield wire.frame({"kind": "end"})
        done = True
    finally:
        if done:
            engine.release_pinned(body.request_id)
            metrics.kv_transferred("sent", body.num_blocks, sent, time.monotonic() - started)
        else:
            engine.checkin_pinned(body.request_id)
            logger.warning("the pull of request %s was cut short; its blocks stay pinned", body.request_id)
