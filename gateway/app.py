"""The gateway's app: auth and rate limits, routing, proxying, models, metrics and the
dashboard.

The two proxied routes are plain ASGI in front of FastAPI (they are the hot path: FastAPI's
request and response machinery cost more than the rest of the hop); everything else is
FastAPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis.asyncio as redis
from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from pagefleet.gateway.dashboard import PAGE, dashboard_data
from pagefleet.gateway.limits import RateLimiter
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.proxy import BadRequest, OutlierDetector, Proxy, RequestShape, describe
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.routing import RoutingPolicy, make_policy
from pagefleet.gateway.settings import GatewaySettings
from pagefleet.protocol.http import ErrorGuard, error_json, until_disconnected
from pagefleet.protocol.openai import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)


def create_app(settings: GatewaySettings) -> FastAPI:
    client = redis.from_url(settings.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    registry = ReplicaRegistry(client, settings.refresh_interval_s, settings.record_ttl_s, settings.redis_grace_s)
    metrics = GatewayMetrics()
    limiter = RateLimiter(client, settings.requests_per_minute, settings.tokens_per_minute)
    api_keys = settings.keys()
    default_policy = make_policy(settings.policy, client)
    policies: dict[str, RoutingPolicy] = {m: make_policy(p, client) for m, p in settings.model_policies.items()}
    outliers = OutlierDetector(registry, settings.eject_after_failures, settings.exclude_failed_for_s)
    proxy = Proxy(registry, metrics, settings.failover_attempts, outliers)
    seen_models: set[str] = set()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            await registry.refresh()  # a first view before serving, if Redis is up
        except Exception as error:  # Redis down at start: serve anyway, the registry keeps trying
            logger.warning("no view of the replicas yet (%s); the registry retries in the background", error)
        await proxy.start(settings.connect_timeout_s, settings.read_timeout_s)
        task = asyncio.create_task(registry.run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await proxy.close()
        await client.aclose()

    app = FastAPI(title="pagefleet gateway", lifespan=lifespan)

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        decision = await decide(path, headers, receive)
        if isinstance(decision, JSONResponse):  # refused here: nothing to forward
            await decision(scope, receive, send)
            return
        body, shape = decision
        policy = policies.get(shape.model, default_policy)

        async def forward_and_relay() -> None:
            response = await proxy.forward(path, body, headers, shape, policy)
            await response(scope, receive, send)

        await until_disconnected(receive, forward_and_relay())

    async def decide(path: str, headers: dict[str, str], receive: Receive) -> JSONResponse | tuple[bytes, RequestShape]:
        """The request's body and shape if it may be forwarded, else the error to answer."""
        authorization = headers.get("authorization", "")
        key = authorization[7:].strip() if authorization.lower().startswith("bearer ") else None
        if api_keys and key not in api_keys:
            return error_json(401, "A valid API key is required (Authorization: Bearer <key>).")
        body = await _read_body(receive, headers, settings.max_request_bytes)
        if body is None:
            return error_json(413, f"The request body exceeds {settings.max_request_bytes} bytes.")
        try:
            shape = describe(body, chat=path == "/v1/chat/completions")
        except BadRequest as exc:
            return error_json(400, str(exc), exc.param)
        model = shape.model
        if not registry.is_available:
            metrics.errors.labels(model, "registry_unavailable").inc()
            message = "The replica registry is unavailable (Redis unreachable); retry shortly."
            return error_json(503, message, headers={"Retry-After": "5"})
        seen_models.update(registry.models())
        if model not in seen_models:
            metrics.errors.labels("", "unknown_model").inc()  # no label per made-up name
            served = ", ".join(registry.models()) or "none"
            return error_json(404, f"The model `{model}` does not exist. Served models: {served}.", "model")
        if key is not None and limiter.enabled:
            verdict = await limiter.check(key, shape.tokens)
            if not verdict.allowed:
                metrics.rate_limited.labels(model).inc()
                retry = {"Retry-After": str(verdict.retry_after)}
                return error_json(429, f"Rate limit exceeded: {verdict.reason}.", headers=retry)
        return body, shape

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [
            {"id": name, "object": "model", "owned_by": "pagefleet", "replicas": len(registry.by_model[name])}
            for name in registry.models()
        ]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> Response:
        if not registry.is_available:
            return error_json(503, "The replica registry is unavailable (Redis unreachable).")
        return JSONResponse({"status": "ok", "models": registry.models()})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(PAGE)

    @app.get("/dashboard/data")
    async def dashboard_json() -> dict[str, Any]:
        requests: dict[str, float] = {}
        for family in metrics.registry.collect():
            for sample in family.samples:
                if sample.name == "pagefleet_gateway:requests_total":
                    model = sample.labels["model"]
                    requests[model] = requests.get(model, 0.0) + sample.value
        return dashboard_data(registry, requests)

    _document_proxied_routes(app)
    return ErrorGuard(ProxyRoutes(app, route))  # type: ignore[return-value]


def _document_proxied_routes(app: FastAPI) -> None:
    """The proxied routes bypass FastAPI (see ProxyRoutes); describe them in /openapi.json
    all the same, with the request schemas the replicas validate, for clients and fuzzers."""
    described = APIRouter()
    answers: dict[int | str, dict[str, Any]] = {
        status: {"description": text}
        for status, text in [
            (400, "invalid request"),
            (401, "missing API key"),
            (404, "unknown model"),
            (413, "body too large"),
            (429, "rate limited"),
            (503, "no replica can take it"),
        ]
    }

    # Declarations for the schema only: these routers are never mounted, so no request
    # reaches the functions (ProxyRoutes serves both paths before FastAPI sees them).
    @described.post(
        "/v1/completions", responses=answers, response_model=dict[str, Any], summary="Completions, proxied to a replica"
    )
    def completions(body: CompletionRequest) -> None:
        """The request schema the replicas validate."""

    @described.post(
        "/v1/chat/completions",
        responses=answers,
        response_model=dict[str, Any],
        summary="Chat completions, proxied to a replica",
    )
    def chat_completions(body: ChatCompletionRequest) -> None:
        """The request schema the replicas validate."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            routes = [*app.routes, *described.routes]
            app.openapi_schema = get_openapi(title=app.title, version=app.version, routes=routes)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


PROXY_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


class ProxyRoutes:
    """POST to a proxied route goes to `handle` as plain ASGI; anything else to FastAPI."""

    def __init__(self, app: FastAPI, handle: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app, self.handle = app, handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in PROXY_ROUTES:
            await self.handle(scope, receive, send)
        else:
            await self.app(scope, receive, send)


async def _read_body(receive: Receive, headers: dict[str, str], limit: int) -> bytes | None:
    """The request body, or None if it is over `limit` bytes (declared or sent)."""
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)
