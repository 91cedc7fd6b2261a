"""vLLM's `--api-key`: the API routes (`/v1/...`) answer only callers that present one of
the keys as `Authorization: Bearer <key>` (or, as Anthropic's clients send it, `x-api-key`);
health, metrics and the fleet's own routes stay open, as in vLLM, so probes, Prometheus
and the gateway's reads need no key. Behind `--root-path` a request may come with the prefix
or without it (a proxy that strips it): either way its route path decides."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from pagefleet.engine.server.errors import error_for
from pagefleet.runtime.http import is_api_path


class APIKeyGuard:
    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_api_path(scope) or self._presented_a_key(scope):
            await self.app(scope, receive, send)
            return
        message = "Unauthorized: send one of the server's API keys as `Authorization: Bearer <key>` or `x-api-key`"
        response = error_for(scope["path"], 401, message)
        await response(scope, receive, send)

    def _presented_a_key(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        presented = token.strip() if scheme.lower() == b"bearer" else headers.get(b"x-api-key", b"")
        # compare_digest: the time a comparison takes says nothing about a key.
        return bool(presented) and any(hmac.compare_digest(presented, key) for key in self.keys)
