"""A GGUF file's quantized tensors, put in a loaded model's linear layers as they are stored.

The model is first loaded as always, from the float32 directory the file was converted to
(engine/loader/gguf_cache.py: config, tokenizer, norms, biases); then each linear layer
whose GGUF tensors are of types the operator reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K: all of a Q4_K_M or Q5_K_M file's) takes them and frees its float weight; a fused
layer whose parts differ in type (a Q4_K_M file's v in Q6_K beside q and k in Q4_K) runs
each run of one type on its own. Any other type (F16, Q2_K, Q3_K, the IQ formats, ...)
stays dequantized, and the log says which. llama.cpp's converter permutes q and k rows for its rotary layout;
the rows are put back in Hugging Face's order here, blocks untouched (a block lies within
one row).
"""

from __future__ import annotations

import logging
import math
import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pagefleet.engine.layers.linear import Linear
from pagefleet.engine.layers.quantized import GGML_BLOCKS, GGML_NAMES, PackedWeight, QuantizedWeight, StackedWeight
from pagefleet.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Source:
    """One GGUF tensor feeding a linear layer: its name, and for llama.cpp's permuted q/k
    the number of heads whose rows to put back in order."""

    name: str
    permuted_heads: int | None = None


# llama.cpp's names of the Hugging Face projections.
_GGUF_PROJECTIONS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _llama_sources(config: ModelConfig) -> dict[str, list[_Source]]:
    """Our fused linear layers (module paths) and the GGUF tensors they stack, in order."""
    from pagefleet.engine.models.llama import FUSED_PROJECTIONS  # here: models imports this module

    permuted = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}
    return {
        f"layers.{i}.{ours}": [_Source(f"blk.{i}.{_GGUF_PROJECTIONS[p]}.weight", permuted.get(p)) for p in parts]
        for i in range(config.num_layers)
        for ours, parts in FUSED_PROJECTIONS.items()
    }


def _gpt2_sources(config: ModelConfig) -> dict[str, list[_Source]]:
    """GPT-2's linear layers and their GGUF tensors (llama.cpp stores Conv1D's weights
    transposed, [out, in] as our layers are, and q/k/v fused as c_attn is)."""
    sources = {}
    for i in range(config.num_layers):
        blk, ours = f"blk.{i}.", f"h.{i}."
        sources[ours + "qkv"] = [_Source(blk + "attn_qkv.weight")]
        sources[ours + "o"] = [_Source(blk + "attn_output.weight")]
        sources[ours + "fc"] = [_Source(blk + "ffn_up.weight")]
        sources[ours + "proj"] = [_Source(blk + "ffn_down.weight")]
    return sources


def _unpermute_rows(weight: QuantizedWeight, heads: int) -> QuantizedWeight:
    """Undo llama.cpp's q/k row order (per head: the two rotary halves interleaved)."""
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return weight.select_rows(order)


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class _TensorInfo:
    ggml_type: int
    shape: tuple[int, ...]  # GGUF's order: the contiguous dimension first
    offset: int  # from the start of the file


def _read_tensor_index(data: mmap.mmap) -> dict[str, _TensorInfo]:
    """The tensors of a GGUF file (v2/v3), skipping its metadata: gguf.GGUFReader parses
    every metadata array into numpy views, 3 s for SmolLM2's tokenizer; this takes 50 ms."""
    magic, version, num_tensors, num_values = struct.unpack_from("<4sIQQ", data, 0)
    if magic != b"GGUF" or version < 2:
        raise ValueError("not a GGUF file of version 2 or later")
    position, alignment = 24, 32

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
    return {name: _TensorInfo(ggml_type, shape, start + offset) for name, ggml_type, shape, offset in infos}


