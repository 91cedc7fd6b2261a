"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): its request
shapes, and a request as the OpenAI chat request the engine already serves.

The engine server and the gateway both read these: the server answers them (engine/server/
messages.py), the gateway routes them by `model` like chat. Content blocks of kinds a text
model cannot take (images, documents) are refused by validation, with Anthropic's error.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagefleet.protocol.openai import ChatCompletionRequest

MESSAGES_PATH = "/v1/messages"  # and its count_tokens beneath
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control and the like: accepted, not used

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(BaseModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted (its user_id), not used


def as_chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The same conversation as an OpenAI chat request: the system prompt first, tool uses
    as an assistant's tool calls, tool results as `tool` messages, tools as functions."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(block.text for block in body.system)
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        messages += _chat_messages(message)
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in body.tools
        ]
    if body.tool_choice is not None:
        choice = body.tool_choice
        if choice.type == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name or ""}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stream=body.stream)
        sampling = {"stop": body.stop_sequences, "temperature": body.temperature, "top_p": body.top_p}
        chat.update({key: value for key, value in {**sampling, "top_k": body.top_k}.items() if value is not None})
    return ChatCompletionRequest.model_validate(chat)


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
    if message.role == "assistant":
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in message.content
            if isinstance(b, ToolUseBlock)
        ]
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]
    results = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
        for b in message.content
        if isinstance(b, ToolResultBlock)
    ]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
