"""A GGUF file's tensors by name, read in place: their types, shapes and blocks.

Only what serving its blocks needs is parsed (the architecture, the alignment and the
tensor table); gguf.GGUFReader would parse every metadata array too.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet.engine.layers.quantized import GGML_BLOCKS, GGML_NAMES, QuantizedWeight

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class _TensorInfo:
    ggml_type: int
    shape: tuple[int, ...]  # GGUF's order: the contiguous dimension first
    offset: int  # from the start of the file


def _read_tensor_index(data: mmap.mmap) -> tuple[str | None, dict[str, _TensorInfo]]:
    """The architecture and the tensors of a GGUF file (v2/v3), skipping the rest of its
    metadata: gguf.GGUFReader parses every metadata array into numpy views, 3 s for
    SmolLM2's tokenizer; this takes 50 ms."""
    magic, version, num_tensors, num_values = struct.unpack_from("<4sIQQ", data, 0)
    if magic != b"GGUF" or version < 2:
        raise ValueError("not a GGUF file of version 2 or later")
    position, alignment, architecture = 24, 32, None

    def string(at: int) -> tuple[bytes, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        return data[at + 8 : at + 8 + length], at + 8 + length

    def skip(value_type: int, at: int) -> int:
        if value_type == _STRING:
            return string(at)[1]
        if value_type == _ARRAY:
            item_type, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if item_type in _SCALAR_BYTES:
                return at + count * _SCALAR_BYTES[item_type]
            for _ in range(count):
                at = skip(item_type, at)
            return at
        return at + _SCALAR_BYTES[value_type]

    for _ in range(num_values):
        key, position = string(position)
        (value_type,) = struct.unpack_from("<I", data, position)
        position += 4
        if key == b"general.alignment":
            (alignment,) = struct.unpack_from("<I", data, position)
        elif key == b"general.architecture" and value_type == _STRING:
            architecture = string(position)[0].decode()
        position = skip(value_type, position)
    infos = []
    for _ in range(num_tensors):
        name, position = string(position)
        (num_dims,) = struct.unpack_from("<I", data, position)
        shape = struct.unpack_from(f"<{num_dims}Q", data, position + 4)
        ggml_type, offset = struct.unpack_from("<IQ", data, position + 4 + 8 * num_dims)
        position += 4 + 8 * num_dims + 12
        infos.append((name.decode(), ggml_type, tuple(shape), offset))
    start = -(-position // alignment) * alignment
    return architecture, {
        name: _TensorInfo(ggml_type, shape, start + offset) for name, ggml_type, shape, offset in infos
    }


class GGUFTensors:
    """The file's tensors by name, as QuantizedWeight where the operator reads the type."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as handle:
            self._data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.architecture, self._tensors = _read_tensor_index(self._data)  # llama.cpp's: "llama", "gemma3", ...

    def has(self, name: str) -> bool:
        return name in self._tensors

    def type_name(self, name: str) -> str:
        import gguf  # only for the name of a type kept dequantized

        return gguf.GGMLQuantizationType(self._tensors[name].ggml_type).name

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's shape in GGUF's order (the contiguous dimension first), or None."""
        tensor = self._tensors.get(name)
        return None if tensor is None else tensor.shape

    def rows(self, name: str) -> int:
        return math.prod(self._tensors[name].shape[1:])

    def quantized(self, name: str) -> QuantizedWeight | None:
        """The tensor read as stored, or None if absent or of a type kept dequantized."""
        tensor = self._tensors.get(name)
        if tensor is None or tensor.ggml_type not in GGML_NAMES:
            return None
        block_weights, block_bytes = GGML_BLOCKS[tensor.ggml_type]
        rows, row_bytes = math.prod(tensor.shape[1:]), tensor.shape[0] // block_weights * block_bytes
        raw = self._data[tensor.offset : tensor.offset + rows * row_bytes]  # a copy: the map is read-only
        blocks = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(rows, row_bytes)
        return QuantizedWeight.from_blocks(blocks, tensor.ggml_type)
