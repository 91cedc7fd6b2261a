"""The KV layout two replicas must share to move blocks, and a prompt's KV from outside the
engine. The requests' `kv_transfer_params` are read and written in pagefleet/protocol/
kv_transfer.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagefleet.engine.core.kv_groups import KVGroups, groups_from, needed_blocks
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.protocol.kv_transfer import FIELD, KVTransferParams, KVTransferParamsError

ROLES = ("prefill", "decode", "both")
# A model with state layers: per state layer, one sequence's (convolution window [C, K - 1]
# in the cache's dtype, recurrent state float32) after exactly a prefix's tokens.
StateRows = list[tuple[torch.Tensor, torch.Tensor]]


class KVTransferError(RuntimeError):
    """A transfer that cannot happen (unreachable replica, blocks gone, layouts that differ)."""


@dataclass(slots=True, frozen=True)
class KVLayout:
    """What must agree between two replicas before any KV byte moves between them.

    `group_windows` and `layer_groups` are the KV cache groups (engine/core/kv_groups.py):
    what blocks of a prefix each layer's group keeps, so both sides move the same ones.
    One full group of every layer is written `(None,)` and `()`, and left out of
    `as_dict`, so that replicas and tier files of one group read as they always did."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    group_windows: tuple[int | None, ...] = (None,)
    layer_groups: tuple[int, ...] = ()  # per layer, its group; () when all are in group 0
    # Per layer, (KV heads, head dim) where layers differ (Gemma 4); () when every layer's
    # are (num_kv_heads, head_dim). The layers are the cache layers (ModelConfig.cache_layers).
    layer_shapes: tuple[tuple[int, int], ...] = ()
    # A model with state layers (engine/worker/state_cache.py): how many, and one layer's
    # (convolution window, recurrent state) shape. A prefix moves with the state after it.
    num_state_layers: int = 0
    state_shapes: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        # JSON gives lists: compare as tuples; spell one group of every layer one way.
        layer_groups = tuple(self.layer_groups)
        object.__setattr__(self, "group_windows", tuple(self.group_windows))
        object.__setattr__(self, "layer_groups", () if not any(layer_groups) else layer_groups)
        shapes = tuple((int(heads), int(dim)) for heads, dim in self.layer_shapes)
        uniform = all(shape == (self.num_kv_heads, self.head_dim) for shape in shapes)
        object.__setattr__(self, "layer_shapes", () if uniform else shapes)
        object.__setattr__(self, "state_shapes", tuple(tuple(int(d) for d in shape) for shape in self.state_shapes))

    @property
    def has_state(self) -> bool:
        return self.num_state_layers > 0

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head dim) of `layer`'s keys and values."""
        return self.layer_shapes[layer] if self.layer_shapes else (self.num_kv_heads, self.head_dim)

    @property
    def kv_groups(self) -> KVGroups:
        return groups_from(self.group_windows, self.layer_groups or (0,) * self.num_layers)

    def first_blocks(self, num_tokens: int) -> tuple[int, ...]:
        """Per layer, the first block of a `num_tokens`-token prefix its group needs
        (`needed_blocks`): 0 in a full group, the last window's first in a sliding one."""
        groups = self.kv_groups
        ranges = needed_blocks(groups, num_tokens, self.block_size)
        return tuple(ranges[group].start for group in groups.layer_groups)

    def mismatch(self, other: KVLayout, here: str, there: str) -> str | None:
        """Why `other` cannot exchange blocks with this layout; None if it can. `here` and
        `there` name the two sides in the message ("the prefill replica")."""
        differences = [
            f"{name} {getattr(self, name)} on {here}, {getattr(other, name)} on {there}"
            for name in self.__slots__  # type: ignore[attr-defined]
            if getattr(self, name) != getattr(other, name)
        ]
        return "; ".join(differences) or None

    def as_dict(self) -> dict[str, Any]:
        value = {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
        if value["group_windows"] == (None,) and not value["layer_groups"]:
            del value["group_windows"], value["layer_groups"]
        if not value["layer_shapes"]:
            del value["layer_shapes"]
        if not value["num_state_layers"]:
            del value["num_state_layers"], value["state_shapes"]
        return value

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> KVLayout:
        optional = {"group_windows", "layer_groups", "layer_shapes", "num_state_layers", "state_shapes"}
        try:
            return cls(**{name: value[name] for name in cls.__slots__ if name in value or name not in optional})  # type: ignore[attr-defined]
        except (KeyError, TypeError) as error:
            raise KVTransferError(f"the remote replica sent no valid KV layout ({error})") from None


@dataclass(slots=True)
class RemoteKV:
    """A prompt's KV from outside this engine, in host memory until the scheduler loads it
    into freshly allocated blocks. It holds the first `num_tokens` tokens, in `num_blocks`
    blocks of which each layer carries what its KV cache group needs to go on from there
    (`needed_blocks`): `keys[layer]` and `values[layer]` are shaped [carried blocks,
    block_size, kv_heads, head_dim] and start at prefix block `first_block(layer)` (0, or
    the last window's first block for a sliding-window group's layer).
    `origin`: "prefill" (pulled from a prefill replica), "file" (the file tier's full
    blocks) or "peer" (another replica's cached blocks); the last two are counted as cached
    tokens, and dropped if the local prefix cache has as many when the request starts.
    `state`: a model with state layers' state after exactly those tokens (then a whole
    number of blocks: its snapshots are kept at block boundaries)."""

    num_tokens: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    origin: str = "prefill"
    first_blocks: tuple[int, ...] = ()  # per layer; () when every layer starts at block 0
    state: StateRows | None = None

    def first_block(self, layer: int) -> int:
        return self.first_blocks[layer] if self.first_blocks else 0

    @property
    def num_blocks(self) -> int:
        return self.first_block(0) + self.keys[0].shape[0] if self.keys else 0

    @property
    def num_bytes(self) -> int:
        state = [tensor for pair in self.state or [] for tensor in pair]
        return sum(t.numel() * t.element_size() for t in self.keys + self.values + state)


@dataclass(slots=True)
class KVLoad:
    """KV from outside the engine to copy in before the next forward pass: per layer,
    `keys[layer][i]` and `values[layer][i]` go into block `block_ids[layer][i]`."""

    block_ids: list[list[int]]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def transfer_params(params: SamplingParams) -> KVTransferParams | None:
    """A request's `kv_transfer_params` (the servers put them in `extra_args`), read once in
    protocol/kv_transfer.py's terms.

    Raises:
        InvalidParameterError: they are not what either side of a transfer sends.
    """
    try:
        return KVTransferParams.of_extra_args(params.extra_args)
    except KVTransferParamsError as error:
        raise InvalidParameterError(FIELD, str(error)) from None
