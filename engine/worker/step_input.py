"""What the runner is handed for one step: plain data, no `Request` or `Sequence`.

The engine builds it from its schedule plan (engine/core/runner_input.py) and keeps the plan
itself for the step's update; the runner answers by index into these lists. Token lists are
the sequences' own, read during the step and never written by the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagefleet.engine.core.kv_cache_manager import PendingCopies
from pagefleet.engine.sample.sampling_params import SamplingParams


@dataclass(slots=True)
class ChunkInput:
    """`input_token_ids` (the sequence's own tokens, then `num_drafts` drafts) at positions
    from `start`, written into `block_tables` (one per KV cache group); `long_rope`: they
    rotate by LongRoPE's long factors."""

    request_id: str
    lora_slot: int
    start: int
    input_token_ids: list[int]
    block_tables: list[list[int]]
    long_rope: bool = False
    num_drafts: int = 0
    # With prompt logprobs: how many top tokens, and the prompt token each scoring
    # position of the chunk predicts (position p predicts token p + 1).
    num_prompt_top: int = 0
    prompt_targets: list[int] = field(default_factory=list)
    # Its row of the state cache (models with state layers): the state after `start`
    # tokens, which this chunk carries on from (from zeros at start 0) and overwrites.
    state_slot: int | None = None
    num_prompt_tokens: int = 0  # its request's (a chunked state kernel chunks only the prompt)

    @property
    def num_new_tokens(self) -> int:
        return len(self.input_token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.input_token_ids)

    @property
    def num_own_tokens(self) -> int:
        return len(self.input_token_ids) - self.num_drafts


@dataclass(slots=True)
class SamplingState:
    """What sampling reads of a sequence: its tokens (penalties, bad words, min_tokens),
    its own random generator if seeded, and the tokens its grammar allows next (xgrammar's
    packed bitmask: bit b of word w is token 32w + b; None: any token)."""

    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    allowed: torch.Tensor | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class SampleInput:
    """Sample after chunk `chunk_index`'s last own token, as `state` with `params`. With
    drafts to verify, `draft_allowed[k]` is what the grammar allows after the first k + 1
    drafts (None without a grammar)."""

    chunk_index: int
    params: SamplingParams
    state: SamplingState
    draft_token_ids: list[int] = field(default_factory=list)
    draft_allowed: list[torch.Tensor | None] = field(default_factory=list)


@dataclass(slots=True)
class RunnerInput:
    """One step: the block copies to run first, the chunks in batch order, the samples,
    and the chunks whose prompt logprobs are computed."""

    copies: PendingCopies
    chunks: list[ChunkInput]
    samples: list[SampleInput]
    prompt_logprob_chunks: list[int]
