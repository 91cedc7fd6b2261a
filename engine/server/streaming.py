"""Answering a client that may leave: a client gone means its engine requests stop now.

Two cases, one rule (`runtime.http.until_disconnected`). A plain JSON answer is computed
by a handler that awaits the engine; `cancel_on_disconnect` cancels it when the client
leaves. An event stream is written by `EventStreamResponse`, which also watches for the
disconnect (whatever ASGI version the server speaks) and closes its event iterator when the
client leaves, the stream ends or writing fails. Either way the engine's `generate`
iterator is closed, and its abort needs no await, so it runs inside a cancelled task too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Awaitable
from contextlib import suppress
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagefleet.engine.server.errors import status_of
from pagefleet.protocol.openai import error_response
from pagefleet.runtime.http import until_disconnected

logger = logging.getLogger(__name__)

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client left first"; nobody receives it


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (its
    engine requests abort and free their blocks) and a 499 goes nowhere."""
    result = await until_disconnected(request.receive, work)
    if result is None:
        logger.info("the client of %s left; its request was cancelled", request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return result


class EventStreamResponse(StreamingResponse):
    """Server-sent events from `events` (already formatted `data: ...` strings).

    An error raised by `events` after the stream started cannot change the status any more:
    it is sent as an OpenAI error event, then `data: [DONE]`.
    """

    def __init__(self, events: AsyncGenerator[str, None], headers: dict[str, str] | None = None) -> None:
        super().__init__(events, headers=headers, media_type="text/event-stream")
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if not await until_disconnected(receive, self._write(send)):
                logger.info("a streaming client left; its request was aborted")
        finally:
            # Closing the iterator closes the engine streams below it: their aborts run now.
            with suppress(Exception):
                await self.events.aclose()

    async def _write(self, send: Send) -> bool:
        """Write the whole stream; True once it ended."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        except Exception as error:  # after the first byte: the error goes into the stream
            status, message = status_of(error)
            logger.error("a streamed response failed (%d): %s", status, message, exc_info=status == 500)
            await send({"type": "http.response.body", "body": _error_event(status, message), "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True


def _error_event(status: int, message: str) -> bytes:
    return f"data: {json.dumps(error_response(status, message))}\n\n".encode()
