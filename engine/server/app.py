"""The FastAPI app of one engine replica.

Start-up loads the model in a thread (so `/health` answers 503 until it is loaded and
warm), then starts publishing KV capacity to Redis if a URL is set. Shutdown removes the
Redis record and stops the engine. Every error is OpenAI-shaped JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagefleet.engine.async_engine import AsyncEngine
from pagefleet.engine.errors import EngineDeadError, InvalidParameterError
from pagefleet.engine.llm_engine import EngineStats
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.server.chat import chat_prompt, create_chat_completion
from pagefleet.engine.server.completions import create_completion
from pagefleet.engine.server.metrics import ServerMetrics
from pagefleet.engine.server.publisher import CapacityPublisher
from pagefleet.engine.server.serving import OpenAIError, ServerState
from pagefleet.engine.server.settings import ServerSettings
from pagefleet.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest, error_response

logger = logging.getLogger(__name__)


def _version() -> str:
    try:
        return version("pagefleet")
    except PackageNotFoundError:
        return "unknown"


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class BodySizeLimit:
    """413 for a request body over `limit` bytes, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.limit:
            await self._reject(send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        response = JSONResponse(error_response(413, f"The request body exceeds {self.limit} bytes."), status_code=413)
        await response({"type": "http"}, _no_receive, send)


class _BodyTooLarge(Exception):
    pass


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def _error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_response(status, message, param), status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return _error(error.status, error.message, error.param, error.headers)

    @app.exception_handler(InvalidParameterError)
    async def invalid_parameter(_: Request, error: InvalidParameterError) -> JSONResponse:
        return _error(400, str(error), error.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return _error(400, message, param)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return _error(503, f"The engine stopped: {error}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return _error(error.status_code, str(error.detail))


async def _load(state: ServerState, engine: AsyncEngine | None) -> None:
    """Load the model (in a thread), warm it up with one token, then mark ready."""
    try:
        loaded: AsyncEngine = engine or await asyncio.to_thread(AsyncEngine, state.settings.engine_config())
        async for _ in loaded.generate("Hello", SamplingParams(max_tokens=1, temperature=0.0)):
            pass
        state.engine = loaded
        logger.info("serving %s (max_model_len %d)", state.settings.model_name, loaded.max_model_len)
    except Exception as error:
        state.load_error = error
        logger.exception("the model failed to load")


def _stats(state: ServerState) -> EngineStats | None:
    return state.engine.stats() if state.engine is not None else None


def create_app(settings: ServerSettings, engine: AsyncEngine | None = None) -> FastAPI:
    """The app for `settings`; pass an `engine` to serve one built already (tests)."""
    state: ServerState
    state = ServerState(settings, ServerMetrics(settings.model_name, lambda: _stats(state)))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        publisher: CapacityPublisher | None = None
        tasks: list[asyncio.Task[None]] = []

        async def start() -> None:
            nonlocal publisher
            await _load(state, engine)
            if state.engine is not None and settings.redis_url:
                publisher = CapacityPublisher(
                    settings.redis_url,
                    settings.model_name,
                    settings.replica,
                    settings.url,
                    state.engine.max_model_len,
                    state.engine.stats,
                    settings.publish_interval,
                    settings.record_ttl,
                )
                tasks.append(asyncio.create_task(publisher.run()))

        tasks.append(asyncio.create_task(start()))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if publisher is not None:
            await publisher.remove()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="pagefleet engine", version=_version(), lifespan=lifespan)
    app.state.server = state
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimit, limit=settings.max_request_bytes)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    settings = state.settings

    @app.get("/health")
    async def health() -> Response:
        if state.load_error is not None:
            return _error(503, f"The model failed to load: {state.load_error}")
        if state.engine is None:
            return _error(503, "The model is loading.", headers={"Retry-After": "5"})
        if not state.engine.is_running:
            return _error(503, "The engine stopped.")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [
            {
                "id": settings.model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "pagefleet",
                "root": settings.model,
                "max_model_len": state.engine.max_model_len if state.engine else None,
            }
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        return await create_completion(state, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        return await create_chat_completion(state, body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        engine = state.ready_engine(body.model)
        if body.messages is not None:
            chat = ChatCompletionRequest(
                model=settings.model_name, messages=body.messages, add_generation_prompt=body.add_generation_prompt
            )
            tokens = chat_prompt(engine, chat)
        elif body.prompt is not None:
            tokens = list(engine.tokenizer.encode(body.prompt))
        else:
            raise OpenAIError(400, "prompt: give a prompt or messages", "prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        engine = state.ready_engine(body.model)
        vocab = len(engine.tokenizer)
        if any(not 0 <= token < vocab for token in body.tokens):
            raise OpenAIError(400, f"tokens: token ids must be in [0, {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
