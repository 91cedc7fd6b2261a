"""The replica's own middleware: a limit on request bodies, answered in each API's shape,
and the count of API requests in flight that a drain waits for. (API keys: auth.py; the
last-resort error guard and the body rule: runtime/http.py.)"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagefleet.engine.server.errors import error_for
from pagefleet.engine.server.state import ServerState
from pagefleet.runtime.http import BodyTooLarge, read_body, replaying


class BodySizeLimit:
    """413 for a request body over `limit` bytes, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(scope, receive, self.limit)
        except BodyTooLarge:
            await self._reject(scope["path"], send)
            return
        await self.app(scope, replaying(body, receive), send)

    async def _reject(self, path: str, send: Send) -> None:
        response = error_for(path, 413, f"The request body exceeds {self.limit} bytes.")
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


# The routes that generate, whose requests GET /load counts (vLLM's "load-aware" routes).
GENERATING_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")


class InFlight:
    """Counts the API requests (`/v1/...`, Anthropic's included) from their first byte in to
    their last byte out, in `state.num_in_flight`: what a drain waits for (lifecycle.py); and,
    with --enable-server-load-tracking, those that generate in `state.server_load` (GET /load)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or "/v1/" not in scope["path"]:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        loads = self.state.settings.enable_server_load_tracking and any(p in path for p in GENERATING_PATHS)
        self.state.num_in_flight += 1
        self.state.server_load += loads
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_in_flight -= 1
            self.state.server_load -= loads
