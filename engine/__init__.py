"""pagefleet's paged-attention inference engine."""

from pagefleet.engine import omp_settings

omp_settings.apply()  # before torch is imported below: see omp_settings

from pagefleet.engine.config import EngineConfig  # noqa: E402
from pagefleet.engine.errors import EngineError, InvalidParameterError, PromptTooLongError, RequestFailedError  # noqa: E402
from pagefleet.engine.front.async_engine import AsyncEngine  # noqa: E402
from pagefleet.engine.front.inputs import TextPrompt, TokensPrompt  # noqa: E402
from pagefleet.engine.front.llm import LLM  # noqa: E402
from pagefleet.engine.front.llm_engine import LLMEngine  # noqa: E402
from pagefleet.engine.front.outputs import CompletionOutput, Logprob, RequestOutput, Usage  # noqa: E402
from pagefleet.engine.front.stats import EngineStats  # noqa: E402
from pagefleet.engine.lora.request import LoRARequest  # noqa: E402
from pagefleet.engine.sample.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

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
