"""The byte format of one KV transfer: frames of a JSON header and raw tensor bytes.

    frame  := b"PFKV" | u32 header length (big-endian) | header (UTF-8 JSON) | payload
    header := {"kind": "hello", "layout": {...}, "num_tokens": n, "token_ids": [...],
               "num_blocks": b}                          (first frame, no payload)
            | {"kind": "key" | "value", "layer": i, "dtype": "float32",
               "shape": [b, block_size, kv_heads, head_dim], "nbytes": N}
                                      (b: the blocks layer i's KV cache group needs)
            | {"kind": "conv" | "recurrent", "layer": j, ...}   (a model with state layers:
                                      state layer j's state after the tokens, one of each)
            | {"kind": "end"}                            (last frame, no payload)

No pickle: a payload is the tensor's own bytes, read back with `torch.frombuffer`.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

MAGIC = b"PFKV"
_PREFIX = struct.Struct(">4sI")
MAX_HEADER_BYTES = 1 << 24

STATE_KINDS = ("conv", "recurrent")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def frame(header: dict[str, Any], payload: bytes | memoryview = b"") -> bytes:
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, len(encoded)) + encoded + bytes(payload)


def tensor_frame(kind: str, layer: int, tensor: torch.Tensor) -> bytes:
    """One tensor as a frame: its header, then its bytes."""
    tensor = tensor.detach().to("cpu").contiguous()
    payload = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    header = {
        "kind": kind,
        "layer": layer,
        "dtype": DTYPE_NAMES[tensor.dtype],
        "shape": list(tensor.shape),
        "nbytes": len(payload),
    }
    return frame(header, payload)


def kv_frames(layers: list[tuple[torch.Tensor, torch.Tensor]], state: list[Any] | None = None) -> list[bytes]:
    """A prefix's tensors as frames: every layer's keys and values, then, for a model with
    state layers, each one's (conv, recurrent) state."""
    frames = []
    for layer, (keys, values) in enumerate(layers):
        frames += [tensor_frame("key", layer, keys), tensor_frame("value", layer, values)]
    for layer, pair in enumerate(state or []):
        frames += [tensor_frame(kind, layer, tensor) for kind, tensor in zip(STATE_KINDS, pair, strict=True)]
    return frames


class FrameReader:
    """Parses frames from bytes fed in any pieces (as the network delivers them)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], bytes]]:
        """Add `data`; returns every frame it completed, as (header, payload).

        Raises:
            ValueError: the bytes are not frames of this format.
        """
        self._buffer += data
        frames = []
        while len(self._buffer) >= _PREFIX.size:
            magic, header_len = _PREFIX.unpack_from(self._buffer)
            if magic != MAGIC or header_len > MAX_HEADER_BYTES:
                raise ValueError("not a pagefleet KV transfer stream")
            start = _PREFIX.size
            if len(self._buffer) < start + header_len:
                break
            header = json.loads(bytes(self._buffer[start : start + header_len]))
            nbytes = int(header.get("nbytes", 0))
            end = start + header_len + nbytes
            if len(self._buffer) < end:
                break
            payload = bytes(self._buffer[start + header_len : end])
            del self._buffer[:end]
            frames.append((header, payload))
        return frames

    @property
    def pending(self) -> int:
        return len(self._buffer)


def tensor_from(header: dict[str, Any], payload: bytes) -> torch.Tensor:
    """The tensor a key/value frame carries.

    Raises:
        ValueError: an unknown dtype, or a payload that does not match the shape.
    """
    dtype = _DTYPES.get(header.get("dtype", ""))
    if dtype is None:
        raise ValueError(f"unknown dtype {header.get('dtype')!r} in a KV frame")
    shape = [int(d) for d in header["shape"]]
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if expected != len(payload):
        raise ValueError(f"a KV frame of shape {shape} ({header['dtype']}) carries {len(payload)} bytes")
    if not payload:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)
