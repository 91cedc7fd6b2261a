"""OpenAI's Responses API on the engine server: `POST /v1/responses`, and for stored
responses `GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` and
`GET /v1/responses/{id}/input_items`.

A request, with the conversation of its `previous_response_id` read from the store, becomes
the chat request the chat route serves (protocol/responses.py) and runs through the same
start (chat.start_chat: template, tools, constraints, engine). Stored responses live in
Redis when the server has a `--redis-url` (so a follow-up works on any replica and through
any gateway), else in this process (runtime/response_store.py). A `background` response
is started (bad input still fails at once), answered as `in_progress`, and finished by a
task of this replica; a cancel sent to another replica is passed on to this one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagefleet.engine.front.async_engine import AsyncEngine
from pagefleet.engine.server.chat import ChatRun, chat_prompt, start_chat
from pagefleet.engine.server.errors import OpenAIError
from pagefleet.engine.server.generation import DeltaTracker, last_output
from pagefleet.engine.server.response_objects import (
    Answer,
    EventWriter,
    answer_of,
    error_of,
    new_response_id,
    response_object,
)
from pagefleet.engine.server.state import ServerState
from pagefleet.engine.server.stored_responses import StoredResponses
from pagefleet.engine.server.streaming import EventStreamResponse, cancel_on_disconnect
from pagefleet.protocol.openai import ChatCompletionRequest
from pagefleet.protocol.responses import ResponsesRequest, as_chat_request
from pagefleet.runtime.response_store import StoredResponse, StoreUnavailable

logger = logging.getLogger(__name__)

CANCEL_FORWARD_TIMEOUT_S = 10.0


@dataclass(slots=True)
class Turn:
    """One request of a conversation, as it runs: what every answer path needs to build,
    stream and store its response."""

    body: ResponsesRequest
    chat: ChatCompletionRequest
    response_id: str
    model: str
    input_items: list[dict[str, Any]]  # the request's input, each item with an id (made once)
    created_at: float = field(default_factory=time.time)

    def response(
        self, status: str, answer: Answer | None = None, error: dict[str, str] | None = None
    ) -> dict[str, Any]:
        return response_object(self.body, self.response_id, self.model, self.created_at, status, answer, error)

    def record(self, response: dict[str, Any], answer: Answer | None, own_url: str) -> StoredResponse:
        """The stored form: the conversation so far (without the instructions, which a
        follow-up does not inherit) and this turn's input items."""
        messages = [message.model_dump(exclude_none=True) for message in self.chat.messages]
        if self.body.instructions:
            messages = messages[1:]
        if answer is not None:
            messages.append(answer.message)
        return StoredResponse(
            response=response, conversation=messages, input_items=self.input_items, replica_url=own_url
        )


def _input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(body.input, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": body.input}]}]
    else:
        items = [item.model_dump(exclude_none=True) for item in body.input]
    return [{**item, "id": item.get("id") or f"item_{uuid.uuid4().hex}"} for item in items]


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    stored = state.responses

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, _create(state, body))

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        return (await stored.record(response_id)).response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        await stored.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request) -> Response:
        return await _cancel(stored, response_id, request.headers.get("authorization"))

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
        items = (await stored.record(response_id)).input_items
        data = items if order == "asc" else items[::-1]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": False}


async def _create(state: ServerState, body: ResponsesRequest) -> Response:
    engine = state.ready_engine(body.model)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        try:
            history = (await state.responses.record(body.previous_response_id)).conversation
        except OpenAIError as error:
            if error.status != 404:
                raise
            message = f"Previous response with id '{body.previous_response_id}' not found."
            raise OpenAIError(404, message, "previous_response_id") from error
    chat = as_chat_request(body, history)
    if body.truncation == "auto":
        chat = _truncated(engine, chat, body.max_output_tokens or 1)
    turn = Turn(body, chat, new_response_id(), state.served_name(body.model), _input_items(body))
    run = await start_chat(state, chat, turn.response_id)  # bad input fails here, before any answer
    stored = state.responses
    if body.background:
        queued = turn.response("in_progress")
        try:
            await stored.save(turn.record(queued, None, stored.own_url))
        except OpenAIError:  # the store is down: nobody could read its answer, so it stops here
            await run.stream.aclose()
            raise
        stored.running[turn.response_id] = asyncio.create_task(_finish_in_background(stored, turn, run))
        return JSONResponse(queued)
    if body.stream:
        return EventStreamResponse(_stream(stored, turn, run))
    answer = answer_of(run, await last_output(run.stream))
    response = turn.response(answer.status, answer)
    if body.store:
        await stored.save(turn.record(response, answer, stored.own_url))
    return JSONResponse(response)


