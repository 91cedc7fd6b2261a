"""`POST /v1/chat/completions`: messages through the model's chat template."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse

from pagefleet.engine.async_engine import AsyncEngine
from pagefleet.engine.chat_template import apply_chat_template
from pagefleet.engine.outputs import CompletionOutput, RequestOutput
from pagefleet.engine.server.errors import OpenAIError
from pagefleet.engine.server.events import ChunkWriter, finish_reason, sse, usage
from pagefleet.engine.server.generation import DeltaTracker, Outputs, first_and_rest, generate, last_output
from pagefleet.engine.server.params import sampling_params
from pagefleet.engine.server.state import ServerState
from pagefleet.engine.server.streaming import EventStreamResponse
from pagefleet.protocol.openai import ChatCompletionRequest


def chat_prompt(engine: AsyncEngine, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    return apply_chat_template(engine.tokenizer, messages, body.add_generation_prompt)


def _logprobs(body: ChatCompletionRequest, completion: CompletionOutput, start: int) -> dict[str, Any] | None:
    if not body.logprobs or completion.logprobs is None:
        return None
    num_top = body.top_logprobs or 0

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for token_id, position in zip(completion.token_ids[start:], completion.logprobs[start:], strict=True):
        chosen = position[token_id]
        item = entry(chosen.decoded_token, chosen.logprob)
        top = sorted((lp for lp in position.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
        item["top_logprobs"] = [entry(lp.decoded_token, lp.logprob) for lp in top]
        content.append(item)
    return {"content": content}


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest) -> Any:
    engine = state.ready_engine(body.model)
    state.admit(engine)
    extra: dict[str, Any] = {}
    if body.logprobs:
        extra["logprobs"] = body.top_logprobs or 0
    elif body.top_logprobs is not None:
        raise OpenAIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
    params = sampling_params(body, body.max_completion_tokens or body.max_tokens, **extra)
    stream = await first_and_rest(generate(state.metrics, engine, chat_prompt(engine, body), params))
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(_stream(state, body, response_id, stream, include_usage))
    final = await last_output(stream)
    choices = [
        {
            "index": completion.index,
            "message": {"role": "assistant", "content": completion.text},
            "logprobs": _logprobs(body, completion, 0),
            "finish_reason": finish_reason(completion.finish_reason),
            "stop_reason": completion.stop_reason,
        }
        for completion in final.outputs
    ]
    return JSONResponse(
        {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.settings.model_name,
            "choices": choices,
            "usage": usage([final]),
        }
    )


async def _stream(
    state: ServerState,
    body: ChatCompletionRequest,
    response_id: str,
    stream: Outputs,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Per choice: the role first, then content deltas, then the finish reason; then usage
    (if asked) and [DONE]."""
    chunk = ChunkWriter(response_id, "chat.completion.chunk", state.settings.model_name, include_usage)
    yield chunk(
        [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(body.n)
        ]
    )
    tracker = DeltaTracker()
    final: RequestOutput | None = None
    async with aclosing(stream):
        async for output in stream:
            final = output
            choices = []
            for completion in output.outputs:
                i = completion.index
                delta = tracker.delta(i, completion)
                if delta is None:
                    continue
                logprobs = _logprobs(body, completion, delta.first_token)
                if delta.text or (logprobs and logprobs["content"]):
                    choices.append(
                        {"index": i, "delta": {"content": delta.text}, "logprobs": logprobs, "finish_reason": None}
                    )
                tracker.sent(i, completion)
                if delta.is_last:
                    reason = finish_reason(completion.finish_reason)
                    choices.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": reason})
            if choices:
                yield chunk(choices)
    if include_usage and final is not None:
        yield chunk([], usage([final]))
    yield sse("[DONE]")
