"""The models' small element-wise steps (and the sampler's greedy argmax), fused on CPUs,
with their plain-torch references.

Where the compiled CPU operators are loaded (kernels/cpu_ops.py; the engine loads them when
it picks the compiled attention backend), each step is one pass over memory
(csrc/cpu_fused.cpp) instead of several torch ops; elsewhere, and as the tests' oracle,
the reference runs. The fused versions round like the references (float32 math, one
rounding per torch op they replace).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagefleet.kernels import cpu_ops


def _fused(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and cpu_ops.is_loaded()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMS-normalised x (normalised in float32, rounded, then scaled, as HF)."""
    if _fused(x) and x.stride(-1) == 1 and weight.dtype == x.dtype:
        return torch.ops.pagefleet.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): a decoder layer's residual add and the next norm."""
    if _fused(x) and x.dim() == 2 and x.stride(1) == 1 and delta.stride(-1) == 1 and weight.dtype == x.dtype:
        return torch.ops.pagefleet.add_rms_norm(x, delta, weight, eps)  # type: ignore[no-any-return]
    return add_rms_norm_torch(x, delta, weight, eps)


def add_rms_norm_torch(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + delta
    return total, rms_norm_torch(total, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] -> silu(x[:, :I]) * x[:, I:], [T, I]."""
    if _fused(x) and x.dim() == 2 and x.stride(1) == 1:
        return torch.ops.pagefleet.silu_and_mul(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:], [T, I] (Gemma's MLP)."""
    if _fused(x) and x.dim() == 2 and x.stride(1) == 1:
        return torch.ops.pagefleet.gelu_tanh_and_mul(x)
    return gelu_tanh_and_mul_torch(x)


def gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x RMS-normalised and scaled by (1 + weight), in float32, rounded once (Gemma's norm:
    the checkpoint stores the weight around 0)."""
    if _fused(x) and x.stride(-1) == 1 and weight.dtype == x.dtype:
        return torch.ops.pagefleet.gemma_rms_norm(x, weight, eps)
    return gemma_rms_norm_torch(x, weight, eps)


def gemma_rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] rotated as HF does; cos, sin: [T, 1, D] -> [T, heads, D]."""
    if _fused(x) and x.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous():
        return torch.ops.pagefleet.rotary(x, cos, sin)
    return rotary_torch(x, cos, sin)


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [T, V] -> int64 [T]: torch.argmax(logits, -1) (the first largest, or the first
    NaN). torch's took 20 ms of a 64-row decode step over Gemma 3's 262,144-token
    vocabulary here (14% of the step in bfloat16); the compiled one reads the rows once."""
    if _fused(logits) and logits.dim() == 2 and logits.stride(1) == 1 and 0 < logits.shape[1] < 2**31:
        return torch.ops.pagefleet.argmax_rows(logits)
    return logits.argmax(dim=-1)
