"""int8 W8A8 weights (vLLM's compressed-tensors "int-quantized" checkpoints) and their matmul.

Weights are int8 with a float scale per output channel (w = scale * q); activations are
quantized to int8 when the layer runs, per token (scale = max |x| / 127) or with the one
static scale a checkpoint may carry. The products are summed in int32 over the whole row,
so unlike GGUF's blocks (a float scale per 32 weights) a layer is one int8 GEMM and one
rescale: the form that beats bfloat16 on large batches (kernels/csrc/cpu_int8.cpp).
`int8_linear_torch`, the oracle and the fallback, does the same arithmetic in plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefleet.kernels import cpu_ops


@dataclass(frozen=True)
class Int8Weight:
    """An [out_features, in_features] int8 weight, its float32 scale per output channel
    and, for static activation quantization, the one input scale (else None: per token)."""

    weight: torch.Tensor
    scales: torch.Tensor
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.weight.dtype != torch.int8 or self.weight.dim() != 2:
            raise ValueError(f"an int8 matrix, not {self.weight.dtype} {tuple(self.weight.shape)}")
        if self.scales.shape != (self.weight.shape[0],):
            raise ValueError(f"one scale per output channel, not {tuple(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * self.scales.element_size()

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        """Row blocks stacked (q, k, v -> qkv). Static input scales become their largest,
        as vLLM does for fused layers: each part's inputs are the same activations."""
        statics = [p.input_scale for p in parts if p.input_scale is not None]
        if statics and len(statics) != len(parts):
            raise ValueError("fused weights mixing static and dynamic activation scales")
        return Int8Weight(
            torch.cat([p.weight for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.stack(statics).max() if statics else None,
        )

    def dequantize(self) -> torch.Tensor:
        """float32 [out_features, in_features]: w = scale * q."""
        return self.weight.float() * self.scales.unsqueeze(1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T on the compiled operator, else the torch reference."""
        if x.device.type != "cpu" or not cpu_ops.load():
            return int8_linear_torch(x, self)
        return torch.ops.pagefleet.int8_linear(x.contiguous(), self.weight.T, self.scales, self.input_scale)


def quantize_tokens(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x as int8 and its scale [rows, 1] (max |x| / 127, or the static one)."""
    x = x.float()
    if input_scale is not None:
        scales = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    else:
        amax = x.abs().amax(dim=1, keepdim=True)
        scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (x * (1 / scales)).round().clamp(-128, 127).to(torch.int8), scales  # as the operator rounds


def int8_linear_torch(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x @ W.T as the operator computes it: int8 tokens, exact integer sums (float64 holds
    every sum of int8 products exactly), then the two scales."""
    quants, token_scales = quantize_tokens(x, weight.input_scale)
    sums = quants.double() @ weight.weight.double().T
    return (sums.float() * token_scales * weight.scales).to(x.dtype)
