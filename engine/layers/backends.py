"""Which attention backend an engine uses: one registration per backend.

`auto` picks the Triton kernels on CUDA; on a CPU the compiled operator if it can be built
and loaded here and takes the dtype (float32, bfloat16), else plain torch (with one warning
if the operator could not be built).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.layers.attention import AttentionBackend, CacheSpec


def _torch(spec: CacheSpec) -> AttentionBackend:
    from pagefleet.engine.layers.torch_attention import TorchAttentionBackend

    return TorchAttentionBackend(spec)


CPU_OPERATOR_DTYPES = (torch.float32, torch.bfloat16)


def _cpu(spec: CacheSpec) -> AttentionBackend:
    from pagefleet.engine.layers.cpu_attention import CpuAttentionBackend
    from pagefleet.kernels import cpu_ops

    if spec.device.type != "cpu":
        raise InvalidParameterError("attention_backend", "the compiled CPU operator runs on the CPU only")
    if spec.dtype not in CPU_OPERATOR_DTYPES:
        raise InvalidParameterError(
            "attention_backend", f"the compiled CPU operator takes float32 or bfloat16, not {spec.dtype}; use torch"
        )
    if not cpu_ops.load():
        raise InvalidParameterError("attention_backend", "the compiled CPU operator could not be built (see the log)")
    return CpuAttentionBackend(spec)


def _triton(spec: CacheSpec) -> AttentionBackend:
    if spec.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidParameterError(
            "attention_backend",
            "the Triton kernels need a CUDA device; on a CPU they run only under the Triton "
            "interpreter (set TRITON_INTERPRET=1 before starting)",
        )
    from pagefleet.engine.layers.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend(spec)


BACKENDS: dict[str, Callable[[CacheSpec], AttentionBackend]] = {"torch": _torch, "cpu": _cpu, "triton": _triton}


def select_backend(choice: str, spec: CacheSpec) -> AttentionBackend:
    """The backend named `choice` ("auto": the fastest correct one for `spec.device`)."""
    if choice == "auto":
        if spec.device.type == "cuda":
            choice = "triton"
        else:
            from pagefleet.kernels import cpu_ops

            # float16 on a CPU runs on torch's own kernels (the compiled operator has no float16).
            choice = "cpu" if spec.dtype in CPU_OPERATOR_DTYPES and cpu_ops.load() else "torch"
    return BACKENDS[choice](spec)
