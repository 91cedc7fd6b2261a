"""A request and its sequences: the state the scheduler and the block manager share.

A request holds one prompt and its sequences: `best_of` (else n) samples, or up to
`beam_width` beams. Until its prompt is computed the request is *unforked*: only sequence 0
runs, so the prompt is prefilled once. When sequence 0 reaches the end of the prompt the
others fork from it, sharing every prompt block (the last, part-filled one included) by
reference count. A beam-search request starts with one sequence; beams fork from beams as
the search goes (see beam_search.py).

Every sequence has `num_computed_tokens` catching up to `num_tokens`; this one rule covers
prefill, chunked prefill, prefix-cache hits and recompute after preemption.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pagefleet.engine.beam_search import BeamSearchState
from pagefleet.engine.outputs import PositionLogprobs
from pagefleet.engine.sampling_params import SamplingParams


def sequence_seed(seed: int, index: int) -> int:
    """Sample `index`'s own 64-bit seed, derived from the request's (wrapped modulo 2**64
    as torch wraps a negative seed, so every 64-bit request seed gives a valid one)."""
    return (seed * 1_000_003 + index) % 2**64


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # new, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted; its blocks live in the host pool
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, chained
    num_registered_blocks: int = 0  # full blocks already published to the prefix cache
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None
    text: str = ""
    generator: torch.Generator | None = None
    # Incremental detokenizer cursors into token_ids (see detokenizer.py).
    prefix_offset: int = 0
    read_offset: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int  # FCFS order, also the order preempted requests resume in
    max_tokens: int
    sequences: list[Sequence] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    is_forked: bool = False
    # False only with block sharing off: every sequence then computes its own prompt.
    shares_prompt: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    is_prefix_counted: bool = False  # the prompt entered the prefix-cache statistics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    beam: BeamSearchState | None = None  # set for beam search
    error: str | None = None  # why the request failed inside the engine, if it did

    def __post_init__(self) -> None:
        num_prompt = len(self.prompt_token_ids)
        if not self.sequences:
            count = 1 if self.params.use_beam_search else self.params.num_sequences
            self.sequences = [Sequence(i, list(self.prompt_token_ids), num_prompt) for i in range(count)]
        self.reset_fork()
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no distribution
        if self.params.seed is not None:
            for seq in self.sequences:
                seq.generator = torch.Generator().manual_seed(sequence_seed(self.params.seed, seq.index))

    def reset_fork(self) -> None:
        """Back to before the fork point (new, or preempted by recompute)."""
        self.is_forked = len(self.sequences) == 1 or not self.shares_prompt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def unfinished_sequences(self) -> list[Sequence]:
        return [seq for seq in self.sequences if not seq.is_finished]

    @property
    def num_seq_slots(self) -> int:
        """Sequences this request may run at once (what max_num_seqs counts)."""
        return self.beam.width if self.beam is not None else len(self.unfinished_sequences)

    @property
    def active_sequences(self) -> list[Sequence]:
        """The sequences that compute this step: only sequence 0 before the fork."""
        if not self.is_forked:
            return [self.sequences[0]]
        return self.unfinished_sequences

    def compute_target(self, seq: Sequence) -> int:
        """How many of `seq`'s tokens should have KV: all of them once forked; before the
        fork, sequence 0 stops at the end of the prompt (the fork point)."""
        return seq.num_tokens if self.is_forked else self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_done(self) -> bool:
        """Nothing left to compute: every sample finished, or the beam search ended."""
        if self.beam is not None:
            return self.beam.done
        return all(seq.is_finished for seq in self.sequences)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
