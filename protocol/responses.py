"""OpenAI's Responses API (`POST /v1/responses`, the portable OpenResponses subset): its
request shapes, and a request (with the conversation before it) as the OpenAI chat request
the engine already serves.

The engine server answers these (engine/server/responses.py); the gateway and the picker
turn a request into the same chat request to hash its prompt exactly as the replica will,
so a follow-up through `previous_response_id` lands where its conversation is cached.
Only function tools are served; input kinds a text model cannot take (images, files) are
refused by validation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from pagefleet.protocol.openai import ChatCompletionRequest

RESPONSES_PATH = "/v1/responses"


class InputText(BaseModel):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    """A message of the conversation; `developer` is a system message, as OpenAI treats it."""

    model_config = ConfigDict(extra="allow")  # an output message replayed: id, status, annotations

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made earlier (as a client replays its output)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """The client's answer to one of the model's calls."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return str(kind)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    """`text.format`: plain text, any JSON object, or JSON of a schema (flat, as Responses
    writes it: `name`, `schema`, `strict` beside `type`)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs its schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity: accepted, not used

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # reasoning, include, service_tier...: accepted, not used

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    truncation: Literal["auto", "disabled"] = "disabled"
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    # vLLM's extras, as on chat: a sampling knob, reproducible sampling, a cache partition.
    top_k: int | None = None
    seed: int | None = None
    cache_salt: str | None = Field(None, min_length=1)

    @field_validator("input")
    @classmethod
    def _something_to_answer(cls, value: str | list[Any]) -> str | list[Any]:
        if isinstance(value, list) and not value:
            raise ValueError("input must hold at least one item")
        return value

    @model_validator(mode="after")
    def _background_is_stored(self) -> ResponsesRequest:
        if self.background and not self.store:
            raise ValueError("background responses must be stored (store: true)")
        if self.background and self.stream:
            raise ValueError("background responses are not streamed here: poll GET /v1/responses/{id}")
        return self


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages: consecutive function calls become one
    assistant message with their `tool_calls`, a call's output a `tool` message."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def as_chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The same turn as an OpenAI chat request: this request's `instructions` as the system
    message (a previous response's instructions are not carried over, as OpenAI does), then
    the conversation before it (`history`, chat messages), then its input."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages + input_messages(body),
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
            }
            for t in body.tools
        ]
    if isinstance(body.tool_choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type != "text":
        chat["response_format"] = {"type": text_format.type}
        if text_format.type == "json_schema":
            chat["response_format"]["json_schema"] = {
                "name": text_format.name,
                "schema": text_format.schema_,
                "strict": text_format.strict,
            }
    fields = {
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "user": body.user,
        "cache_salt": body.cache_salt,
    }
    chat.update({key: value for key, value in fields.items() if value is not None})
    return ChatCompletionRequest.model_validate(chat)