def _truncated(engine: AsyncEngine, chat: ChatCompletionRequest, max_output_tokens: int) -> ChatCompletionRequest:
    """`truncation: auto`: the oldest turns dropped (never the system message or the last
    message, nor a tool's answer without its call) until the prompt and its answer fit."""
    budget = engine.max_model_len - max_output_tokens
    messages = list(chat.messages)
    first = 1 if messages[0].role == "system" else 0
    while (
        len(messages) - first > 1 and len(chat_prompt(engine, chat.model_copy(update={"messages": messages}))) > budget
    ):
        del messages[first]
        while len(messages) - first > 1 and messages[first].role == "tool":
            del messages[first]
    return chat.model_copy(update={"messages": messages})


async def _finish_in_background(stored: StoredResponses, turn: Turn, run: ChatRun) -> None:
    """Run a background response to its end and store how it ended (unless it was deleted
    meanwhile): completed, incomplete, failed, or cancelled."""
    answer: Answer | None = None
    error: dict[str, str] | None = None
    try:
        answer = answer_of(run, await last_output(run.stream))
        status = answer.status
    except asyncio.CancelledError:  # a cancel: the engine request was aborted as the stream closed
        status = "cancelled"
    except Exception as failure:  # a task boundary: recorded as the response's failure
        logger.error("background response %s failed", turn.response_id, exc_info=True)
        status, error = "failed", error_of(failure)
    try:
        record = turn.record(turn.response(status, answer, error), answer, stored.own_url)
        await stored.store.put(record, replace_only=True)
    except StoreUnavailable:
        logger.warning("background response %s ended %s but could not be stored", turn.response_id, status)
    finally:
        stored.running.pop(turn.response_id, None)


async def _cancel(stored: StoredResponses, response_id: str, authorization: str | None) -> Response:
    """Cancel a background response where it runs: here, or on the replica that started it
    (a replica that is gone runs nothing: its response is marked cancelled). A finished one
    is answered as it is; a response that was not run in the background cannot be."""
    record = await stored.record(response_id)
    task = stored.running.get(response_id)
    if task is not None:
        task.cancel()
        await asyncio.wait([task])
        return JSONResponse((await stored.record(response_id)).response)
    if not record.response.get("background"):
        raise OpenAIError(400, "Only background responses can be cancelled.", "response_id")
    if not record.is_running:
        return JSONResponse(record.response)
    owner = record.replica_url
    if owner is not None and owner != stored.own_url:
        headers = {"authorization": authorization} if authorization else {}
        try:
            async with httpx.AsyncClient(timeout=CANCEL_FORWARD_TIMEOUT_S) as client:
                answer = await client.post(f"{owner}/v1/responses/{response_id}/cancel", headers=headers)
            return Response(answer.content, answer.status_code, media_type="application/json")
        except httpx.TransportError:
            logger.warning("the replica running response %s (%s) is unreachable", response_id, owner)
    record.response.update(status="cancelled")
    await stored.save(record, replace_only=True)
    return JSONResponse(record.response)


async def _stream(stored: StoredResponses, turn: Turn, run: ChatRun) -> AsyncIterator[str]:
    """The typed events: created, in_progress, each output item (a text item as it is
    generated; with tools the answer is parsed at its end, then sent item by item), then
    completed or incomplete; a failure after the first byte ends with `error` and
    `response.failed`."""
    write = EventWriter()
    started = turn.response("in_progress")
    yield write("response.created", response=started)
    yield write("response.in_progress", response=started)
    try:
        if run.calling is None:
            item_id = f"msg_{turn.response_id.removeprefix('resp_')}"
            for event in write.text_opening(0, item_id):
                yield event
            tracker, final = DeltaTracker(), None
            async with aclosing(run.stream) as outputs:
                async for output in outputs:
                    final, completion = output, output.outputs[0]
                    delta = tracker.delta(0, completion)
                    if delta is not None and delta.text:
                        yield write.text_delta(0, item_id, delta.text)
                    if delta is not None:
                        tracker.sent(0, completion)
            assert final is not None, "the engine ends every request with an output"
            answer = answer_of(run, final)
            answer.output[0]["id"] = item_id
            for event in write.text_closing(0, answer.output[0]):
                yield event
        else:
            answer = answer_of(run, await last_output(run.stream))
            for index, item in enumerate(answer.output):
                for event in write.item_events(index, item):
                    yield event
        response = turn.response(answer.status, answer)
        if turn.body.store:
            await stored.save(turn.record(response, answer, stored.own_url))
        yield write(f"response.{answer.status}", response=response)
    except Exception as failure:  # after the first byte: the stream ends with the failure
        error = error_of(failure)
        logger.error("a streamed response failed: %s", error["message"], exc_info=error["code"] == "server_error")
        yield write("error", code=error["code"], message=error["message"], param=None)
        yield write("response.failed", response=turn.response("failed", error=error))
