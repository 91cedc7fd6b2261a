"""int8 W8A8 weights (vLLM's compressed-tensors "int-quantized" checkpoints) and their matmul.

Weights are int8 with a float scale per output channel (w = scale * q); activations are
quantized to int8 when the layer runs, per token (scale = max |x| / 127) or with the one
static scale a checkpoint may carry. The products are summed in int32 over the whole row,
so unlike GGUF's blocks (a float scale per 32 weights) a layer is one int8 GEMM and one
rescale: the form that beats bfloat16 on large batches (kernels/csrc/cpu_int8.cpp). On AVX2
CPUs without VNNI the weight is repacked at load for the operator's own kernel
(`PackedInt8Weight`), since oneDNN's int8 GEMM there is slower than float32. Integer sums are
exact, so both kernels and `int8_linear_torch`, the oracle and the fallback, give the same bits.
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


LANES = 8  # output channels a packed group interleaves


@dataclass(frozen=True)
class PackedInt8Weight:
    """An Int8Weight as the AVX2 kernel reads it: groups of 8 output channels, each step of 4
    inputs holding those 4 weights of every channel side by side (one 32-bit lane each), so
    one byte-multiply instruction advances 8 channels.

    packed: int8 [ceil(out / 8), ceil(in / 4) * 32], zeros past the ends."""

    packed: torch.Tensor
    scales: torch.Tensor
    input_scale: torch.Tensor | None
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, weight: Int8Weight) -> PackedInt8Weight:
        out, inputs = weight.shape
        padded = torch.nn.functional.pad(weight.weight, (0, -inputs % 4, 0, -out % LANES))
        groups, steps = padded.shape[0] // LANES, padded.shape[1] // 4
        packed = padded.reshape(groups, LANES, steps, 4).transpose(1, 2).reshape(groups, -1).contiguous()
        return cls(packed, weight.scales, weight.input_scale, out, inputs)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * self.scales.element_size()

    def unpacked(self) -> Int8Weight:
        groups = self.packed.shape[0]
        weight = self.packed.reshape(groups, -1, LANES, 4).transpose(1, 2).reshape(groups * LANES, -1)
        return Int8Weight(weight[: self.out_features, : self.in_features].contiguous(), self.scales, self.input_scale)

    def dequantize(self) -> torch.Tensor:
        return self.unpacked().dequantize()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return int8_linear_torch(x, self.unpacked())
        return torch.ops.pagefleet.int8_linear_packed(x.contiguous(), self.packed, self.scales, self.input_scale)


def for_this_cpu(weight: Int8Weight) -> Int8Weight | PackedInt8Weight:
    """The weight in the layout its CPU's kernel reads: packed where that is AVX2's (no VNNI)."""
    if weight.weight.device.type == "cpu" and cpu_ops.quantized_packed_layout():
        return PackedInt8Weight.pack(weight)
    return weight


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