class GGUFTensors:
    """The file's tensors by name, as QuantizedWeight where the operator reads the type."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as handle:
            self._data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._tensors = _read_tensor_index(self._data)

    def type_name(self, name: str) -> str:
        import gguf  # only for the name of a type kept dequantized

        return gguf.GGMLQuantizationType(self._tensors[name].ggml_type).name

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


def _fused_weight(
    linear: Linear,
    parts: list[QuantizedWeight | None],
    sources: list[_Source],
    tensors: GGUFTensors,
    kept: Counter[str],
    dequantized: Counter[str],
) -> QuantizedWeight | StackedWeight:
    """One layer's weight from its sources' tensors: consecutive parts of one type fused; a
    part of another type runs on its own, and a part the kernels do not read keeps its rows
    of the loaded float weight."""
    blocks: list[QuantizedWeight | torch.Tensor] = []
    first_row = 0
    for part, source in zip(parts, sources, strict=True):
        rows = tensors.rows(source.name)
        if part is None:
            blocks.append(linear.weight.data[first_row : first_row + rows].clone())
            dequantized[tensors.type_name(source.name)] += 1
        else:
            part = _unpermute_rows(part, source.permuted_heads) if source.permuted_heads else part
            part = part.to(linear.weight.device)
            last = blocks[-1] if blocks else None
            if isinstance(last, QuantizedWeight) and last.ggml_type == part.ggml_type:
                blocks[-1] = QuantizedWeight.cat([last, part])
            else:
                blocks.append(part)
            kept[GGML_NAMES[part.ggml_type]] += 1
        first_row += rows
    first = blocks[0]
    return first if len(blocks) == 1 and isinstance(first, QuantizedWeight) else StackedWeight(tuple(blocks))


def quantize_from_gguf(model: nn.Module, config: ModelConfig, path: Path) -> None:
    """Put the GGUF file's quantized tensors in `model` (a single-rank Llama-family or GPT-2
    model, weights loaded, on the CPU or CUDA); logs what was kept quantized and what not."""
    if config.family not in ("llama", "gpt2"):
        logger.info("GGUF: %s weights are served dequantized (no quantized path yet)", config.architecture)
        return
    tensors = GGUFTensors(path)
    modules = dict(model.named_modules())
    kept: Counter[str] = Counter()
    dequantized: Counter[str] = Counter()
    float_bytes = quantized_bytes = 0
    layer_sources = _llama_sources(config) if config.family == "llama" else _gpt2_sources(config)
    for module_name, sources in layer_sources.items():
        linear = modules[module_name]
        assert isinstance(linear, Linear)
        parts = [tensors.quantized(source.name) for source in sources]
        if all(part is None for part in parts):
            dequantized.update(tensors.type_name(source.name) for source in sources)
            continue
        fused = _fused_weight(linear, parts, sources, tensors, kept, dequantized)
        float_bytes += linear.weight.numel() * linear.weight.element_size()
        linear.quantize(fused)
        quantized_bytes += fused.nbytes
    # The output head (token_embd when tied) and the embedding lookup, which reads the same rows.
    head_name = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    head = tensors.quantized(head_name)
    lm_head = modules["lm_head"]
    assert isinstance(lm_head, Linear)
    if head is not None:
        head = head.to(lm_head.weight.device)
        float_bytes += lm_head.weight.numel() * lm_head.weight.element_size()
        lm_head.quantize(head)
        quantized_bytes += head.nbytes
        kept[GGML_NAMES[head.ggml_type]] += 1
    else:
        dequantized[tensors.type_name(head_name)] += 1
    if config.tie_word_embeddings:  # the head's own weight, in its kernel's layout: the rows held once
        embedding = lm_head.quantized
    else:
        untied = tensors.quantized("token_embd.weight")
        embedding = None if untied is None else untied.to(lm_head.weight.device)
    if embedding is not None:
        assert isinstance(embedding, QuantizedWeight | PackedWeight)
        model.quantized_embedding = embedding  # type: ignore[assignment]
        float_embedding = model.embedding
        assert isinstance(float_embedding, torch.Tensor)
        float_embedding.data = torch.empty(0, dtype=float_embedding.dtype)
    logger.info(
        "GGUF %s: served as stored: %s; dequantized: %s (linear weights %.0f MiB, %.0f MiB in float)",
        path.name,
        ", ".join(f"{n} x{c}" for n, c in sorted(kept.items())) or "none",
        ", ".join(f"{n} x{c}" for n, c in sorted(dequantized.items())) or "none",
        quantized_bytes / 2**20,
        float_bytes / 2**20,
    )
