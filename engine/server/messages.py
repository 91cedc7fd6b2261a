"""Anthropic's Messages API on the engine server: `POST /v1/messages` and
`POST /v1/messages/count_tokens`, for the clients and agents that speak it.

A request becomes the OpenAI chat request the chat route serves (protocol/anthropic.py),
runs through the same start (chat.start_chat: template, tools, constraints, engine), and
is answered in Anthropic's shapes: content blocks (`text`, `tool_use`), `stop_reason`,
`usage`, and when streamed Anthropic's event sequence (`message_start`,
`content_block_start`/`_delta`/`_stop`, `message_delta`, `message_stop`). Errors come in
Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`): before a stream
starts as a status (errors.error_for, by path), after it as an `error` event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagefleet.engine.front.outputs import CompletionOutput, RequestOutput
from pagefleet.engine.server.chat import ChatRun, chat_prompt, start_chat
from pagefleet.engine.server.errors import status_of
from pagefleet.engine.server.generation import DeltaTracker, last_output, response_id_for
from pagefleet.engine.server.state import ServerState
from pagefleet.engine.server.streaming import EventStreamResponse, cancel_on_disconnect
from pagefleet.engine.server.tools import ParsedCall
from pagefleet.protocol.anthropic import CountTokensRequest, MessagesRequest, as_chat_request, error_body

logger = logging.getLogger(__name__)


def add_messages_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, _respond(state, body, request.headers.get("x-request-id")))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return {"input_tokens": len(chat_prompt(state.ready_engine(body.model), as_chat_request(body)))}


async def _respond(state: ServerState, body: MessagesRequest, header_id: str | None) -> Response:
    run = await start_chat(state, as_chat_request(body), response_id_for("msg", header_id, None))
    if body.stream:
        return EventStreamResponse(_stream(state, body, run))
    return JSONResponse(await _answer(state, body, run))


def _stop(body: MessagesRequest, completion: CompletionOutput, called: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished completion."""
    if called:
        return "tool_use", None
    if completion.finish_reason == "length":
        return "max_tokens", None
    stop = completion.stop_reason
    if isinstance(stop, str) and stop in (body.stop_sequences or []):
        return "stop_sequence", stop
    return "end_turn", None


def _blocks(run: ChatRun, completion: CompletionOutput) -> list[dict[str, Any]]:
    """The answer's content blocks: its text, then each tool call as a `tool_use`."""
    if run.calling is None:
        return [{"type": "text", "text": completion.text}]
    content, calls = run.calling.parse(completion.text)
    blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    return blocks + [_tool_use(call) for call in calls]


def _tool_use(call: ParsedCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {
        "type": "tool_use",
        "id": call.as_openai()["id"].replace("call_", "toolu_"),
        "name": call.name,
        "input": arguments,
    }


def _usage(output: RequestOutput) -> dict[str, int]:
    """Anthropic's: input tokens not read from the cache, those read from it, output tokens."""
    cached = output.usage.cached_prompt_tokens
    return {
        "input_tokens": output.usage.prompt_tokens - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": output.usage.completion_tokens,
    }


def _message(state: ServerState, body: MessagesRequest, run: ChatRun) -> dict[str, Any]:
    return {
        "id": run.response_id,
        "type": "message",
        "role": "assistant",
        "model": state.served_name(body.model),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
    }


async def _answer(state: ServerState, body: MessagesRequest, run: ChatRun) -> dict[str, Any]:
    final = await last_output(run.stream)
    completion = final.outputs[0]
    blocks = _blocks(run, completion)
    stop_reason, stop_sequence = _stop(body, completion, any(b["type"] == "tool_use" for b in blocks))
    return {
        **_message(state, body, run),
        "content": blocks,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(final),
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


async def _stream(state: ServerState, body: MessagesRequest, run: ChatRun) -> AsyncIterator[str]:
    """Text streams as it is generated; with tools the answer is parsed at its end (only
    then is it known to be a call) and sent block by block."""
    message = _message(state, body, run)
    usage = {"input_tokens": len(run.prompt), "output_tokens": 0}
    yield _event("message_start", {"message": {**message, "usage": usage}})
    try:
        final: RequestOutput | None = None
        if run.calling is None:
            yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            tracker = DeltaTracker()
            async with aclosing(run.stream) as outputs:
                async for output in outputs:
                    final = output
                    completion = output.outputs[0]
                    delta = tracker.delta(0, completion)
                    if delta is not None and delta.text:
                        yield _event(
                            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": delta.text}}
                        )
                    if delta is not None:
                        tracker.sent(0, completion)
            yield _event("content_block_stop", {"index": 0})
            called = False
        else:
            final = await last_output(run.stream)
            blocks = _blocks(run, final.outputs[0])
            for index, block in enumerate(blocks):
                if block["type"] == "text":
                    yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                    delta = {"type": "text_delta", "text": block["text"]}
                else:
                    yield _event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
                    delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                yield _event("content_block_delta", {"index": index, "delta": delta})
                yield _event("content_block_stop", {"index": index})
            called = any(block["type"] == "tool_use" for block in blocks)
        assert final is not None
        stop_reason, stop_sequence = _stop(body, final.outputs[0], called)
        yield _event(
            "message_delta",
            {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": _usage(final)},
        )
        yield _event("message_stop", {})
    except Exception as error:  # after the first byte: Anthropic's error event ends the stream
        status, text = status_of(error)
        logger.error("a streamed messages response failed (%d): %s", status, text, exc_info=status >= 500)
        yield _event("error", {"error": error_body(status, text)["error"]})
