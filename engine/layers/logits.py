"""A model's float32 logits in memory kept from step to step.

A decode step's logits are large: 64 rows of Gemma 3's 262,144-token vocabulary are 64 MB
in float32. An allocation that size is above glibc's largest mmap threshold, so a fresh
tensor every step is a fresh mapping, faulted in page by page: converting bfloat16 logits
to float32 took 16 ms that way here, 3 ms into memory kept from the step before.
"""

from __future__ import annotations

import torch

# Kept up to this many float32 values (256 MB); rarer, larger steps (prompt logprobs over a
# long chunk) allocate their own.
_MAX_KEPT = 64 << 20


class Float32Logits:
    """One model's converter. A result is valid until the next call: the runner uses a step's
    logits within the step (sampling, verifying drafts, prompt logprobs)."""

    def __init__(self) -> None:
        self._kept = torch.empty(0)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` in float32 (itself if it is already)."""
        if logits.dtype == torch.float32:
            return logits
        size = logits.numel()
        if logits.device.type != "cpu" or size > _MAX_KEPT:
            return logits.float()
        if self._kept.numel() < size:
            self._kept = torch.empty(size, dtype=torch.float32)
        return self._kept[:size].view(logits.shape).copy_(logits)
