"""The replica's core routes: health, load, version, models, completions and chat (and
vLLM's batch of chats), the prefix-cache reset, tokenize and detokenize, metrics. (The
Messages, Responses, LoRA, KV transfer and tokenizer routes live beside their modules.)"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from pagefleet.engine.server.chat import chat_prompt, create_chat_completion
from pagefleet.engine.server.chat_batch import create_batch_chat_completion
from pagefleet.engine.server.completions import create_completion
from pagefleet.engine.server.errors import OpenAIError
from pagefleet.engine.server.settings import ServerSettings
from pagefleet.engine.server.state import ServerState, tokenizer_of
from pagefleet.engine.server.streaming import cancel_on_disconnect
from pagefleet.protocol.openai import BatchChatCompletionRequest, ChatCompletionRequest, ChatMessage, CompletionRequest
from pagefleet.runtime.http import error_json

RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)


def server_version() -> str:
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


def add_core_routes(app: FastAPI, state: ServerState) -> None:
    """The routes every replica serves: probes and metrics, generation, tokens."""
    add_probe_routes(app, state)
    add_generation_routes(app, state)
    add_token_routes(app, state)


def add_probe_routes(app: FastAPI, state: ServerState) -> None:
    """Liveness, readiness, load, version and Prometheus metrics."""

    @app.get("/health")
    async def health() -> Response:
        if state.load_error is not None:
            return error_json(503, f"The model failed to load: {state.load_error}")
        if state.engine is None:
            return error_json(503, "The model is loading.", headers={"Retry-After": "5"})
        if not state.engine.is_running:
            return error_json(503, "The engine stopped.")
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: `/health`, and not draining (after SIGTERM `/health` stays live while
        the requests in flight finish; this one sends new work elsewhere)."""
        if state.draining:
            return error_json(503, "The server is shutting down.")
        return await health()

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's: the generation requests in flight, from their first byte in to their last
        out, with --enable-server-load-tracking (else always 0, as vLLM)."""
        return {"server_load": state.server_load}

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": server_version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def server_wide(body: RequestT, settings: ServerSettings) -> RequestT:
    """The body with the server's --return-tokens-as-token-ids, which wins over the request's."""
    if settings.return_tokens_as_token_ids and not body.return_tokens_as_token_ids:
        return body.model_copy(update={"return_tokens_as_token_ids": True})
    return body


def add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """The model list and the OpenAI routes that generate (and SageMaker's /invocations)."""
    settings = state.settings

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
        return await cancel_on_disconnect(request, create_completion(state, server_wide(body, settings), header_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        header_id = request.headers.get("x-request-id")
        return await cancel_on_disconnect(
            request, create_chat_completion(state, server_wide(body, settings), header_id)
        )

    @app.post("/invocations")
    async def invocations(request: Request) -> Any:
        """SageMaker's route, as vLLM serves it: a body with `messages` is a chat completion,
        one with `prompt` a completion, answered exactly as on that route."""
        try:
            payload = json.loads(await request.body())
        except ValueError:
            invalid = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error"}
            raise RequestValidationError([invalid]) from None
        if isinstance(payload, dict) and "messages" in payload:
            return await chat_completions(ChatCompletionRequest.model_validate(payload), request)
        if isinstance(payload, dict) and ("prompt" in payload or "prompt_embeds" in payload):
            return await completions(CompletionRequest.model_validate(payload), request)
        raise OpenAIError(400, "a body with `messages` (a chat completion) or `prompt` (a completion)")

    @app.post("/v1/chat/completions/batch")
    async def batch_chat_completions(body: BatchChatCompletionRequest, request: Request) -> Any:
        header_id = request.headers.get("x-request-id")
        return await cancel_on_disconnect(request, create_batch_chat_completion(state, body, header_id))


def add_token_routes(app: FastAPI, state: ServerState) -> None:
    """Tokenize, detokenize, and the prefix cache's reset."""
    settings = state.settings

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
        strings = tokenizer_of(engine).convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens, "token_strs": strings}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        engine = state.ready_engine(body.model)
        vocab = len(tokenizer_of(engine))
        if any(not 0 <= token < vocab for token in body.tokens):
            raise OpenAIError(400, f"tokens: token ids must be in [0, {vocab})", "tokens")
        return {"prompt": tokenizer_of(engine).decode(body.tokens)}
