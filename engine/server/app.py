"""The FastAPI app of one engine replica.

Start-up loads the model in a thread (so `/health` answers 503 until it is loaded and
warm), then starts publishing KV capacity to Redis if a URL is set. Shutdown removes the
Redis record and stops the engine. Every error is OpenAI-shaped JSON (see errors.py).

If the engine dies (its shared forward pass failed), the replica withdraws its Redis record
at once, `/health` fails, and after a short grace for in-flight error responses the server
stops and the process exits with `EXIT_ENGINE_DEAD`, so that its supervisor (Kubernetes,
`pagefleet up`) starts a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagefleet.engine.async_engine import AsyncEngine
from pagefleet.engine.inputs import PromptType
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.server.auth import APIKeyGuard
from pagefleet.engine.server.chat import chat_prompt, create_chat_completion
from pagefleet.engine.server.chat_batch import create_batch_chat_completion
from pagefleet.engine.server.completions import create_completion
from pagefleet.engine.server.errors import OpenAIError, error_for, install_error_handlers
from pagefleet.engine.server.kv_transfer import KVTransfers, add_kv_routes
from pagefleet.engine.server.lora import Adapters, add_lora_routes, parse_lora_modules
from pagefleet.engine.server.messages import add_messages_routes
from pagefleet.engine.server.metrics import ServerMetrics
from pagefleet.engine.server.publisher import CapacityPublisher
from pagefleet.engine.server.responses import add_responses_routes
from pagefleet.engine.server.settings import ServerSettings
from pagefleet.engine.server.state import ServerState, tokenizer_of
from pagefleet.engine.server.stored_responses import StoredResponses
from pagefleet.engine.server.streaming import cancel_on_disconnect
from pagefleet.engine.server.tokenizer_info import add_tokenizer_route
from pagefleet.engine.server.tracing import RequestTracing
from pagefleet.engine.stats import EngineStats
from pagefleet.protocol import tracing
from pagefleet.protocol.anthropic import MESSAGES_PATH
from pagefleet.protocol.http import BodyTooLarge, ErrorGuard, error_json, read_body, replaying
from pagefleet.protocol.openai import BatchChatCompletionRequest, ChatCompletionRequest, ChatMessage, CompletionRequest
from pagefleet.protocol.response_store import MemoryResponseStore, RedisResponseStore
from pagefleet.protocol.responses import RESPONSES_PATH
from pagefleet.protocol.tracing import ServerSpans

logger = logging.getLogger(__name__)

EXIT_ENGINE_DEAD = 3  # the process's exit code after its engine died
EXIT_LOAD_FAILED = 4  # ... after its model failed to load
TRACED_PATHS = ("/v1/completions", "/v1/chat/completions", RESPONSES_PATH, MESSAGES_PATH)


def _version() -> str:
    try:
        return version("pagefleet")
    except PackageNotFoundError:
        return "unknown"


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False  # vLLM's: each token's string too


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


async def _load(state: ServerState, engine: AsyncEngine | None) -> None:
    """Load the model (in a thread) and the adapters of --lora-modules, warm it up with one
    token, then mark ready."""
    try:
        config, connector = state.settings.engine_config(), state.transfers.connector
        loaded: AsyncEngine = engine or await asyncio.to_thread(AsyncEngine, config, kv_connector=connector)
        for name, path in parse_lora_modules(state.settings.lora_modules):
            await state.adapters.load(loaded, name, path)
        warm_up: PromptType = "Hello" if loaded.tokenizer is not None else {"prompt_token_ids": [0]}
        async for _ in loaded.generate(warm_up, SamplingParams(max_tokens=1, temperature=0.0)):
            pass
        state.engine = loaded
        logger.info("serving %s (max_model_len %d)", state.settings.model_name, loaded.max_model_len)
    except Exception as error:
        state.load_error = error
        logger.exception("the model failed to load")


def _stored_responses(settings: ServerSettings) -> StoredResponses:
    """Stored responses in Redis where the fleet's replicas and gateways can all read them;
    in this process when the server has no Redis."""
    ttl = settings.response_store_ttl
    store = RedisResponseStore.from_url(settings.redis_url, ttl) if settings.redis_url else MemoryResponseStore(ttl)
    return StoredResponses(store, settings.url)


def _stats(state: ServerState) -> EngineStats | None:
    return state.engine.stats() if state.engine is not None else None


def create_app(
    settings: ServerSettings,
    engine: AsyncEngine | None = None,
    stop_server: Callable[[], None] | None = None,
    tracer_provider: TracerProvider | None = None,
) -> FastAPI:
    """The app for `settings`; pass an `engine` to serve one built already (tests).

    `stop_server` makes the HTTP server stop gracefully; it is called if the engine dies
    (the server's runner then exits with `state.exit_code`). Traces go to
    `tracer_provider`, else to `settings.otlp_traces_endpoint` if set.
    """
    state: ServerState
    metrics = ServerMetrics(settings.model_name, lambda: _stats(state))
    state = ServerState(
        settings, metrics, KVTransfers(settings, metrics), Adapters(settings.model_name), _stored_responses(settings)
    )
    tracer_provider = tracer_provider or tracing.tracer_provider("pagefleet-engine", settings.otlp_traces_endpoint)
    tracer = tracer_provider.get_tracer("pagefleet.engine") if tracer_provider is not None else None
    if tracer is not None:
        state.tracing = RequestTracing(tracer)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        publisher: CapacityPublisher | None = None
        publishing: asyncio.Task[None] | None = None
        tasks: list[asyncio.Task[None]] = []
        engine_died = asyncio.Event()

        async def withdraw_when_dead() -> None:
            await engine_died.wait()
            state.exit_code = EXIT_ENGINE_DEAD
            logger.critical("the engine stopped; leaving the fleet and exiting with code %d", EXIT_ENGINE_DEAD)
            if publisher is not None and publishing is not None:
                publishing.cancel()  # no report may follow the removal
                await asyncio.gather(publishing, return_exceptions=True)
                await publisher.remove()
            await asyncio.sleep(settings.exit_grace)  # in-flight requests get their error answers
            if stop_server is not None:
                stop_server()

        async def start() -> None:
            nonlocal publisher, publishing
            await _load(state, engine)
            if state.engine is None:
                if stop_server is not None:  # nothing to serve: exit, so a supervisor sees it at once
                    state.exit_code = EXIT_LOAD_FAILED
                    stop_server()
                return
            metrics.engine_loaded(state.engine.max_model_len)
            assert metrics.vllm is not None
            state.engine.add_step_callback(metrics.vllm.iteration_tokens.observe)
            loop = asyncio.get_running_loop()
            state.engine.add_death_callback(lambda _: loop.call_soon_threadsafe(engine_died.set))
            tasks.append(asyncio.create_task(withdraw_when_dead()))
            if settings.redis_url:
                state.engine.enable_kv_events()  # the fleet's prefix index (kv_events.py)
                publisher = CapacityPublisher(
                    settings.redis_url,
                    settings.model_name,
                    settings.replica,
                    settings.url,
                    state.engine.max_model_len,
                    state.engine.stats,
                    settings.publish_interval,
                    settings.record_ttl,
                    settings.restarts,
                    settings.role,
                    state.adapters.paths,
                    state.engine.take_kv_events,
                )
                publishing = asyncio.create_task(publisher.run())
                tasks.append(publishing)

        tasks.append(asyncio.create_task(start()))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if publisher is not None:
            await publisher.remove()
        await state.transfers.close()
        await state.responses.close()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
        if tracer_provider is not None:
            await asyncio.to_thread(tracer_provider.shutdown)  # the last spans go out

    app = FastAPI(title="pagefleet engine", version=_version(), lifespan=lifespan, root_path=settings.root_path)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(ErrorGuard)
    app.add_middleware(BodySizeLimit, limit=settings.max_request_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyGuard, keys=settings.api_key)
    _add_routes(app, state)
    add_kv_routes(app, state.transfers, lambda: state.ready_engine(None))
    add_lora_routes(app, state.adapters, lambda: state.ready_engine(None))
    if settings.enable_tokenizer_info_endpoint:
        add_tokenizer_route(app, settings.model_name, lambda: state.ready_engine(None))
    add_messages_routes(app, state)
    add_responses_routes(app, state)
    if tracer is not None:
        app.add_middleware(ServerSpans, tracer=tracer, paths=TRACED_PATHS)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    settings = state.settings

    @app.get("/health")
    async def health() -> Response:
        if state.load_error is not None:
            return error_json(503, f"The model failed to load: {state.load_error}")
        if state.engine is None:
            return error_json(503, "The model is loading.", headers={"Retry-After": "5"})
        if not state.engine.is_running:
            return error_json(503, "The engine stopped.")
        return JSONResponse({"status": "ok"})

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's: the requests this server is handling (running and queued)."""
        stats = state.engine.stats() if state.engine is not None else None
        return {"server_load": stats.num_running_requests + stats.num_waiting_requests if stats else 0}

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
                "parent": None,  # as vLLM's base model card; an adapter's names its base
                "max_model_len": state.engine.max_model_len if state.engine else None,
            }
        ]
        max_model_len = state.engine.max_model_len if state.engine else None
        return {"object": "list", "data": data + state.adapters.model_cards(state.created, max_model_len)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        header_id = request.headers.get("x-request-id")
        return await cancel_on_disconnect(request, create_completion(state, body, header_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        header_id = request.headers.get("x-request-id")
        return await cancel_on_disconnect(request, create_chat_completion(state, body, header_id))

    @app.post("/v1/chat/completions/batch")
    async def batch_chat_completions(body: BatchChatCompletionRequest, request: Request) -> Any:
        header_id = request.headers.get("x-request-id")
        return await cancel_on_disconnect(request, create_batch_chat_completion(state, body, header_id))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's: forget every cached prefix (benchmarks start each run cold). Refused with
        409 while requests hold blocks."""
        if not await state.ready_engine(None).reset_prefix_cache():
            raise OpenAIError(409, "requests are running: the prefix cache can be reset only when idle")
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        engine = state.ready_engine(body.model)
        if body.messages is not None:
            chat = ChatCompletionRequest(
                model=settings.model_name,
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )
            tokens = chat_prompt(engine, chat)
        elif body.prompt is not None:
            tokens = list(tokenizer_of(engine).encode(body.prompt))
        else:
            raise OpenAIError(400, "prompt: give a prompt or messages", "prompt")
        answer: dict[str, Any] = {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}
        if body.return_token_strs:
            answer["token_strs"] = tokenizer_of(engine).convert_ids_to_tokens(tokens)
        return answer

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        engine = state.ready_engine(body.model)
        vocab = len(tokenizer_of(engine))
        if any(not 0 <= token < vocab for token in body.tokens):
            raise OpenAIError(400, f"tokens: token ids must be in [0, {vocab})", "tokens")
        return {"prompt": tokenizer_of(engine).decode(body.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
