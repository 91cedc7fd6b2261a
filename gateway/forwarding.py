"""The gateway's front door: the proxied routes, POST /v1/completions, /v1/chat/completions
(and vLLM's /batch of it), /v1/responses and Anthropic's /v1/messages (and its
count_tokens), as plain ASGI in front of FastAPI: they are the hot path, and FastAPI's
request and response machinery cost more than the rest of the hop. Each request goes
through the director (director.py), which the Envoy picker shares. Everything else goes to
the FastAPI app behind."""

from __future__ import annotations

import os

from opentelemetry import trace
from starlette.types import ASGIApp, Receive, Scope, Send

from pagefleet.gateway import errors
from pagefleet.gateway.director import Director
from pagefleet.gateway.errors import Refusal
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.paths import CHAT_PATHS, PROXIED_PATHS
from pagefleet.gateway.proxy import forwarded_headers
from pagefleet.gateway.shape import SESSION_HEADER
from pagefleet.runtime.http import BodyTooLarge, read_body, until_disconnected


class ProxiedRoutes:
    def __init__(self, app: ASGIApp, director: Director, metrics: GatewayMetrics, max_request_bytes: int) -> None:
        self.app, self.director, self.metrics = app, director, metrics
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in PROXIED_PATHS:
            await self.forward(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        values = dict(headers)
        path = scope["path"]
        try:
            body = await self._read_body(scope, receive)
            authorization = values.get(b"authorization", b"").decode("latin-1")
            if not authorization and b"x-api-key" in values:  # Anthropic's clients send their key so
                authorization = "Bearer " + values[b"x-api-key"].decode("latin-1")
            session = values.get(SESSION_HEADER.encode(), b"").decode("latin-1")
            shape = await self.director.admit(path, authorization, body, session)
        except Refusal as refusal:
            await refusal.response()(scope, receive, send)
            return
        request_id = values.get(b"x-request-id") or b"req-" + os.urandom(16).hex().encode()
        traced = self.director.tracing is not None
        upstream_headers = forwarded_headers(headers, request_id, traced)
        if traced:
            trace.get_current_span().set_attributes(
                {
                    "gen_ai.request.model": shape.model,
                    "gen_ai.operation.name": "chat" if path in CHAT_PATHS else "text_completion",
                    "pagefleet.request_id": request_id.decode("latin-1"),
                }
            )

        async def forward_and_relay() -> None:
            try:
                relay = await self.director.forward(path, body, upstream_headers, shape, request_id)
            except Refusal as refusal:
                await refusal.response()(scope, receive, send)
                return
            await relay.send_to(send)

        await until_disconnected(receive, forward_and_relay())

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The request body; a Refusal (413) if it is over the limit, declared or sent."""
        try:
            return await read_body(scope, receive, self.max_request_bytes)
        except BodyTooLarge:
            raise self._too_large() from None

    def _too_large(self) -> Refusal:
        return self.metrics.refused(errors.too_large(self.max_request_bytes))
