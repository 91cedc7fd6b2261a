"""vLLM's `kv_transfer_params`: the one place they are read and written, by the engine, its
server and the gateway alike.

A request to a prefill replica carries `{"do_remote_decode": true}`; its answer carries what
a decode replica needs to pull the prompt's KV: `do_remote_prefill`, the prefill replica's
`remote_engine_id`, `remote_host` and `remote_port`, the `remote_block_ids` and the
`remote_request_id` (the fields of vLLM's NixlConnector). The decode replica's request
carries those back. With KV cache groups (sliding-window layers), `remote_block_ids` is one
list per group; with one group, a flat list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BlockIds = list[int] | list[list[int]]  # flat (one KV cache group) or one list per group

FIELD = "kv_transfer_params"


class KVTransferParamsError(ValueError):
    """`kv_transfer_params` that are not what either side of a transfer sends."""


@dataclass(slots=True, frozen=True)
class RemotePrefill:
    """Where a decode replica pulls a prompt's KV from (a prefill replica's answer)."""

    engine_id: str
    host: str
    port: int
    block_ids: BlockIds
    request_id: str

    @property
    def group_block_ids(self) -> list[list[int]]:
        return per_group(self.block_ids)

    @classmethod
    def parse(cls, params: dict[str, Any]) -> RemotePrefill:
        """From `kv_transfer_params` with `do_remote_prefill`.

        Raises:
            KVTransferParamsError: a field is missing or of the wrong type.
        """
        names = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids", "remote_request_id")
        missing = [name for name in names if params.get(name) is None]
        if missing:
            raise KVTransferParamsError(f"do_remote_prefill needs {', '.join(missing)} (a prefill replica's answer)")
        block_ids, port = params["remote_block_ids"], params["remote_port"]
        if not is_block_ids(block_ids):
            raise KVTransferParamsError("remote_block_ids must be a list of block ids, or one per KV cache group")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise KVTransferParamsError("remote_port must be a TCP port")
        return cls(
            str(params["remote_engine_id"]),
            str(params["remote_host"]),
            port,
            block_ids,
            str(params["remote_request_id"]),
        )


@dataclass(slots=True, frozen=True)
class KVTransferParams:
    """A request's `kv_transfer_params`, read: whether a decode replica will pull its prompt
    (`do_remote_decode`, sent to a prefill replica), and where to pull it from
    (`do_remote_prefill`, sent to a decode replica)."""

    remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None

    @classmethod
    def parse(cls, value: Any) -> KVTransferParams | None:
        """None when absent or empty.

        Raises:
            KVTransferParamsError: not an object, or a `do_remote_prefill` without its fields.
        """
        if value is None:
            return None
        if not isinstance(value, dict):
            raise KVTransferParamsError("must be an object")
        if not value:
            return None
        remote = RemotePrefill.parse(value) if value.get("do_remote_prefill") else None
        return cls(bool(value.get("do_remote_decode")), remote)

    @classmethod
    def of_extra_args(cls, extra_args: dict[str, Any] | None) -> KVTransferParams | None:
        """From sampling parameters' `extra_args`, where the servers put the request's field."""
        return cls.parse((extra_args or {}).get(FIELD))


def is_block_ids(value: Any) -> bool:
    """Whether `value` is a `BlockIds`: a list of block ids, or a list of such lists."""

    def ids(items: Any) -> bool:
        return isinstance(items, list) and all(isinstance(b, int) and b >= 0 for b in items)

    return ids(value) or (isinstance(value, list) and bool(value) and all(ids(items) for items in value))


def per_group(block_ids: BlockIds) -> list[list[int]]:
    """`block_ids` as one list per KV cache group (a flat list is one group's)."""
    if block_ids and isinstance(block_ids[0], list):
        return [list(group) for group in block_ids]  # type: ignore[arg-type]
    return [list(block_ids)]  # type: ignore[arg-type]


def for_prefill() -> dict[str, Any]:
    """What a request to a prefill replica carries."""
    return {"do_remote_decode": True}


def prefill_answer(
    request_id: str,
    block_ids: BlockIds,
    engine_id: str | None = None,
    host: str | None = None,
    port: int | None = None,
) -> dict[str, Any]:
    """What a prefill replica answers: the pinned prompt blocks and where to pull them from
    (an engine without a transport, offline, names only the blocks and the request)."""
    answer: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_request_id": request_id,
    }
    if engine_id is not None:
        answer.update(remote_engine_id=engine_id, remote_host=host, remote_port=port, tp_size=1)
    return answer


def of_prefill_answer(answer: dict[str, Any]) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill replica's JSON answer, to hand to a decode
    replica as they are; None if it has none."""
    params = answer.get(FIELD)
    return params if isinstance(params, dict) and params.get("do_remote_prefill") else None
