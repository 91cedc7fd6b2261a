"""What pagefleet's two HTTP servers (the engine server and the gateway) share at the ASGI
level: the one shape of every error, one limit on request bodies, and noticing a client
that leaves.

Errors: `{"error": {"message", "type", "param", "code"}}` with the right status, never plain
text, whatever raised. `ErrorGuard` wraps an app: an exception the app lets through becomes
a 500 JSON body carrying the request id (also in `x-request-id`), logged with its
traceback, and the connection stays usable (Starlette's own last-resort handler answers
plain text and re-raises, after which the server drops the connection).

Body size: `read_body` applies one rule (a declared length over the limit, or more bytes
than the limit as they arrive) for the engine's middleware and the gateway's proxied routes.

API paths: `is_api_path` says whether a request's route is under /v1, the routes that
`--api-key` (engine) and `--api-keys` (gateway) guard.

Disconnects: `until_disconnected` runs a request's work and cancels it if the client goes
away first, so that nothing is computed for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable
from typing import TypeVar

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagefleet.protocol.openai import error_response

logger = logging.getLogger(__name__)

T = TypeVar("T")


def is_api_path(scope: Scope) -> bool:
    """Whether the request's route path, its root path (`--root-path`) removed, is under /v1.
    Repeated slashes count as one: a guard must not be stricter about spelling than the
    proxy in front of it is."""
    path, root = scope["path"], scope.get("root_path", "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return path.lstrip("/").startswith("v1")


def error_json(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_response(status, message, param), status_code=status, headers=headers)


class ErrorGuard:
    """The last line: any exception the app lets through becomes an OpenAI-shaped 500 with
    a request id (if nothing was sent yet), and never reaches the server, which would drop
    the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:  # the app's boundary: answer, log, keep serving
            sent_id = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
            request_id = sent_id or f"req-{uuid.uuid4().hex}"
            logger.exception("request %s %s failed", request_id, scope.get("path"))
            if started:
                return  # the status is out already; the body simply ends
            message = f"Internal server error (request id {request_id})."
            response = error_json(500, message, headers={"x-request-id": request_id})
            await response(scope, receive, send)


class BodyTooLarge(Exception):
    """The request's body is over the limit."""


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; BodyTooLarge if its declared length (when it is a number) or
    the bytes that arrive (a chunked body, or one longer than it declared) pass `limit`."""
    declared = dict(scope["headers"]).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` for an app behind `read_body`: the body once, then what the client says
    next (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone (after its body was read, `receive` says nothing else)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client went away first: then `work` is cancelled.
    Call it after the request body was read. `work`'s own errors propagate.

    `work` runs in the calling task, and one watcher task cancels it on a disconnect (one
    task per request, not two: this is on every request's path)."""
    this_task = asyncio.current_task()
    assert this_task is not None
    client_left = False

    async def watch() -> None:
        nonlocal client_left
        await wait_for_disconnect(receive)
        client_left = True
        this_task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if client_left and this_task.uncancel() == 0:
            return None  # cancelled by the watcher alone: the client left
        raise
    finally:
        watcher.cancel()
