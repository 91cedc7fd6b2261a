"""Beam search bookkeeping, ranked exactly like transformers' beam search.

Every step each running beam proposes its best next tokens. Of the `beams_to_keep` best
continuations overall (scored by cumulative logprob), those that end in a stop token or
reach the length limit may join the finished set (only if among the best `width`), and the
best `width` of the rest become the next running beams. A finished beam is scored by its
cumulative logprob / generated length ** `length_penalty`; the search ends when no running
beam can beat the worst of `width` finished ones (see `_still_improvable`), when
`early_stopping=True` and `width` beams have finished, or at the length limit.

Scores are float32 and combined with the same tensor operations as transformers, so
near-ties break the same way. This module only decides; the engine moves the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefleet.engine.sample.sampling_params import SamplingParams


@dataclass(slots=True)
class Hypothesis:
    """A finished beam."""

    token_ids: list[int]  # output tokens, the stop token included
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    cumulative_logprob: float
    finish_reason: str  # "stop" or "length"


@dataclass(slots=True)
class Continuation:
    """A running beam of the next step: beam `parent` of this step plus `token_id`."""

    parent: int
    token_id: int
    cumulative_logprob: float


class BeamSearchState:
    def __init__(self, params: SamplingParams, max_tokens: int, stop_token_ids: set[int]) -> None:
        self.width = params.beam_width
        self.length_penalty = params.length_penalty
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        # As in transformers: enough candidates that `width` of them continue even if every
        # beam's best continuations include each stop token. One beam is greedy decoding
        # there: the best token, and the end at the first stop.
        self.beams_to_keep = max(2, 1 + len(stop_token_ids)) * self.width if self.width > 1 else 1
        self.early_stopping = params.early_stopping if self.width > 1 else True
        self.scores = torch.zeros(1)  # float32 cumulative logprob of each running beam
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.done = False
        self._improvable = True

    def step(self, outputs: list[list[int]], logprobs: torch.Tensor, token_ids: torch.Tensor) -> list[Continuation]:
        """Advance one token and return the next running beams (empty once done).

        outputs: each running beam's output tokens so far (all the same length);
        logprobs, token_ids: [num_beams, K], each beam's K >= beams_to_keep best next tokens.
        """
        num_generated = len(outputs[0]) + 1
        totals = (logprobs + self.scores[:, None]).flatten()
        top_scores, top_index = totals.topk(min(self.beams_to_keep, totals.numel()))
        finite = torch.isfinite(top_scores)  # a masked token (a constraint forbids it) is no candidate
        if not bool(finite.all()):
            top_scores, top_index = top_scores[finite], top_index[finite]
        parents = (top_index // logprobs.shape[1]).tolist()
        tokens = token_ids.flatten()[top_index].tolist()
        at_limit = num_generated >= self.max_tokens
        stops = [at_limit or token in self.stop_token_ids for token in tokens]

        running = [j for j, stop in enumerate(stops) if not stop][: self.width]
        continuations = [Continuation(parents[j], tokens[j], top_scores[j].item()) for j in running]
        self.scores = top_scores[running]
        self._add_finished(outputs, parents, tokens, stops, top_scores, num_generated)

        self._improvable = self._improvable and self._still_improvable(num_generated)
        full_and_early = self.early_stopping is True and len(self.finished) == self.width
        self.done = not self._improvable or full_and_early or not continuations
        return [] if self.done else continuations

    def _add_finished(
        self,
        outputs: list[list[int]],
        parents: list[int],
        tokens: list[int],
        stops: list[bool],
        top_scores: torch.Tensor,
        num_generated: int,
    ) -> None:
        if self.early_stopping is True and len(self.finished) == self.width:
            return
        normalised = (top_scores / (num_generated**self.length_penalty)).tolist()
        # Only the best `width` candidates may finish; the rest only back up the running set.
        for j in range(min(self.width, len(tokens))):
            if stops[j]:
                reason = "stop" if tokens[j] in self.stop_token_ids else "length"
                hypothesis = Hypothesis(outputs[parents[j]] + [tokens[j]], normalised[j], top_scores[j].item(), reason)
                self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        del self.finished[self.width :]

    def _still_improvable(self, num_generated: int) -> bool:
        """Could the best running beam still beat the worst of `width` finished ones?

        transformers' heuristic: the best beam's score normalised at the current length,
        or with early_stopping="never" and a positive length penalty at the longest length.
        """
        if len(self.finished) < self.width or not len(self.scores):
            return len(self.scores) > 0
        best_length = num_generated
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_length = self.max_tokens
        best_possible = self.scores[:1] / (best_length**self.length_penalty)
        worst_finished = min(h.score for h in self.finished)
        return bool(best_possible.item() > worst_finished)
