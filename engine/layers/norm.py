"""RMSNorm in the order HF Llama uses: normalise (accumulating in float32), cast back to
the input dtype, then scale by the weight."""

from __future__ import annotations

import torch

from pagefleet.engine.layers.fused import add_rms_norm, rms_norm


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, its norm) in one pass where the fused operator is loaded."""
        return add_rms_norm(residual, delta, self.weight, self.eps)
