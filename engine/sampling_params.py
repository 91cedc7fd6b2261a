"""vLLM's import path `vllm.sampling_params`, kept for code written against it:
`from pagefleet.engine.sampling_params import SamplingParams, StructuredOutputsParams`."""

from pagefleet.engine.sample.sampling_params import RequestOutputKind, SamplingParams
from pagefleet.engine.sample.structured_outputs import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
