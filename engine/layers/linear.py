"""A frozen linear layer that runs on oneDNN with a prepacked weight on the CPU, or on a
quantized weight: GGUF's blocks as the file stores them (engine/layers/quantized.py) or an
int8 W8A8 checkpoint's (engine/layers/int8.py).

MKL's `F.linear` repacks the weight on every call; oneDNN with a weight packed once at
load time runs this engine's matmul shapes 1.4-1.7x faster in float32 (measured on the
2-core CI machine: 74 -> 128 GFLOPS at 64 rows, 127 -> 179 at 1024). Elsewhere (CUDA, or
a torch without oneDNN) it is plain `F.linear`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.layers.int8 import Int8Weight, PackedInt8Weight, for_this_cpu
from pagefleet.engine.layers.quantized import PackedWeight, QuantizedWeight, StackedWeight, for_this_device

if TYPE_CHECKING:
    from pagefleet.engine.lora.layer import LoRALayer


# oneDNN runs 1 and 2 rows through kernels that are slower than its 3-row one: a whole
# SmolLM2 forward's matmuls took 28.7 ms at 1 row, 32.2 at 2 and 26.6 at 3 (float32, 2
# threads); fewer rows are padded with zeros to 3.
_MIN_PACKED_ROWS = 3


def _packable(dtype: torch.dtype) -> bool:
    """oneDNN packs float32 anywhere; bfloat16 only on CPUs with bf16 instructions
    (AVX512-BF16/AVX-NE-CONVERT; e.g. not on an AVX2-only EPYC), else plain F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def frozen_parameter(*shape: int) -> nn.Parameter:
    """An uninitialised inference-only parameter, filled by the weight loader."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x @ weight.T + bias. `weight` may be shared (tied embeddings). With `lora` set
    (multi-LoRA serving), each token row also gets its own adapter's delta."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = frozen_parameter(out_features, in_features)
        self.bias = frozen_parameter(out_features) if bias else None
        self._packed: torch.Tensor | None = None
        self.quantized: QuantizedWeight | PackedWeight | StackedWeight | Int8Weight | PackedInt8Weight | None = None
        self.lora: LoRALayer | None = None

    def quantize(self, weight: QuantizedWeight | StackedWeight | Int8Weight) -> None:
        """Serve from `weight` (the same matrix, quantized) and free the float one, which
        a tied embedding shares: its owner must stop reading it too. GGUF blocks are repacked
        here for the CPU's kernel where it reads its own layout."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight of shape {weight.shape}, expected {tuple(self.weight.shape)}")
        self.quantized = for_this_cpu(weight) if isinstance(weight, Int8Weight) else for_this_device(weight)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        self._packed = None

    def pack(self) -> None:
        """Prepack the weight for oneDNN (after weights are loaded and cast)."""
        if self.packable:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())

    @property
    def packable(self) -> bool:
        weight = self.weight
        return self.quantized is None and weight.device.type == "cpu" and _packable(weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            y = self.quantized.matmul(x)
            if self.bias is not None:
                y = y + self.bias
        elif self._packed is not None:
            y = packed_linear(x, self._packed, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's matmul on a weight `pack` prepared, one or two rows padded to three."""
    rows = x.shape[0]
    short = rows < _MIN_PACKED_ROWS and x.dim() == 2  # a decode step of one or two sequences
    rows_in = F.pad(x, (0, 0, 0, _MIN_PACKED_ROWS - rows)) if short else x
    return torch.ops.mkldnn._linear_pointwise(rows_in, packed, bias, "none", [], "")[:rows]


def pack_linears(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
