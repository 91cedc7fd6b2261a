"""gpt-oss's released checkpoints: experts in MXFP4, dequantized as they load.

openai/gpt-oss-20b and -120b keep every expert matrix as two tensors, `<name>_blocks`
(uint8 [..., rows, groups, 16]: 32 FP4 E2M1 codes per group, two per byte, low nibble
first) and `<name>_scales` (uint8 [..., rows, groups]: a power of two per group, biased by
127). The rest of the checkpoint is bfloat16. Each pair becomes the float tensor the
unquantized checkpoint holds under `<name>` (`[..., columns, rows]`, x @ W), exactly the
values transformers' own dequantization gives, so the model loads it as it loads any
gpt-oss checkpoint. Serving the experts in MXFP4 itself is left to a fused operator.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from pagefleet.engine.errors import UnsupportedModelError

# The 16 values of an FP4 E2M1 code (sign bit, then two exponent bits and one mantissa bit).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BLOCKS, _SCALES = "_blocks", "_scales"


def is_mxfp4_checkpoint(model_dir: Path) -> bool:
    config = json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
    return config.get("quant_method") == "mxfp4"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., rows, groups, 16], scales uint8 [..., rows, groups] -> float32
    [..., groups * 32, rows] (every value a code's times its group's power of two: exact)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise UnsupportedModelError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    codes = torch.tensor(FP4_VALUES, dtype=torch.float32)
    low, high = codes[(blocks & 0x0F).long()], codes[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-3)  # [..., rows, groups * 32], code order
    exponents = (scales.to(torch.int32) - 127).repeat_interleave(32, dim=-1)
    return torch.ldexp(values, exponents).transpose(-1, -2).contiguous()


def dequantized_mxfp4(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every `_blocks`/`_scales` pair replaced by its float
    tensor under the pair's name; a pair missing its other half is refused by name."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in (_BLOCKS, _SCALES) if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        pair = halves.setdefault(name.removesuffix(suffix), {})
        pair[suffix] = tensor
        if len(pair) == 2:
            base = name.removesuffix(suffix)
            del halves[base]
            yield base, dequantize_mxfp4(pair[_BLOCKS], pair[_SCALES])
    if halves:
        raise UnsupportedModelError(f"MXFP4 tensors without their other half: {', '.join(sorted(halves))}")
