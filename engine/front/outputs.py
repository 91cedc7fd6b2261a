"""What the engine hands back: per-request outputs, per-sample completions, usage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagefleet.engine.core.request import RequestEvent


@dataclass(slots=True, frozen=True)
class Logprob:
    """The log-probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int
    decoded_token: str


# One position's logprobs: the chosen (or prompt) token plus the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (index in 0..n-1)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # None unless logprobs were asked for, best_of > n, or beams
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop string or token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestOutput:
    """A request's state as seen by a caller, after a step or at its end.

    In streaming use, `outputs[i].text` and `token_ids` are cumulative; callers that want
    deltas keep their own offsets (the server does).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (as vLLM's)
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # set when the request failed inside the engine (finish_reason "error")
    # A prefill replica's answer (as vLLM's): where a decode replica pulls the prompt's KV.
    kv_transfer_params: dict[str, Any] | None = None
    # The request's moments in the engine so far (the engine's own list, appended to while it runs).
    events: list[RequestEvent] = field(default_factory=list)
