"""Vectorised sampling for one step: penalties, token constraints (logit bias, allowed
tokens, bad words, structured-output grammars), temperature, top-k/top-p/min-p, logprobs.

One row of `logits` per sequence that samples this step. Requests with a seed draw from
their own generator, so their tokens do not depend on what else is in the batch; the rest
share the engine's generator. Sampling uses the exponential race (argmax of p / E with
E ~ Exp(1)), which equals drawing from p and needs no cumulative sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagefleet.engine.layers.fused import argmax_rows
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.sample.structured_outputs import apply_allowed_tokens
from pagefleet.engine.worker.step_input import SamplingState


@dataclass(slots=True)
class TokenLogprobs:
    """Per row: the log-probability of one token, its rank, and the top-k alternatives."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> TokenLogprobs:
    """logits: [n, vocab] float32; token_ids: [n]; num_top: how many alternatives per row."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=1) + 1
    values, ids = logprobs.topk(max(num_top, default=0), dim=-1)
    return TokenLogprobs(
        chosen.tolist(),
        ranks.tolist(),
        [row[:k] for row, k in zip(ids.tolist(), num_top, strict=True)],
        [row[:k] for row, k in zip(values.tolist(), num_top, strict=True)],
    )


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # of each chosen token under the raw distribution (0.0 where untracked)
    # Rows whose request asked for logprobs -> their details, in `details`.
    detail_rows: dict[int, int]
    details: TokenLogprobs | None
    # Beam-search rows -> their row in `beam_candidates`: each beam's best next tokens.
    beam_rows: dict[int, int] = field(default_factory=dict)
    beam_candidates: BeamCandidates | None = None


@dataclass(slots=True)
class BeamCandidates:
    logprobs: torch.Tensor  # [rows, K] float32, best first
    token_ids: torch.Tensor  # [rows, K]


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], seed: int) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, states: list[SamplingState], params: list[SamplingParams]) -> SampleResult:
        """logits: [num_rows, vocab] float32, one row per (sequence, params).

        Logprobs are of the model's raw distribution (before penalties and temperature).
        """
        raw_logits = logits
        logits = self._apply_penalties(logits, states, params)
        logits = self._apply_min_tokens(logits, states, params)
        logits = apply_token_constraints(logits, states, params)
        logits = apply_allowed_tokens(logits, [state.allowed for state in states])
        chosen = self._choose(logits, states, params)
        # Only rows that keep a cumulative logprob pay for it (one logsumexp over the
        # vocabulary each); the others get 0.0, which nobody reads (as in vLLM).
        chosen_logprobs = torch.zeros(len(params))
        tracked = [i for i, p in enumerate(params) if p.tracks_cumulative_logprob]
        if tracked:
            index = torch.tensor(tracked)
            rows_logits = raw_logits.index_select(0, index) if len(tracked) < len(params) else raw_logits
            picked = rows_logits.gather(1, chosen[index][:, None]).squeeze(1)
            chosen_logprobs[index] = picked - torch.logsumexp(rows_logits, dim=-1)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        details = None
        if rows:  # only rows that asked pay for ranks and top-k
            index = torch.tensor(rows)
            details = token_logprobs(raw_logits[index], chosen[index], [params[i].logprobs or 0 for i in rows])
        detail_rows = {row: r for r, row in enumerate(rows)}
        result = SampleResult(chosen.tolist(), chosen_logprobs.tolist(), detail_rows, details)
        beam_rows = [i for i, p in enumerate(params) if p.use_beam_search]
        if beam_rows:
            result.beam_rows = {row: r for r, row in enumerate(beam_rows)}
            result.beam_candidates = self._beam_candidates(raw_logits, beam_rows, states, params)
        return result

    def _beam_candidates(
        self, logits: torch.Tensor, rows: list[int], states: list[SamplingState], params: list[SamplingParams]
    ) -> BeamCandidates:
        """Each beam's best next tokens by log-probability; enough that the search can take
        its best `beams_to_keep` continuations overall from them."""
        logprobs = torch.log_softmax(logits[torch.tensor(rows)], dim=-1)
        # Like transformers' min-new-tokens processor: stop tokens masked after the softmax.
        beam_states, beam_params = [states[i] for i in rows], [params[i] for i in rows]
        logprobs = apply_token_constraints(
            self._apply_min_tokens(logprobs, beam_states, beam_params), beam_states, beam_params
        )
        logprobs = apply_allowed_tokens(logprobs, [state.allowed for state in beam_states])
        num_stop = len(self.eos_token_ids) + max(len(params[i].stop_token_ids) for i in rows)
        k = min(logprobs.shape[1], max((2 + num_stop) * params[i].beam_width for i in rows))
        values, token_ids = logprobs.topk(k, dim=-1)
        return BeamCandidates(values, token_ids)

    def _apply_penalties(
        self, logits: torch.Tensor, states: list[SamplingState], params: list[SamplingParams]
    ) -> torch.Tensor:
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:  # only rows that asked for penalties; typically few
            p, state = params[i], states[i]
            output = torch.tensor(state.output_token_ids, dtype=torch.long)
            counts = (
                torch.zeros(vocab).index_add_(0, output, torch.ones(len(output))) if len(output) else torch.zeros(vocab)
            )
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool)
                seen[torch.tensor(state.token_ids, dtype=torch.long)] = True
                row = logits[i]
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                logits[i] = torch.where(seen, penalised, row)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    def _apply_min_tokens(
        self, logits: torch.Tensor, states: list[SamplingState], params: list[SamplingParams]
    ) -> torch.Tensor:
        rows = [i for i, (s, p) in enumerate(zip(states, params, strict=True)) if s.num_output_tokens < p.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            banned = list(params[i].stop_token_ids) + ([] if params[i].ignore_eos else self.eos_token_ids)
            if banned:
                logits[i, banned] = float("-inf")
        return logits

    def _choose(self, logits: torch.Tensor, states: list[SamplingState], params: list[SamplingParams]) -> torch.Tensor:
        chosen = argmax_rows(logits)
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy and not p.use_beam_search]
        if not sampled_rows:
            return chosen
        index = torch.tensor(sampled_rows)
        sub = logits.index_select(0, index)
        sub_params = [params[i] for i in sampled_rows]
        temperature = torch.tensor([p.temperature for p in sub_params]).unsqueeze(1)
        probs = torch.softmax(sub / temperature, dim=-1)
        probs = _filter(probs, sub_params)
        noise = torch.empty_like(probs)
        unseeded = [r for r, i in enumerate(sampled_rows) if states[i].generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=self.generator)
        for r, i in enumerate(sampled_rows):
            generator = states[i].generator
            if generator is not None:
                noise[r].exponential_(generator=generator)
        chosen[index] = argmax_rows(probs / noise)
        return chosen


def apply_token_constraints(
    logits: torch.Tensor, states: list[SamplingState], params: list[SamplingParams]
) -> torch.Tensor:
    """Allowed tokens, logit bias and bad words, on the rows that set any (few, typically)."""
    rows = [i for i, p in enumerate(params) if p.has_token_constraints]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p = params[i]
        if p.allowed_token_ids is not None:
            allowed = torch.full((logits.shape[1],), float("-inf"), dtype=logits.dtype)
            allowed[p.allowed_token_ids] = 0.0
            logits[i] += allowed
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        banned = _bad_word_endings(states[i].output_token_ids, p.bad_words_token_ids)
        if banned:
            logits[i, banned] = float("-inf")
    return logits


def _bad_word_endings(output: list[int], bad_words: list[list[int]]) -> list[int]:
    """The tokens that would complete a bad word after `output`."""
    banned = []
    for word in bad_words:
        before = word[:-1]
        if not before or (len(output) >= len(before) and output[len(output) - len(before) :] == before):
            banned.append(word[-1])
    return banned


def _filter(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero out tokens outside top-k, top-p and min-p, per row."""
    vocab = probs.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    if (top_k < vocab).any() or (top_p < 1).any():
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab).expand_as(sorted_probs)
        # Keep a token if fewer than top_p of the mass comes before it (the first always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (ranks >= top_k[:, None]) | (mass_before >= top_p[:, None] * sorted_probs.sum(-1, keepdim=True))
        drop[:, 0] = False
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs
