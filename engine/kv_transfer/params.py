"""The KV layout two replicas must share to move blocks, and a prompt's KV from outside the
engine. The requests' `kv_transfer_params` are read and written in pagefleet/protocol/
kv_transfer.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.protocol.kv_transfer import FIELD, KVTransferParams, KVTransferParamsError

ROLES = ("prefill", "decode", "both")


class KVTransferError(RuntimeError):
    """A transfer that cannot happen (unreachable replica, blocks gone, layouts that differ)."""


@dataclass(slots=True, frozen=True)
class KVLayout:
    """What must agree between two replicas before any KV byte moves between them."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def mismatch(self, other: KVLayout, here: str, there: str) -> str | None:
        """Why `other` cannot exchange blocks with this layout; None if it can. `here` and
        `there` name the two sides in the message ("the prefill replica")."""
        differences = [
            f"{name} {getattr(self, name)} on {here}, {getattr(other, name)} on {there}"
            for name in ("model", "num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
            if getattr(self, name) != getattr(other, name)
        ]
        return "; ".join(differences) or None

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> KVLayout:
        try:
            return cls(**{name: value[name] for name in cls.__slots__})  # type: ignore[attr-defined]
        except (KeyError, TypeError) as error:
            raise KVTransferError(f"the remote replica sent no valid KV layout ({error})") from None


@dataclass(slots=True)
class RemoteKV:
    """A prompt's KV from outside this engine, in host memory until the scheduler loads it
    into freshly allocated blocks: `keys[layer]` and `values[layer]` are shaped
    [blocks, block_size, kv_heads, head_dim] and hold the first `num_tokens` tokens.
    `origin`: "prefill" (pulled from a prefill replica), "file" (the file tier's full
    blocks) or "peer" (another replica's cached blocks); the last two are counted as cached
    tokens, and dropped if the local prefix cache has as many when the request starts."""

    num_tokens: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    origin: str = "prefill"

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


@dataclass(slots=True)
class KVLoad:
    """KV from outside the engine to copy into `block_ids` before the next forward pass."""

    block_ids: list[int]
    kv: RemoteKV


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
