"""An OpenAI request's fields as the engine's `SamplingParams`."""

from __future__ import annotations

from typing import Any

from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.sample.structured_outputs import StructuredOutputsParams
from pagefleet.protocol import kv_transfer
from pagefleet.protocol.openai import ChatCompletionRequest, CompletionRequest

_PASSED_WHEN_SET = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
)


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, **extra: Any
) -> SamplingParams:
    """The engine's parameters from an OpenAI request (fields left out keep the defaults)."""
    fields = {name: getattr(body, name) for name in _PASSED_WHEN_SET if getattr(body, name) is not None}
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if body.logit_bias:
        fields["logit_bias"] = {int(token): bias for token, bias in body.logit_bias.items()}
    constraint = structured_outputs(body)
    if constraint is not None:
        fields["structured_outputs"] = constraint
    if body.prompt_logprobs is not None:
        fields["prompt_logprobs"] = body.prompt_logprobs
    if body.kv_transfer_params is not None:
        fields["extra_args"] = {kv_transfer.FIELD: body.kv_transfer_params}
    return SamplingParams(
        n=body.n,
        stop=stop,
        max_tokens=max_tokens,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        **(fields | extra),  # the route's own say wins (a required tool call's constraint, echo's logprobs)
    )


def structured_outputs(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The request's constraint: vLLM's `structured_outputs`, or OpenAI's `response_format`
    (`json_object`, or `json_schema` with its schema); not both."""
    fmt, given = body.response_format, body.structured_outputs
    wants_json = fmt is not None and fmt.type != "text"
    if wants_json and given is not None:
        raise InvalidParameterError("response_format", "give response_format or structured_outputs, not both")
    if given is not None:
        return StructuredOutputsParams(**given.model_dump(by_alias=True))
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidParameterError("response_format", 'json_schema needs {"json_schema": {"schema": {...}}}')
    return StructuredOutputsParams(json=fmt.json_schema.schema_)
