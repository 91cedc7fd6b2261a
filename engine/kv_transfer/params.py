"""vLLM's `kv_transfer_params` and the KV layout two replicas must share to move blocks.

A request to a prefill replica carries `{"do_remote_decode": true}`; its response carries
what a decode replica needs to pull the prompt's KV: `do_remote_prefill`, the prefill
replica's `remote_engine_id`, `remote_host` and `remote_port`, the `remote_block_ids` and
the `remote_request_id` (the same fields as vLLM's NixlConnector). The decode replica's
request carries those back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagefleet.engine.errors import InvalidParameterError

ROLES = ("prefill", "decode", "both")


class KVTransferError(RuntimeError):
    """A transfer that cannot happen (unreachable replica, blocks gone, layouts that differ)."""


@dataclass(slots=True, frozen=True)
class RemotePrefill:
    """Where a decode replica pulls a prompt's KV from (a prefill replica's answer)."""

    engine_id: str
    host: str
    port: int
    block_ids: list[int]
    request_id: str

    @classmethod
    def parse(cls, params: dict[str, Any]) -> RemotePrefill:
        """From a request's `kv_transfer_params` with `do_remote_prefill`.

        Raises:
            InvalidParameterError: a field is missing or of the wrong type.
        """
        missing = [
            name
            for name in ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids", "remote_request_id")
            if params.get(name) is None
        ]
        if missing:
            raise InvalidParameterError(
                "kv_transfer_params", f"do_remote_prefill needs {', '.join(missing)} (a prefill replica's answer)"
            )
        block_ids, port = params["remote_block_ids"], params["remote_port"]
        if not isinstance(block_ids, list) or not all(isinstance(b, int) and b >= 0 for b in block_ids):
            raise InvalidParameterError("kv_transfer_params", "remote_block_ids must be a list of block ids")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise InvalidParameterError("kv_transfer_params", "remote_port must be a TCP port")
        return cls(
            str(params["remote_engine_id"]),
            str(params["remote_host"]),
            port,
            block_ids,
            str(params["remote_request_id"]),
        )


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
