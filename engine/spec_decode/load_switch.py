"""How many draft tokens a step should verify, from what this replica measures: verifying
costs forward-pass time for every draft token, and pays back only the drafts accepted.

A step's time is modelled as `fixed + per_token * tokens + per_draft_chunk * chunks`: the
fixed part is reading the weights once, the per-token part the matmuls, and the last the
cost of each sequence whose drafts go through the attention path of prompt chunks (one
span per sequence instead of one batched decode). It is fitted to the decoding steps this
replica ran (steps with prompt chunks cost less per token and are left out; exponentially
weighted least squares, so it follows the load). With `batch` decoding
sequences, `k` drafts each and a measured acceptance rate `alpha` per drafted position, a
step yields `1 + alpha + ... + alpha**k` tokens a sequence; the switch picks the `k` (0: no
speculation) with the most tokens per second. At batch 1 on a CPU the fixed part dominates
and speculation wins; at a large batch the rest does and it switches itself off.
"""

from __future__ import annotations

import numpy as np

_DECAY = 0.97  # weight of the older steps in the fit, per step
_ACCEPTANCE_DECAY = 0.9  # weight of older steps' verifications, per step (the mix of requests changes)
_MARGIN = 1.05  # drafts must promise this much more speed than none (the model is a model)


class StepTimeFit:
    """Weighted normal equations of seconds ~ [1, tokens, draft chunks] . coefficients."""

    def __init__(self) -> None:
        self.gram = np.zeros((3, 3))
        self.moment = np.zeros(3)
        self.coefficients: np.ndarray | None = None  # the latest the steps could tell apart

    def add(self, tokens: int, draft_chunks: int, seconds: float) -> None:
        row = np.array([1.0, tokens, draft_chunks])
        self.gram = self.gram * _DECAY + np.outer(row, row)
        self.moment = self.moment * _DECAY + row * seconds
        # Solvable once steps of different sizes, with and without drafts, were seen.
        if np.linalg.cond(self.gram) < 1e8:
            self.coefficients = np.maximum(np.linalg.solve(self.gram, self.moment), 0.0)

    def seconds(self, tokens: int, draft_chunks: int) -> float:
        assert self.coefficients is not None
        return float(self.coefficients @ np.array([1.0, tokens, draft_chunks]))


class LoadSwitch:
    """Picks each step's draft length; fed by the step's update (`observe_step`,
    `observe_verification`), read by the scheduler (`draft_length`)."""

    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self.fit = StepTimeFit()
        self._probes = 0  # steps asked for before the fit could tell the costs apart
        self.positions_verified = 0.0  # recent drafted positions reached, exponentially weighted
        self.positions_accepted = 0.0

    @property
    def acceptance_rate(self) -> float:
        """The chance a drafted position is accepted, given the ones before it were (of the
        recent steps, with a prior of one accepted and one rejected position)."""
        return (self.positions_accepted + 1) / (self.positions_verified + 2)

    def observe_step(self, num_tokens: int, num_draft_chunks: int, seconds: float) -> None:
        """A decoding step (no prompt chunk) that computed `num_tokens` tokens, of which
        `num_draft_chunks` sequences verified drafts."""
        self.fit.add(num_tokens, num_draft_chunks, seconds)
        self.positions_verified *= _ACCEPTANCE_DECAY
        self.positions_accepted *= _ACCEPTANCE_DECAY

    def observe_verification(self, num_verified: int, num_accepted: int) -> None:
        """One sequence's drafts: `num_verified` positions reached, `num_accepted` kept."""
        self.positions_verified += num_verified
        self.positions_accepted += num_accepted

    def draft_length(self, batch: int) -> int:
        """Drafts per sequence this step, for `batch` decoding sequences (0: none)."""
        if self.fit.coefficients is None:
            # Not measured yet: alternate steps with and without drafts, which tells the
            # costs apart (steps that all draft alike cannot).
            self._probes += 1
            return self.max_drafts if self._probes % 2 else 0
        alpha = min(self.acceptance_rate, 0.999)
        plain = self.fit.seconds(batch, 0)
        best, best_rate = 0, 1.0 / plain if plain > 0 else float("inf")
        for k in range(1, self.max_drafts + 1):
            expected = (1 - alpha ** (k + 1)) / (1 - alpha)
            seconds = self.fit.seconds(batch * (1 + k), batch)
            rate = expected / seconds if seconds > 0 else float("inf")
            if rate > best_rate * _MARGIN:
                best, best_rate = k, rate
        return best
