"""Engine output streams as the routes use them: metered, started early (so bad input fails
before a response begins), merged across prompts, drained to the last output, and turned
into per-choice deltas."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from opentelemetry import context as otel_context

from pagefleet.engine.front.async_engine import AsyncEngine
from pagefleet.engine.front.inputs import TextPrompt, TokensPrompt
from pagefleet.engine.front.outputs import CompletionOutput, RequestOutput
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.sample.sampling_params import RequestOutputKind, SamplingParams
from pagefleet.engine.server.kv_peers import PEER_HINT
from pagefleet.engine.server.state import ServerState

Outputs = AsyncGenerator[RequestOutput, None]


def response_id_for(prefix: str, header_id: str | None, body_id: str | None) -> str:
    """vLLM's response id: `prefix` and the caller's `x-request-id` header, else the body's
    `request_id`, else a new one; so the gateway's request id names the replica's work too."""
    return f"{prefix}-{header_id or body_id or uuid.uuid4().hex}"


def salted(prompt: str | list[int], cache_salt: str) -> TextPrompt | TokensPrompt:
    """The prompt with vLLM's `cache_salt`, in the engine's dict shapes."""
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": cache_salt}
    return {"prompt_token_ids": prompt, "cache_salt": cache_salt}


async def generate(
    state: ServerState,
    engine: AsyncEngine,
    prompt: str | list[int],
    params: SamplingParams,
    lora_request: LoRARequest | None,
    operation: str,
    response_id: str,
    prompt_index: int = 0,
    cache_salt: str | None = None,
) -> Outputs:
    """The engine's outputs for one prompt (`prompt_index` of the response `response_id`),
    with latency metrics and, if tracing is on, its span (`operation`: "chat" or
    "text_completion"). Closing the generator early (a client gone) aborts the request and
    frees its blocks. A decode request's prompt KV is pulled first (kv_transfer.py)."""
    metrics = state.metrics
    started = last = time.monotonic()
    parent = otel_context.get_current()  # the HTTP request's span, when traced
    tokens_seen = 0
    output: RequestOutput | None = None
    error: BaseException | None = None
    # Its id in the engine's logs: unique even when a caller reuses its x-request-id.
    request_id = f"{response_id}-{prompt_index}-{uuid.uuid4().hex[:8]}"
    try:
        engine_prompt, remote_kv = await state.transfers.prepare(engine, prompt, params)
        if remote_kv is None and PEER_HINT.get() is not None and params.prompt_logprobs is None:
            engine_prompt = await asyncio.to_thread(engine.prompt_token_ids, engine_prompt, params)  # once
            root = engine.hash_root(engine_prompt, lora_request, cache_salt)
            remote_kv = await state.transfers.peers.pull(engine, engine_prompt, root)
        if cache_salt is not None:
            assert not isinstance(engine_prompt, dict), "prepare gives back the prompt or its token ids"
            engine_prompt = salted(engine_prompt, cache_salt)
        # The engine sends deltas (no copy of what it sent before); the routes read them
        # gathered (`Gathered`), without copying either.
        delta_params = params.with_output_kind(RequestOutputKind.DELTA)
        gathered = Gathered(params)
        async with aclosing(
            engine.generate(engine_prompt, delta_params, request_id, remote_kv, lora_request)
        ) as outputs:
            async for delta in outputs:
                output = gathered.add(delta)
                tokens = sum(len(c.token_ids) for c in output.outputs)
                if tokens > tokens_seen:
                    now = time.monotonic()
                    first = tokens_seen == 0
                    metrics.observe_token_gap(first, (now - started) if first else (now - last))
                    last, tokens_seen = now, tokens
                yield output
        metrics.e2e_request_latency.observe(time.monotonic() - started)
    except BaseException as exc:  # recorded on the span, then raised as it was
        error = exc if not isinstance(exc, GeneratorExit | asyncio.CancelledError) else None
        raise
    finally:
        if output is not None and metrics.vllm is not None:
            now = time.monotonic()
            metrics.vllm.finished(output, params, now - started, now)
        if state.tracing is not None:
            model = lora_request.lora_name if lora_request is not None else state.settings.model_name
            state.tracing.record(parent, operation, model, response_id, request_id, params, output, started, error)


