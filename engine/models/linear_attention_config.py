"""What a model's linear-attention layers need of its config.json: Qwen3-Next's and
Qwen3.5's Gated DeltaNet layers and Granite 4's Mamba-2 layers (`layer_types` entries
"linear_attention", older configs' "mamba"), whose state per request is a short
convolution window and one recurrent matrix per head instead of a growing KV
(engine/models/qwen3_next.py, granite_hybrid.py; the state cache in engine/core/state_slots.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LINEAR = "linear_attention"  # a `layer_types` entry: a layer with a state, no KV cache
# Older configs' names for layer types, as transformers renames them.
LEGACY_LAYER_TYPES = {"mamba": LINEAR, "attention": "full_attention"}


@dataclass(slots=True, frozen=True)
class LinearAttentionOptions:
    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: each key head serves value/key of them
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # the causal depthwise convolution's width (its state holds conv_kernel - 1 inputs)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: queries, keys and values side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per request and layer, (the convolution window [conv_dim, conv_kernel - 1], the
        recurrent state [value heads, key head dim, value head dim])."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_value_heads, self.key_head_dim, self.value_head_dim)


def linear_attention_options(raw: dict[str, Any]) -> LinearAttentionOptions:
    return LinearAttentionOptions(
        num_key_heads=raw["linear_num_key_heads"],
        num_value_heads=raw["linear_num_value_heads"],
        key_head_dim=raw["linear_key_head_dim"],
        value_head_dim=raw["linear_value_head_dim"],
        conv_kernel=raw.get("linear_conv_kernel_dim", 4),
    )


@dataclass(slots=True, frozen=True)
class Mamba2Options:
    """Mamba-2's selective state-space layers (Granite 4): `num_heads` heads of `head_dim`
    channels, each with an [head_dim, state_size] state, B and C shared within each of
    `num_groups` groups of heads."""

    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    time_step_limit: tuple[float, float]

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: x, then B and C of every group."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per request and layer, (the convolution window, the state [heads, head_dim, state_size])."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.state_size)


def mamba2_options(raw: dict[str, Any]) -> Mamba2Options:
    heads = raw["mamba_n_heads"]
    head_dim = raw.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = raw.get("mamba_expand", 2) * raw["hidden_size"] // heads
    low, high = raw.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Options(
        num_heads=heads,
        head_dim=head_dim,
        num_groups=raw.get("mamba_n_groups", 1),
        state_size=raw.get("mamba_d_state", 128),
        conv_kernel=raw.get("mamba_d_conv", 4),
        conv_bias=bool(raw.get("mamba_conv_bias", True)),
        proj_bias=bool(raw.get("mamba_proj_bias", False)),
        time_step_limit=(_as_float(low), _as_float(high)),
    )


def _as_float(value: Any) -> float:
    """A config's number, or transformers 5's spelling of a non-finite one ({"__float__": "Infinity"})."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)
