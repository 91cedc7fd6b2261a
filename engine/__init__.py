"""pagefleet's paged-attention inference engine."""

import os

# OpenMP's worker threads between the parallel regions of a step: under
# OMP_WAIT_POLICY=PASSIVE libgomp puts them to sleep at once, and waking one costs ~45 us, a
# few hundred times a step. Spinning up to ~3 ms first (libgomp's own default without a
# policy; vLLM asks Intel's OpenMP for 5 ms, KMP_BLOCKTIME=5) made the offline workload 8%
# faster in bfloat16 and 3% in float32 (docs/benchmarks.md). libgomp reads it when torch
# loads it, so it is set before torch is imported here; a GOMP_SPINCOUNT of the caller's
# wins, and `pagefleet up` gives its replicas 0, since they share the machine's cores.
os.environ.setdefault("GOMP_SPINCOUNT", "300000")

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
