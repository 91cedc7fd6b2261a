"""pagefleet's paged-attention inference engine."""

from pagefleet.engine.async_engine import AsyncEngine
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.errors import EngineError, InvalidParameterError, PromptTooLongError, RequestFailedError
from pagefleet.engine.inputs import TextPrompt, TokensPrompt
from pagefleet.engine.llm import LLM
from pagefleet.engine.llm_engine import LLMEngine
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.outputs import CompletionOutput, Logprob, RequestOutput, Usage
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.stats import EngineStats

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
    "SamplingParams",
    "Usage",
]