class Gathered:
    """A request's outputs so far, gathered from the engine's DELTA outputs: each sample's
    text, tokens and logprobs grow in place (appends only), so reading them after every
    step costs what the step added. Beams and best_of > n come whole and pass through."""

    def __init__(self, params: SamplingParams) -> None:
        self._whole = params.use_beam_search or params.num_sequences > params.n
        self._samples: dict[int, CompletionOutput] = {}

    def add(self, delta: RequestOutput) -> RequestOutput:
        """`delta` folded in; the request's outputs so far, in the engine's cumulative shape."""
        if self._whole:
            return delta
        for news in delta.outputs:
            sample = self._samples.get(news.index)
            if sample is None:
                sample = self._samples[news.index] = CompletionOutput(news.index, "", [])
            sample.text += news.text
            sample.token_ids.extend(news.token_ids)
            if news.logprobs is not None:
                if sample.logprobs is None:
                    sample.logprobs = []
                sample.logprobs.extend(news.logprobs)
            sample.cumulative_logprob = news.cumulative_logprob
            sample.finish_reason, sample.stop_reason = news.finish_reason, news.stop_reason
        delta.outputs = [self._samples[index] for index in sorted(self._samples)]
        return delta


async def first_and_rest(stream: Outputs) -> Outputs:
    """Start `stream` now, so that invalid input fails before a streaming response begins."""
    try:
        first = await anext(stream)
    except BaseException:
        await stream.aclose()
        raise

    async def replay() -> Outputs:
        async with aclosing(stream):
            yield first
            async for item in stream:
                yield item

    return replay()


async def start_all(streams: list[Outputs]) -> list[Outputs]:
    """`first_and_rest` for several prompts at once; if one fails, the others are closed."""
    started = await asyncio.gather(*(first_and_rest(stream) for stream in streams), return_exceptions=True)
    ready = [item for item in started if not isinstance(item, BaseException)]
    if len(ready) < len(started):
        for item in ready:
            await item.aclose()
        raise next(item for item in started if isinstance(item, BaseException))
    return ready


async def last_output(stream: Outputs) -> RequestOutput:
    """Drain a request to its final output."""
    final = None
    async with aclosing(stream):
        async for output in stream:
            final = output
    assert final is not None, "the engine ends every request with an output"
    return final


async def merge(streams: list[Outputs]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several prompts' streams as (prompt index, output), as they come."""
    if len(streams) == 1:
        async with aclosing(streams[0]):
            async for output in streams[0]:
                yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: Outputs) -> None:
        try:
            async with aclosing(stream):
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


@dataclass(slots=True, frozen=True)
class Delta:
    """What one choice gained since it was last sent."""

    text: str
    first_token: int  # index of the first token not sent yet (its logprobs start there)
    is_first: bool  # nothing of this choice was sent before
    is_last: bool  # the choice finished with this output


@dataclass(slots=True)
class DeltaTracker:
    """Turns the engine's cumulative outputs into stream deltas, choice by choice."""

    _sent: dict[int, tuple[int, int]] = field(default_factory=dict)  # choice -> (characters, tokens)
    _finished: set[int] = field(default_factory=set)

    def delta(self, choice: int, completion: CompletionOutput) -> Delta | None:
        """The choice's news in `completion`; None once it finished in an earlier output."""
        if choice in self._finished:
            return None
        if completion.finished:
            self._finished.add(choice)
        chars, tokens = self._sent.get(choice, (0, 0))
        return Delta(completion.text[chars:], tokens, choice not in self._sent, completion.finished)

    def sent(self, choice: int, completion: CompletionOutput) -> None:
        """Record that the choice's text and tokens up to `completion` went out."""
        self._sent[choice] = (len(completion.text), len(completion.token_ids))


async def choice_deltas(
    stream: Outputs, tracker: DeltaTracker
) -> AsyncGenerator[tuple[RequestOutput, CompletionOutput, Delta], None]:
    """Each choice's news in each output of `stream` (closed when the caller stops), with the
    output it came in; the caller says what it sent (`tracker.sent`)."""
    async with aclosing(stream):
        async for output in stream:
            for completion in output.outputs:
                delta = tracker.delta(completion.index, completion)
                if delta is not None:
                    yield output, completion, delta
