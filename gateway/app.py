"""The gateway's FastAPI app: auth and rate limits, routing, proxying, models, metrics and
the dashboard."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import redis.asyncio as redis
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagefleet.gateway.dashboard import PAGE, dashboard_data
from pagefleet.gateway.limits import RateLimiter
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.proxy import BadRequest, Proxy, describe, error
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.routing import RoutingPolicy, make_policy
from pagefleet.gateway.settings import GatewaySettings

logger = logging.getLogger(__name__)


def create_app(settings: GatewaySettings) -> FastAPI:
    client = redis.from_url(settings.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    registry = ReplicaRegistry(client, settings.refresh_interval, settings.record_ttl, settings.redis_grace)
    metrics = GatewayMetrics()
    limiter = RateLimiter(client, settings.requests_per_minute, settings.tokens_per_minute)
    api_keys = settings.keys()
    default_policy = make_policy(settings.policy, client)
    policies: dict[str, RoutingPolicy] = {m: make_policy(p, client) for m, p in settings.model_policies.items()}
    timeout = httpx.Timeout(settings.read_timeout, connect=settings.connect_timeout)
    http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
    proxy = Proxy(http, registry, metrics, settings.failover_attempts, settings.exclude_failed_for)
    seen_models: set[str] = set()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        with contextlib.suppress(Exception):
            await registry.refresh()  # a first view before serving, if Redis is up
        task = asyncio.create_task(registry.run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await http.aclose()
        await client.aclose()

    app = FastAPI(title="pagefleet gateway", lifespan=lifespan)

    def api_key(request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        return header[7:].strip() if header.lower().startswith("bearer ") else None

    async def route(request: Request, path: str, chat: bool) -> Response:
        key = api_key(request)
        if api_keys and key not in api_keys:
            return error(401, "A valid API key is required (Authorization: Bearer <key>).")
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > settings.max_request_bytes:
            return error(413, f"The request body exceeds {settings.max_request_bytes} bytes.")
        body = await request.body()
        if len(body) > settings.max_request_bytes:
            return error(413, f"The request body exceeds {settings.max_request_bytes} bytes.")
        try:
            shape = describe(body, chat)
        except BadRequest as exc:
            return error(400, str(exc), exc.param)
        model = shape.model
        if not registry.is_available:
            metrics.errors.labels(model, "registry_unavailable").inc()
            return error(
                503,
                "The replica registry is unavailable (Redis unreachable); retry shortly.",
                headers={"Retry-After": "5"},
            )
        seen_models.update(registry.models())
        if model not in seen_models:
            metrics.errors.labels("", "unknown_model").inc()  # no label per made-up name
            served = ", ".join(registry.models()) or "none"
            return error(404, f"The model `{model}` does not exist. Served models: {served}.", "model")
        if key is not None and limiter.enabled:
            verdict = await limiter.check(key, shape.tokens)
            if not verdict.allowed:
                metrics.rate_limited.labels(model).inc()
                return error(
                    429, f"Rate limit exceeded: {verdict.reason}.", headers={"Retry-After": str(verdict.retry_after)}
                )
        policy = policies.get(model, default_policy)
        return await proxy.forward(path, body, dict(request.headers), shape, policy)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions", chat=True)

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
            return error(503, "The replica registry is unavailable (Redis unreachable).")
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

    return app
