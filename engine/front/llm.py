"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))` and `chat()`."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from pagefleet.engine import omp_settings
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.front.chat_template import Message, apply_chat_template
from pagefleet.engine.front.core_process import CoreProcess
from pagefleet.engine.front.inputs import PromptType, is_single_prompt
from pagefleet.engine.front.llm_engine import LLMEngine
from pagefleet.engine.front.offline_core import OfflineCore, OfflineRequest
from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.front.stats import EngineStats
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.sample.sampling_params import RequestOutputKind, SamplingParams

_PROGRESS_MIN_PROMPTS = 8


class LLM:
    """Runs batches of prompts through the engine and returns outputs in prompt order.

    Every `EngineConfig` field is a keyword argument: `LLM(model="...", dtype="bfloat16",
    num_kv_blocks=64, preemption_mode="swap")`. `separate_process`: run the engine in a
    process of its own (core_process.py); by default only where this process's OpenMP
    threads would run it slower (the caller imported torch first: omp_settings).
    """

    def __init__(
        self, model: str = EngineConfig.model, separate_process: bool | None = None, **engine_args: Any
    ) -> None:
        config = EngineConfig(model=model, **engine_args)
        if separate_process is None:
            cpu = config.torch_device.type == "cpu"
            separate_process = cpu and omp_settings.lost_in_this_process(omp_settings.engine_threads())
        self._core: OfflineCore | CoreProcess = (
            CoreProcess(config) if separate_process else OfflineCore(LLMEngine(config))
        )
        self.tokenizer = self._core.tokenizer
        self._ids = itertools.count()
        # `del llm` frees what it holds too (its tensor-parallel workers and process group).
        self._finalizer = weakref.finalize(self, self._core.shutdown)

    @property
    def engine(self) -> LLMEngine:
        """The engine, when it runs in this process."""
        if not isinstance(self._core, OfflineCore):
            raise RuntimeError("this LLM's engine runs in a process of its own (separate_process=True)")
        return self._core.engine

    @property
    def separate_process(self) -> bool:
        return isinstance(self._core, CoreProcess)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave their process group, so that another
        tensor-parallel engine can start in this process (also done by `with LLM(...) as
        llm:` and when the LLM is collected); it cannot generate afterwards."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids), with `lora_request`'s adapter (one
        for all prompts, or one per prompt; needs enable_lora=True). Invalid input raises
        ValueError before anything runs."""
        single = is_single_prompt(prompts)
        prompt_list: list[PromptType] = [prompts] if single else list(prompts)  # type: ignore[list-item, arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompt_list)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompt_list)
        if len(loras) != len(prompt_list):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompt_list)} prompts")
        # Only the final outputs are read: the engine builds no other (a copy per distinct
        # params object; the caller's are not written).
        final_only: dict[int, SamplingParams] = {}
        for params in params_list:
            if id(params) not in final_only:
                final_only[id(params)] = params.with_output_kind(RequestOutputKind.FINAL_ONLY)
        requests = [
            OfflineRequest(f"offline-{next(self._ids)}", prompt, final_only[id(params)], lora)
            for prompt, params, lora in zip(prompt_list, params_list, loras, strict=True)
        ]
        show_progress = use_tqdm if use_tqdm is not None else len(requests) >= _PROGRESS_MIN_PROMPTS
        return self._core.run(requests, show_progress)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        beam_width: int,
        max_tokens: int = 16,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        ignore_eos: bool = False,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """The `beam_width` best beams for every prompt, best first (see SamplingParams)."""
        params = SamplingParams(
            n=beam_width,
            use_beam_search=True,
            beam_width=beam_width,
            max_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            ignore_eos=ignore_eos,
        )
        return self.generate(prompts, params, use_tqdm)

    def list_loras(self) -> list[str]:
        """The adapters loaded (read from disk), by name."""
        return self._core.list_loras()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter ahead of its first request (else `generate` reads it)."""
        return self._core.add_lora(lora_request)

    def remove_lora(self, lora: str | int) -> bool:
        """Forget an adapter, by name or by `lora_int_id`."""
        return self._core.remove_lora(lora)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, formatted by the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conversation) for conversation in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    def get_tokenizer(self) -> Any:
        """The engine's Hugging Face tokenizer (None with skip_tokenizer_init=True)."""
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while requests hold blocks."""
        return self._core.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return self._core.stats()
