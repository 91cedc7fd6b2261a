"""pagefleet's paged-attention inference engine."""

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.errors import EngineError, InvalidParameterError, PromptTooLongError, RequestFailedError
from pagefleet.engine.front.async_engine import AsyncEngine
from pagefleet.engine.front.inputs import TextPrompt, TokensPrompt
from pagefleet.engine.front.llm import LLM
from pagefleet.engine.front.llm_engine import LLMEngine
from pagefleet.engine.front.outputs import CompletionOutput, Logprob, RequestOutput, Usage
from pagefleet.engine.front.stats import EngineStats
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.sample.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "RequestFailedError",
    "TextPrompt",
    "TokensPrompt",
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "InvalidParameterError",
    "LLMEngine",
    "Logprob",
    "LoRARequest",
    "PromptTooLongError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "Usage",
]
