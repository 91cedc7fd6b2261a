"""`POST /v1/chat/completions`: messages through the model's chat template."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from pagefleet.engine.front.async_engine import AsyncEngine
from pagefleet.engine.front.chat_template import apply_chat_template, template_takes_tools
from pagefleet.engine.front.outputs import CompletionOutput, RequestOutput
from pagefleet.engine.server.errors import OpenAIError
from pagefleet.engine.server.events import ChunkWriter, finish_reason, prompt_logprobs, sse, token_name, usage
from pagefleet.engine.server.generation import (
    DeltaTracker,
    Outputs,
    choice_deltas,
    first_and_rest,
    generate,
    last_output,
    response_id_for,
)
from pagefleet.engine.server.params import sampling_params
from pagefleet.engine.server.state import ServerState, tokenizer_of
from pagefleet.engine.server.streaming import EventStreamResponse
from pagefleet.engine.server.tool_stream import stream_tool_answers
from pagefleet.engine.server.tools import ParsedCall, ToolPlan
from pagefleet.protocol.openai import ChatCompletionRequest
from pagefleet.runtime.chat_prompt import chat_messages, template_tools


def chat_prompt(engine: AsyncEngine, body: ChatCompletionRequest) -> list[int]:
    tokenizer = tokenizer_of(engine)
    takes_tools = template_takes_tools(tokenizer)
    messages = chat_messages(body, takes_tools)
    tools = template_tools(body, takes_tools)
    return apply_chat_template(tokenizer, messages, body.add_generation_prompt, tools, body.continue_final_message)


def _logprobs(body: ChatCompletionRequest, completion: CompletionOutput, start: int) -> dict[str, Any] | None:
    if not body.logprobs or completion.logprobs is None:
        return None
    num_top = math.inf if body.top_logprobs == -1 else body.top_logprobs or 0  # -1: the whole vocabulary

    def entry(token_id: int, text: str, logprob: float) -> dict[str, Any]:
        name = token_name(token_id, text, body.return_tokens_as_token_ids)
        return {"token": name, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for token_id, position in zip(completion.token_ids[start:], completion.logprobs[start:], strict=True):
        chosen = position[token_id]
        item = entry(token_id, chosen.decoded_token, chosen.logprob)
        top = sorted((pair for pair in position.items() if pair[1].rank <= num_top), key=lambda pair: pair[1].rank)
        item["top_logprobs"] = [entry(tid, lp.decoded_token, lp.logprob) for tid, lp in top]
        content.append(item)
    return {"content": content}


@dataclass(slots=True)
class ChatRun:
    """A chat request started in the engine: what the routes that answer it need."""

    response_id: str
    prompt: list[int]
    stream: Outputs  # its first output already arrived (bad input failed before)
    calling: ToolPlan | None  # the tools whose calls the answer is parsed for


async def start_chat(state: ServerState, body: ChatCompletionRequest, response_id: str) -> ChatRun:
    """Validate, render, tokenize and start a chat request as the answer `response_id`
    (the common part of the chat route and of the Anthropic and Responses routes).

    Raises:
        OpenAIError and the engine's InvalidParameterError: bad input, before any output.
    """
    engine = state.ready_engine(body.model)
    state.admit(engine)
    extra: dict[str, Any] = {}
    top = engine.vocab_size if body.top_logprobs == -1 else body.top_logprobs  # -1: the whole vocabulary
    if top is not None and not 0 <= top <= engine.max_logprobs:
        bounds = f"[0, {engine.max_logprobs}] (--max-logprobs), or -1 for the whole vocabulary if it allows that"
        raise OpenAIError(400, f"top_logprobs: must be in {bounds}, got {body.top_logprobs}", "top_logprobs")
    if body.logprobs:
        extra["logprobs"] = top or 0
    elif body.top_logprobs is not None:
        raise OpenAIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
    tools = ToolPlan.of(body)
    constraint = tools.constraint() if tools is not None else None
    if constraint is not None:  # over any response_format, as vLLM: the call must parse
        extra["structured_outputs"] = constraint
    params = sampling_params(body, body.max_completion_tokens or body.max_tokens, **extra)
    lora = state.adapters.request_for(body.model)
    prompt = await asyncio.to_thread(chat_prompt, engine, body)  # a template and a tokenizer: not on the loop
    outputs = generate(state, engine, prompt, params, lora, "chat", response_id, cache_salt=body.cache_salt)
    stream = await first_and_rest(outputs)
    calling = tools if tools is not None and tools.parses_calls else None
    return ChatRun(response_id, prompt, stream, calling)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, header_id: str | None = None) -> Any:
    run = await start_chat(state, body, response_id_for("chatcmpl", header_id, body.request_id))
    response_id, prompt, stream, calling = run.response_id, run.prompt, run.stream, run.calling
    if body.stream:
        model = state.served_name(body.model)
        chunk = ChunkWriter.for_request(
            response_id, "chat.completion.chunk", model, body.stream_options, state.settings
        )
        if calling is not None and calling.choice == "named":  # a call from the first token: streamed as one
            return EventStreamResponse(_stream(body, stream, chunk, prompt, calling.named))
        if calling is not None:
            tool_answers = stream_tool_answers(stream, chunk, calling, body.n, prompt, body.return_token_ids)
            return EventStreamResponse(tool_answers)
        return EventStreamResponse(_stream(body, stream, chunk, prompt))
    final = await last_output(stream)
    echoed = _echoed(body)
    choices = []
    for completion in final.outputs:
        message, reason = assistant_message(completion, calling)
        if echoed:
            message["content"] = echoed + (message["content"] or "")
        choices.append(
            {
                "index": completion.index,
                "message": message,
                "logprobs": _logprobs(body, completion, 0),
                "finish_reason": reason,
                "stop_reason": completion.stop_reason,
                "token_ids": completion.token_ids if body.return_token_ids else None,  # vLLM's, null unless asked
            }
        )
    answer = {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.served_name(body.model),
        "choices": choices,
        "usage": usage([final], state.settings.enable_prompt_tokens_details),
        "prompt_logprobs": prompt_logprobs(final) if body.prompt_logprobs is not None else None,
        "prompt_token_ids": final.prompt_token_ids if body.return_token_ids else None,
        "kv_transfer_params": final.kv_transfer_params,
    }
    return JSONResponse(answer)


def _echoed(body: ChatCompletionRequest) -> str:
    """With `echo`, the text the answer starts with: the last message's, if it is the
    assistant's (vLLM's rule); else nothing."""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""


def assistant_message(completion: CompletionOutput, tools: ToolPlan | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished completion, its tool calls parsed out, and the
    finish reason ("tool_calls" when it called any)."""
    reason = finish_reason(completion.finish_reason)
    if tools is None:
        return {"role": "assistant", "content": completion.text, "tool_calls": []}, reason
    content, calls = tools.parse(completion.text)
    message = {"role": "assistant", "content": content, "tool_calls": [call.as_openai() for call in calls]}
    return message, "tool_calls" if calls and reason == "stop" else reason


