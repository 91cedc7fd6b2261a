"""The runner's view of a schedule plan (engine/worker/step_input.py): each chunk's tokens
and block tables, each sample's sampling state, grammar masks computed here, where the
matchers live. The plan itself, with its requests and sequences, stays with the engine for
the step's update."""

from __future__ import annotations

from typing import Any

import torch

from pagefleet.engine.core.request import Request
from pagefleet.engine.core.scheduler import SampleRequest, ScheduledChunk, SchedulePlan
from pagefleet.engine.sample.structured_outputs import allowed_tokens
from pagefleet.engine.worker.step_input import ChunkInput, RunnerInput, SampleInput, SamplingState


def runner_input(plan: SchedulePlan, vocab_size: int) -> RunnerInput:
    """What the runner needs of `plan`; `vocab_size`: the logits' width (grammar masks)."""
    wanted = set(plan.prompt_logprob_chunks)
    chunks = [_chunk(chunk, index in wanted) for index, chunk in enumerate(plan.chunks)]
    samples = [_sample(sample, vocab_size) for sample in plan.samples]
    return RunnerInput(plan.copies, chunks, samples, list(plan.prompt_logprob_chunks))


def _chunk(chunk: ScheduledChunk, prompt_logprobs: bool) -> ChunkInput:
    request = chunk.request
    scored = ChunkInput(
        request.request_id,
        request.lora_slot,
        chunk.start,
        chunk.input_token_ids,
        chunk.block_tables,
        request.rotates_long,
        len(chunk.draft_token_ids),
        state_slot=chunk.state_slot,
        num_prompt_tokens=request.num_prompt_tokens,
    )
    if prompt_logprobs:
        scored.num_prompt_top, scored.prompt_targets = _prompt_targets(request, chunk)
    return scored


def _prompt_targets(request: Request, chunk: ScheduledChunk) -> tuple[int, list[int]]:
    """(top tokens, the prompt token each position predicts): position p predicts token
    p + 1, and the prompt's last position predicts none."""
    end = min(chunk.end, request.num_prompt_tokens - 1)
    return request.params.prompt_logprobs or 0, chunk.seq.token_ids[chunk.start + 1 : end + 1]


def _sample(sample: SampleRequest, vocab_size: int) -> SampleInput:
    seq, drafts = sample.seq, sample.draft_token_ids
    allowed, draft_allowed = None, []
    if seq.grammar is not None:
        allowed = allowed_tokens(seq.grammar, vocab_size)
        if drafts:  # no copy of the matcher on a step without drafts
            draft_allowed = _draft_masks(seq.grammar, drafts, vocab_size)
    state = SamplingState(seq.token_ids, seq.num_prompt_tokens, seq.generator, allowed)
    return SampleInput(sample.chunk_index, sample.params, state, drafts, draft_allowed)


def _draft_masks(grammar: Any, drafts: list[int], vocab_size: int) -> list[torch.Tensor | None]:
    """What the grammar allows after each draft in turn, on a copy of the matcher (the
    proposer kept only drafts the grammar allows)."""
    matcher = grammar.fork()
    masks: list[torch.Tensor | None] = []
    for token in drafts:
        matcher.accept_token(token)
        masks.append(allowed_tokens(matcher, vocab_size))
    return masks
