"""The model runner of a simulated replica: it runs no model. A step sleeps for its cost
model's time (stretched by the time scale) and each sample gets the next token of a fixed
text, so that answers decode to words and a request's tokens depend only on its prompt's
length and how far it got: never on the batch it ran in.

What a cost model cannot give is refused by name when the request arrives (its logprobs, a
grammar's constraint, beam search's scores)."""

from __future__ import annotations

import time
from typing import Any

from pagefleet.engine.core.kv_groups import KVGroups
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.sample.sampler import SampleResult
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.sim.cost_model import ChunkShape, step_seconds
from pagefleet.engine.sim.profiles import SimProfile
from pagefleet.engine.worker.model_runner import RequestResults
from pagefleet.engine.worker.step_input import RunnerInput, SampleInput

ANSWER_TEXT = (
    "Routing a request to the replica that already holds its prefix saves the prefill of "
    "every cached block, until that replica's queue costs more than the blocks are worth. "
)


def refuse_unmodelled(params: SamplingParams) -> None:
    """Refuse what a simulated replica cannot answer truthfully.

    Raises:
        InvalidParameterError: naming the field.
    """
    unmodelled = {
        "logprobs": params.logprobs is not None,
        "prompt_logprobs": params.prompt_logprobs is not None,
        "use_beam_search": params.use_beam_search,
        "structured_outputs": params.structured_outputs is not None,
    }
    for field, asked in unmodelled.items():
        if asked:
            raise InvalidParameterError(field, "a simulated replica (--simulate) models no logits: not available")


class SimulatedRunner:
    """`ModelRunner`'s part the engine calls (`execute`), over no tensors."""

    workers = None  # never tensor-parallel
    state_cache = None
    state_chunk_size = 0
    cache_layer_caches: list[Any] = []  # no KV to read: the connectors are off (EngineConfig)

    def __init__(
        self, profile: SimProfile, model_config: ModelConfig, groups: KVGroups, tokenizer: Any, time_scale: float
    ) -> None:
        self.profile, self.model_config, self.groups, self.time_scale = profile, model_config, groups, time_scale
        self.answer_ids: list[int] = tokenizer.encode(ANSWER_TEXT, add_special_tokens=False) if tokenizer else [0]
        self.eos_token_id = model_config.eos_token_ids[0] if model_config.eos_token_ids else None
        self.modelled_s = 0.0  # the profile's time of every step so far (its own clock)

    def execute(self, plan: RunnerInput) -> dict[str, RequestResults]:
        """Sleep for the step's modelled time, then sample every sample's next token."""
        entered = time.monotonic()
        copies = plan.copies
        shapes = (ChunkShape(c.start, c.num_new_tokens) for c in plan.chunks)
        seconds = step_seconds(self.profile, shapes, len(copies.swap_out) + len(copies.swap_in))
        self.modelled_s += seconds
        tokens = [self._next_token(sample) for sample in plan.samples]
        results: dict[str, RequestResults] = {}
        sampled = SampleResult(tokens, [0.0] * len(tokens), {}, None)
        for row, sample in enumerate(plan.samples):
            owner = results.setdefault(plan.chunks[sample.chunk_index].request_id, RequestResults())
            owner.samples.append(row)
            owner.rows.append(row)
            owner.sampled = sampled
        remaining = entered + seconds * self.time_scale - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        return results

    def _next_token(self, sample: SampleInput) -> int:
        """The answer text's next token, from an offset its prompt's length sets; EOS after
        the profile's answer length unless the request ignores it."""
        state = sample.state
        produced = len(state.token_ids) - state.num_prompt_tokens
        if produced >= self.profile.answer_tokens and not sample.params.ignore_eos and self.eos_token_id is not None:
            return self.eos_token_id
        return self.answer_ids[(state.num_prompt_tokens + produced) % len(self.answer_ids)]
