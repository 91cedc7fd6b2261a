"""RMSNorm in the order HF Llama uses: normalise (accumulating in float32), cast back to
the input dtype, then scale by the weight."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The fused kernel accumulates in float32 for half-precision inputs.
        return self.weight * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=self.eps)
