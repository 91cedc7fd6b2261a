"""Which attention backend an engine uses: one registration per backend.

`auto` picks the Triton kernels on CUDA; on a CPU the compiled operator if it can be built
and loaded here (else, with one warning, plain torch).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.layers.attention import AttentionBackend, CacheSpec


def _torch(spec: CacheSpec) -> AttentionBackend:
    from pagefleet.engine.layers.torch_attention import TorchAttentionBackend

    return TorchAttentionBackend(spec)


def _cpu(spec: CacheSpec) -> AttentionBackend:
    from pagefleet.engine.layers.cpu_attention import CpuAttentionBackend
    from pagefleet.kernels import cpu_ops

    if spec.device.type != "cpu":
        raise InvalidParameterError("attention_backend", "the compiled CPU operator runs on the CPU only")
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

            choice = "cpu" if cpu_ops.load() else "torch"  # load() warns once if not
    return BACKENDS[choice](spec)
