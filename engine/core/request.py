"""A request and its sequences: what a caller asked for and what has been generated.

A request holds one prompt and its sequences: `best_of` (else n) samples, or up to
`beam_width` beams. Until its prompt is computed the request is *unforked*: only sequence 0
runs, so the prompt is prefilled once. When sequence 0 reaches the end of the prompt the
others fork from it, sharing every prompt block (the last, part-filled one included) by
reference count. A beam-search request starts with one sequence; beams fork from beams as
the search goes (see beam_search.py).

Every sequence's computed-token count (kept by the KV cache manager, with its blocks)
catches up to its `num_tokens`; this one rule covers prefill, chunked prefill, prefix-cache
hits and recompute after preemption.

Who writes what, one writer per field:
- `LLMEngine.add_request`: everything a request starts with, before it is queued.
- the scheduler: `status`, `lora_slot`, `is_forked` (set when it plans the step that
  reaches the fork point, reset by a recompute preemption), `num_cached_tokens`,
  `is_prefix_counted` and `events`;
- the KV cache manager: every block table and computed-token count (not stored here);
- the KV connectors (engine/kv_connector): the KV from outside a request starts on, kept
  by each connector under the request's id (not stored here);
- the step's update (front/step_update.py): `sequences` (beams), `first_token_time`,
  `error` and `kv_transfer_params`; through the output processor, which it alone calls
  after a step, each sequence's tokens, text, logprobs, detokenizer cursors and stop state,
  and the request's prompt logprobs.
Other modules read.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagefleet.engine.front.outputs import PositionLogprobs
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.sample.beam_search import BeamSearchState
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.protocol.block_hash import chain_root
from pagefleet.protocol.kv_transfer import KVTransferParams


def sequence_seed(seed: int, index: int) -> int:
    """Sample `index`'s own 64-bit seed, derived from the request's (wrapped modulo 2**64
    as torch wraps a negative seed, so every 64-bit request seed gives a valid one)."""
    return (seed * 1_000_003 + index) % 2**64


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """A moment in a request's life inside the engine (left the queue, a prompt chunk, a
    preemption), for its trace: `time` is `time.monotonic()`."""

    time: float
    name: str
    attributes: dict[str, int | str | bool]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # new, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted; its blocks live in the host pool
    FINISHED = "finished"


_sequence_ids = itertools.count()
DEFAULT_ROOT = chain_root()  # no adapter, no cache_salt


@dataclass(slots=True)
class Sequence:
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None
    text: str = ""
    generator: torch.Generator | None = None
    grammar: Any = None  # its structured-output matcher (xgrammar), if the request has a constraint
    hash_root: int = DEFAULT_ROOT  # its prefix-cache hash chain's first link (protocol/block_hash.py)
    # Incremental detokenizer cursors into token_ids (see detokenizer.py).
    prefix_offset: int = 0
    read_offset: int = 0
    # What DELTA outputs have carried so far (output tokens, text characters, the end).
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    sent_finish: bool = False
    seq_id: int = field(default_factory=lambda: next(_sequence_ids))  # the KV cache manager's key

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
    # Prompt tokens not in the prefix cache when it arrived (LLMEngine.add_request): what
    # its prefill is expected to compute, the queue the fleet's routers judge a replica by.
    num_expected_prefill_tokens: int = 0
    is_prefix_counted: bool = False  # the prompt entered the prefix-cache statistics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    beam: BeamSearchState | None = None  # set for beam search
    error: str | None = None  # why the request failed inside the engine, if it did
    # Prefill/decode disaggregation: the prompt's KV pulled from a prefill replica, loaded
    # into the first blocks when the request is admitted (then dropped).
    kv_transfer_params: dict[str, Any] | None = None  # for the caller: how to pull this prompt's KV
    lora_request: LoRARequest | None = None  # the adapter it runs with
    lora_slot: int | None = None  # its adapter's slot while the scheduler holds one for it
    events: list[RequestEvent] = field(default_factory=list)  # appended by the scheduler, read by tracing
    # LongRoPE (engine/layers/rotary.py): whether its keys rotate by the long factors, and
    # the hash root its sequences take if they outgrow the pretraining length (None: no
    # switch ahead of it).
    rotates_long: bool = False
    long_rope_root: int | None = None

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

    def note(self, name: str, **attributes: int | str | bool) -> None:
        self.events.append(RequestEvent(time.monotonic(), name, attributes))

    def reset_fork(self) -> None:
        """Back to before the fork point (new, or preempted by recompute)."""
        self.is_forked = len(self.sequences) == 1 or not self.shares_prompt

    def rotate_long(self) -> None:
        """From now on its keys rotate by the long factors, in a prefix-cache chain of their own."""
        root = self.long_rope_root
        assert root is not None, "only a request with a switch ahead of it switches"
        self.rotates_long, self.long_rope_root = True, None
        for seq in self.sequences:
            seq.hash_root = root

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

    @property
    def fork_point(self) -> int | None:
        """Before the fork: the tokens sequence 0 computes alone (the prompt), after which
        its siblings split off sharing them. None once forked (or with nothing to fork)."""
        return None if self.is_forked else self.num_prompt_tokens

    def reaches_fork_point(self, num_computed: int) -> bool:
        """Whether sequence 0 having `num_computed` tokens computed is the fork."""
        return num_computed == self.fork_point

    def mark_forked(self) -> None:
        self.is_forked = True

    def compute_target(self, seq: Sequence) -> int:
        """How many of `seq`'s tokens should have KV: all of them once forked; before the
        fork, sequence 0 stops at the fork point."""
        return self.fork_point if self.fork_point is not None else seq.num_tokens

    @property
    def is_finished(self) -> bool:
        """Retired by the engine (its generation ended, or it was aborted or failed)."""
        return self.status == RequestStatus.FINISHED

    @property
    def generation_ended(self) -> bool:
        """Nothing left to compute: every sample finished, or the beam search ended (the
        engine retires it after this step)."""
        if self.beam is not None:
            return self.beam.done
        return all(seq.is_finished for seq in self.sequences)

    @property
    def wants_remote_decode(self) -> bool:
        """A prefill replica's request: its prompt's blocks are kept for a decode replica."""
        transfer = KVTransferParams.of_extra_args(self.params.extra_args)  # checked when the request came
        return transfer is not None and transfer.remote_decode

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
