"""What completions and chat share: the server's state, errors, sampling parameters,
metered generation, and server-sent events."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pagefleet.engine.async_engine import AsyncEngine
from pagefleet.engine.outputs import RequestOutput
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.server.errors import OpenAIError
from pagefleet.engine.server.metrics import ServerMetrics
from pagefleet.engine.server.settings import ServerSettings
from pagefleet.protocol.openai import ChatCompletionRequest, CompletionRequest


@dataclass(slots=True)
class ServerState:
    settings: ServerSettings
    metrics: ServerMetrics
    engine: AsyncEngine | None = None  # None until the model is loaded and warm
    load_error: BaseException | None = None
    exit_code: int = 0  # what the process exits with once the server stops (non-zero: the engine died)
    created: int = field(default_factory=lambda: int(time.time()))

    def ready_engine(self, model: str | None) -> AsyncEngine:
        """The engine, once `model` is known to be ours; the right error otherwise."""
        if model is not None and model != self.settings.model_name:
            raise OpenAIError(
                404, f"The model `{model}` does not exist; this server serves `{self.settings.model_name}`.", "model"
            )
        if self.engine is None:
            raise OpenAIError(503, "The model is still loading; retry shortly.", headers={"Retry-After": "5"})
        return self.engine


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, **extra: Any
) -> SamplingParams:
    """The engine's parameters from an OpenAI request (fields left out keep the defaults)."""
    fields = {
        name: getattr(body, name)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "stop_token_ids",
        )
        if getattr(body, name) is not None
    }
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        n=body.n,
        stop=stop,
        max_tokens=max_tokens,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        **fields,
        **extra,
    )


def check_admission(engine: AsyncEngine, settings: ServerSettings) -> None:
    if engine.stats().num_waiting_requests >= settings.max_waiting_requests:
        raise OpenAIError(
            503,
            f"The server is at capacity ({settings.max_waiting_requests} requests waiting); retry later.",
            headers={"Retry-After": "1"},
        )


async def generate(
    state: ServerState, engine: AsyncEngine, prompt: str | list[int], params: SamplingParams
) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one prompt, with latency metrics. Closing the iterator
    early (a client gone) aborts the request and frees its blocks."""
    metrics = state.metrics
    started = last = time.monotonic()
    tokens_seen = 0
    async with aclosing(engine.generate(prompt, params, f"req-{uuid.uuid4().hex}")) as outputs:
        async for output in outputs:
            tokens = sum(len(c.token_ids) for c in output.outputs)
            if tokens > tokens_seen:
                now = time.monotonic()
                histogram = metrics.time_to_first_token if tokens_seen == 0 else metrics.inter_token_latency
                histogram.observe((now - started) if tokens_seen == 0 else (now - last))
                last, tokens_seen = now, tokens
            yield output
    metrics.e2e_request_latency.observe(time.monotonic() - started)


async def first_and_rest(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Start `stream` now, so that invalid input fails before a streaming response begins."""
    try:
        first = await anext(stream)
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise

    async def replay() -> AsyncIterator[RequestOutput]:
        async with aclosing(stream):  # type: ignore[type-var]
            yield first
            async for item in stream:
                yield item

    return replay()


async def start_all(streams: list[AsyncIterator[RequestOutput]]) -> list[AsyncIterator[RequestOutput]]:
    """`first_and_rest` for several prompts at once; if one fails, the others are closed."""
    started = await asyncio.gather(*(first_and_rest(stream) for stream in streams), return_exceptions=True)
    errors = [item for item in started if isinstance(item, BaseException)]
    if errors:
        for item in started:
            if not isinstance(item, BaseException):
                await item.aclose()  # type: ignore[attr-defined]
        raise errors[0]
    return started  # type: ignore[return-value]


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several prompts' streams as (prompt index, output), as they come."""
    if len(streams) == 1:
        async with aclosing(streams[0]):  # type: ignore[type-var]
            async for output in streams[0]:
                yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream):  # type: ignore[type-var]
                async for output in stream:
                    await queue.put((index, output))
            await queue.put((index, None))
        except BaseException as error:  # handed to the consumer, which re-raises
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@dataclass(slots=True)
class ChunkWriter:
    """Server-sent events of one streamed response; with include_usage every chunk has a
    `usage` field (null until the last), as OpenAI sends them."""

    response_id: str
    kind: str  # "text_completion" or "chat.completion.chunk"
    model: str
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def __call__(self, choices: list[dict[str, Any]], usage_value: dict[str, int] | None = None) -> str:
        data: dict[str, Any] = {
            "id": self.response_id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            data["usage"] = usage_value
        return sse(data)


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(o.usage.prompt_tokens for o in outputs)
    completion = sum(o.usage.completion_tokens for o in outputs)
    result = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = sum(o.usage.cached_prompt_tokens for o in outputs)
    if cached:
        result["prompt_tokens_details"] = {"cached_tokens": cached}  # type: ignore[assignment]
    return result


def finish_reason(reason: str | None) -> str | None:
    return None if reason == "abort" else reason