async def _stream(
    body: ChatCompletionRequest, stream: Outputs, chunk: ChunkWriter, prompt: list[int], function: str | None = None
) -> AsyncIterator[str]:
    """Per choice: the role first, then content deltas, the last with the finish reason;
    then usage (if asked) and [DONE]. Each chunk carries one choice, as OpenAI and vLLM send
    them: clients read `choices[0]`. With `function` (a named tool choice) the text is that
    call's arguments: the first delta opens the call, the others carry its arguments.
    With `return_token_ids` (vLLM's) the first chunk carries the prompt's token ids and
    each delta its own."""
    prompt_tokens, echoed = len(prompt), _echoed(body) if function is None else ""
    for i in range(body.n):
        opening: dict[str, Any] = {"role": "assistant", "content": ""}
        if function is not None:
            call = ParsedCall(function, "").as_openai()
            opening = {"role": "assistant", "content": None, "tool_calls": [{"index": 0, **call}]}
        ids = {"prompt_token_ids": prompt} if body.return_token_ids and i == 0 else {}
        opened = {"index": i, "delta": opening, "logprobs": None, "finish_reason": None}
        yield chunk([opened], chunk.so_far(prompt_tokens, 0), **ids)
        if echoed:
            echo = {"index": i, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None}
            yield chunk([echo], chunk.so_far(prompt_tokens, 0))
    tracker = DeltaTracker()
    final: RequestOutput | None = None
    async with aclosing(choice_deltas(stream, tracker)) as deltas:
        async for output, completion, delta in deltas:
            final, i = output, completion.index
            choice: dict[str, Any] = {"index": i, "delta": {}, "logprobs": None, "finish_reason": None}
            logprobs = _logprobs(body, completion, delta.first_token)
            if delta.text or (logprobs and logprobs["content"]):
                choice["delta"] = {"content": delta.text}
                if function is not None:
                    choice["delta"] = {"tool_calls": [{"index": 0, "function": {"arguments": delta.text}}]}
                choice["logprobs"] = logprobs
            if delta.is_last:
                reason = finish_reason(completion.finish_reason)
                choice["finish_reason"] = "tool_calls" if function is not None and reason == "stop" else reason
            if choice["delta"] or delta.is_last:
                # Marked sent only once sent: tokens whose text is an incomplete UTF-8
                # sequence (no text yet) go out with the next chunk, ids and logprobs too.
                tracker.sent(i, completion)
                if body.return_token_ids:
                    choice["token_ids"] = completion.token_ids[delta.first_token :]
                yield chunk([choice], chunk.so_far(prompt_tokens, len(completion.token_ids)))
    if chunk.include_usage and final is not None:
        yield chunk([], chunk.usage([final]))
    yield sse("[DONE]")
