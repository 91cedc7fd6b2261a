"""`OfflineCore`: what `LLM` asks of the engine, in the caller's process or in its own.

`LLM` checks the caller's input; this adds the requests, steps until they finish and frees
everything they held if anything fails. `core_process.CoreProcess` runs one in a process of
its own and has the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from pagefleet.engine.front.inputs import PromptType
from pagefleet.engine.front.llm_engine import LLMEngine
from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.front.stats import EngineStats
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.sample.sampling_params import SamplingParams


@dataclass(frozen=True)
class OfflineRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    lora_request: LoRARequest | None


class OfflineCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def run(self, requests: list[OfflineRequest], show_progress: bool) -> list[RequestOutput]:
        """Every request's final output, in their order. Invalid input raises ValueError
        before anything runs; a failure or an interruption aborts them all."""
        added: list[str] = []
        try:
            for request in requests:
                self.engine.add_request(
                    request.request_id, request.prompt, request.params, lora_request=request.lora_request
                )
                added.append(request.request_id)
        except ValueError:
            self._abort(added)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(added), desc="generating", unit="req", disable=not show_progress) as bar:
            try:
                while len(finished) < len(added):
                    for output in self.engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
            except BaseException:  # failed or interrupted: free every block before re-raising
                self._abort(added)
                raise
            finally:
                self.engine.kv_connector.between_steps(wait=True)  # the file tier holds no block between calls
        return [finished[request_id] for request_id in added]

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora: str | int) -> bool:
        return self.engine.remove_lora(lora)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort_request(request_id)
