"""What a model's linear-attention layers need of its config.json: Qwen3-Next's and
Qwen3.5's Gated DeltaNet layers (`layer_types` entries "linear_attention"), whose state per
request is a short convolution window and one recurrent matrix per value head instead of
a growing KV (engine/models/qwen3_next.py, the state cache in engine/core/state_slots.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LINEAR = "linear_attention"  # a `layer_types` entry: a Gated DeltaNet layer, no KV cache


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
