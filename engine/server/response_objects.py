"""The Responses API's objects, built from a chat run: the response itself, its output
items (an assistant message, function calls), its usage, the conversation it extends, and
when streamed its typed events (`response.created` ... `response.completed`), each with
its `sequence_number`.

Pure builders: engine/server/responses.py runs the request and stores what these build.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.server.chat import ChatRun
from pagefleet.engine.server.errors import status_of
from pagefleet.protocol.responses import FunctionChoice, ResponsesRequest


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class Answer:
    """A finished completion as the Responses API states it."""

    status: str  # "completed" or "incomplete" (cut by max_output_tokens)
    output: list[dict[str, Any]]  # output items
    message: dict[str, Any]  # the same as one assistant chat message (the conversation's next turn)
    usage: dict[str, Any]


def answer_of(run: ChatRun, final: RequestOutput) -> Answer:
    completion = final.outputs[0]
    content, calls = run.calling.parse(completion.text) if run.calling is not None else (completion.text, [])
    status = "incomplete" if completion.finish_reason == "length" else "completed"
    output = [message_item(content or "", status)] if content or not calls else []
    tool_calls = []
    for call in calls:
        openai_call = call.as_openai()
        tool_calls.append(openai_call)
        output.append(
            {
                "type": "function_call",
                "id": _item_id("fc"),
                "call_id": openai_call["id"],
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            }
        )
    message: dict[str, Any] = {"role": "assistant", "content": content or ("" if not calls else None)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return Answer(status, output, message, usage_of(final))


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or _item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [output_text(text)] if status != "in_progress" else [],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage_of(output: RequestOutput) -> dict[str, Any]:
    prompt, generated = output.usage.prompt_tokens, output.usage.completion_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": output.usage.cached_prompt_tokens},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


def response_object(
    body: ResponsesRequest,
    response_id: str,
    model: str,
    created_at: float,
    status: str,
    answer: Answer | None = None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The response object in `status`; with the `answer` once it finished."""
    text_format = body.text.format if body.text is not None else None
    tool_choice = body.tool_choice or "auto"
    done = status not in ("queued", "in_progress")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": time.time() if done and status == "completed" else None,
        "status": status,
        "background": body.background,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": answer.output if answer is not None else [],
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": body.store,
        "temperature": body.temperature,
        "text": {
            "format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}
        },
        "tool_choice": tool_choice.model_dump() if isinstance(tool_choice, FunctionChoice) else tool_choice,
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "top_p": body.top_p,
        "truncation": body.truncation,
        "usage": answer.usage if answer is not None else None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def error_of(error: BaseException) -> dict[str, str]:
    """A failed response's `error`."""
    status, message = status_of(error)
    return {"code": "invalid_request" if status == 400 else "server_error", "message": message}


@dataclass(slots=True)
class EventWriter:
    """Server-sent events of one streamed response, numbered in the order they are sent."""

    _sequence: int = 0

    def __call__(self, kind: str, **data: Any) -> str:
        event = {"type": kind, "sequence_number": self._sequence, **data}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"

    def item_events(self, index: int, item: dict[str, Any]) -> list[str]:
        """A finished item sent whole: added, its content in one delta, done."""
        if item["type"] == "function_call":
            events = [
                self(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"},
                ),
                self(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                ),
                self(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                ),
            ]
            return [*events, self("response.output_item.done", output_index=index, item=item)]
        text = item["content"][0]["text"]
        events = self.text_opening(index, item["id"])
        events.append(self.text_delta(index, item["id"], text))
        return events + self.text_closing(index, item)

    def text_opening(self, index: int, item_id: str) -> list[str]:
        item = message_item("", "in_progress", item_id)
        part = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self("response.output_item.added", output_index=index, item=item),
            self("response.content_part.added", **part, part=output_text("")),
        ]

    def text_delta(self, index: int, item_id: str, delta: str) -> str:
        part = {"item_id": item_id, "output_index": index, "content_index": 0}
        return self("response.output_text.delta", **part, delta=delta, logprobs=[])

    def text_closing(self, index: int, item: dict[str, Any]) -> list[str]:
        text = item["content"][0]["text"]
        part = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self("response.output_text.done", **part, text=text, logprobs=[]),
            self("response.content_part.done", **part, part=output_text(text)),
            self("response.output_item.done", output_index=index, item=item),
        ]
