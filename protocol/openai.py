"""The OpenAI API shapes that the engine server and the gateway both speak.

Requests are validated here; unknown fields are accepted and ignored, as OpenAI clients
send fields that servers do not implement. Responses are built by the server.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its usage so far


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingFields(BaseModel):
    """Fields that completions and chat share (vLLM's extensions included)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # None (or absent): the served base model, as in vLLM
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # a 64-bit seed, as vLLM bounds it
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, as OpenAI's; not used
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON keys are) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's prefill/decode disaggregation handshake (see docs/disaggregation.md).
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: the id the response and the engine's logs and traces carry (an x-request-id header wins).
    request_id: str | None = None
    # vLLM's: requests with different salts never share prefix-cache blocks (nor are routed on them).
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's token-level outputs: the prompt's and the answer's token ids, and the prompt's logprobs.
    return_token_ids: bool = False
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be given when stream is true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_bounds(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit():
                raise ValueError(f"keys must be token ids, got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {token}")
        return value


class CompletionRequest(_SamplingFields):
    prompt_embeds: str | list[str] | None = None  # vLLM's (base64 tensors): refused, this server takes none
    prompt: str | list[str] | list[int] | list[list[int]] | None = Field(None, validate_default=True)
    max_tokens: int | None = 16
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @field_validator("prompt")
    @classmethod
    def _a_prompt(cls, value: Any, info: ValidationInfo) -> Any:
        if value in (None, "", []) and not info.data.get("prompt_embeds"):
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")  # vLLM's words
        return value


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)  # any role the chat template knows, as vLLM hands them on
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one of them

    def text(self) -> str:
        """The message's text; content parts of type "text" are joined."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's chat prefill: the answer continues the last (assistant) message instead of
    # opening a new one; `echo` puts that message's text before the answer.
    continue_final_message: bool = False
    echo: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_open(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true (as in vLLM)")
        return value


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's `POST /v1/chat/completions/batch`: several conversations, one set of
    parameters, one answer whose choices are the conversations' in order (not streamed)."""

    messages: list[list[ChatMessage]] = Field(min_length=1)  # type: ignore[assignment]

    @field_validator("messages")
    @classmethod
    def _each_has_messages(cls, value: list[list[ChatMessage]]) -> list[list[ChatMessage]]:
        if any(not conversation for conversation in value):
            raise ValueError("each conversation needs at least one message")
        return value

    @field_validator("stream")
    @classmethod
    def _not_streamed(cls, value: bool) -> bool:
        if value:
            raise ValueError("a batch of conversations is answered whole: stream must be false")
        return value

    def conversations(self) -> list[ChatCompletionRequest]:
        """One chat request per conversation, with the batch's parameters."""
        shared = self.model_dump(exclude={"messages"}, by_alias=True, exclude_unset=True)
        return [ChatCompletionRequest.model_validate({**shared, "messages": m}) for m in self.messages]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI answers errors."""

    error: ErrorBody


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error",
    503: "service_unavailable",
}


def error_response(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    body = ErrorBody(message=message, type=ERROR_TYPES.get(status, "error"), param=param, code=status)
    return ErrorResponse(error=body).model_dump()
