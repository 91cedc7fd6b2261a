"""Rotary position embeddings (the non-interleaved "rotate half" form used by HF Llama):
the cos/sin tables; `layers.fused.rotary` applies them.

LongRoPE (Phi-3-128k, Phi-4-mini) has two sets of frequencies. transformers rotates a
sequence by the long set once it is longer than the pretraining length, and when a sequence
grows past it while it decodes, it computes the whole sequence again with the long set (its
cache of keys rotated by the short one is dropped). Here the table holds the short rows then
the long ones; a request rotates by one set at a time (`Request.rotates_long`), and the
scheduler computes a request again when it outgrows the short one, as transformers does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any], long: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, with linear, llama3, YaRN, LongRoPE
    (`long`: its long factors, else its short ones) or proportional scaling applied."""
    wavelengths = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "proportional":  # Gemma 4's global layers: the first angles turn, the rest stay
        turning = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq = torch.zeros(head_dim // 2)
        inv_freq[:turning] = 1.0 / wavelengths[:turning]
        return inv_freq / scaling.get("factor", 1.0)
    if rope_type == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * wavelengths)
    inv_freq = 1.0 / wavelengths
    if rope_type == "yarn":
        return _yarn_blended(wavelengths, head_dim, theta, scaling)
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_blended(wavelengths: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (gpt-oss, DeepSeek, Qwen long contexts): fast-turning dimensions keep their
    frequency, slow ones are divided by `factor`, with a linear ramp between the dimensions
    that turn `beta_fast` and `beta_slow` times over the pretraining length, as transformers
    computes it (`truncate`, default true, rounds the ramp's ends outwards)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def turning_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = turning_dim(beta_fast), turning_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the dimension keeps its frequency
    return (1.0 / (factor * wavelengths)) * (1 - kept) + (1.0 / wavelengths) * kept


def _yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """YaRN's scale of cos and sin: the config's, else 0.1 ln(factor) + 1 (DeepSeek's
    `mscale` / `mscale_all_dim` as a ratio of two such terms)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def magnitude(mscale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return magnitude(mscale) / magnitude(mscale_all_dim) if mscale and mscale_all_dim else magnitude()


def _longrope_attention_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """LongRoPE's scale of cos and sin (both sets): the config's, else transformers' default
    from the ratio of the context to the pretraining length."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_rows(start: int, end: int, long: bool, max_positions: int) -> range:
    """The table rows of positions start..end-1: the positions, or with `long` the long
    rows (offset by the short set's `max_positions`)."""
    offset = max_positions if long else 0
    return range(start + offset, end + offset)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by position (LongRoPE: by `rope_rows`), applied to
    q and k in place of HF's."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freq_sets = [rope_inv_freq(head_dim, theta, scaling)]
        attention_factor = 1.0
        if scaling.get("rope_type") == "longrope":
            freq_sets.append(rope_inv_freq(head_dim, theta, scaling, long=True))
            attention_factor = _longrope_attention_factor(scaling, max_positions)
        elif scaling.get("rope_type") == "yarn":
            attention_factor = _yarn_attention_factor(scaling)
        freqs = torch.cat([torch.outer(positions, inv_freq) for inv_freq in freq_sets])
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, [num_tokens, 1, head_dim]: once per step, shared
        by every layer."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def interleaved_rope_rows_as_halves(head_size: int, kept: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """A weight transform for checkpoints that rotate interleaved pairs (x0, x1), (x2, x3)
    (DeepSeek, Llama 4): in each head of `head_size` rows, the first `kept` rows stay, the
    RoPE rows after them become their even rows then their odd ones, so the rotate-half
    RoPE here applies (q . k is unchanged, as both move alike)."""
    rope_rows = torch.arange(kept, head_size)
    order = torch.cat((torch.arange(kept), rope_rows[0::2], rope_rows[1::2]))
    return lambda weight: weight.view(-1, head_size, *weight.shape[1:])[:, order].reshape(weight.shape)
