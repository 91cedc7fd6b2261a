"""Compile every kernel for real GPUs on a machine without one.

    python -m pagefleet.kernels.gpu_compile [--targets 90 80]

triton's wheel carries its own PTX assembler, so `triton.compile` builds real cubins for
Hopper (sm_90) and Ampere (sm_80) on a CPU. This catches what the interpreter lets through
(constructs the GPU compiler rejects, type errors in unexercised branches). Must run
without TRITON_INTERPRET, which replaces the kernels by interpreted functions.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from typing import Any

_TYPED_POINTERS = {  # pointers whose type is not the activations'
    "quants_ptr": "*u8",
    "scales_ptr": "*fp16",
    "mins_ptr": "*fp16",
    "block_tables_ptr": "*i32",
    "context_lens_ptr": "*i32",
    "cu_seqlens_ptr": "*i32",
    "slot_mapping_ptr": "*i64",
    "block_mapping_ptr": "*i64",
    "slots_ptr": "*i64",
    "sinks_ptr": "*fp32",
    "sorted_pairs_ptr": "*i64",
    "block_experts_ptr": "*i64",
    "weights_ptr": "*fp32",
    # The state layers' (engine/worker/state_cache.py's StateMetadata and their float32 parts).
    "query_start_ptr": "*i64",
    "start_positions_ptr": "*i64",
    "chunk_limits_ptr": "*i64",
    "has_state_ptr": "*i1",
    "state_ptr": "*fp32",
    "g_ptr": "*fp32",
    "A_ptr": "*fp32",
}
_FLOAT_SCALARS = ("scale", "softcap", "alpha", "limit", "query_scale", "eps", "dt_low", "dt_high", "threshold")
_DTYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _kernels() -> list[tuple[str, Any, dict[str, int]]]:
    """(name, @triton.jit function, constexpr values) for every kernel."""
    from pagefleet.kernels.causal_conv1d import _causal_conv1d_kernel
    from pagefleet.kernels.chunked_gated_delta_rule import _chunked_gated_delta_rule_kernel
    from pagefleet.kernels.chunked_selective_scan import _chunked_selective_scan_kernel
    from pagefleet.kernels.copy_blocks import _copy_blocks_kernel
    from pagefleet.kernels.fused_experts import _down_kernel, _gate_up_kernel
    from pagefleet.kernels.gated_delta_rule import _gated_delta_rule_kernel
    from pagefleet.kernels.lora import _lora_expand_kernel, _lora_shrink_kernel
    from pagefleet.kernels.paged_attention_decode import DEFAULT_TILE_N, _paged_attention_decode_kernel
    from pagefleet.kernels.paged_attention_prefill import DEFAULT_BLOCK_M, _paged_attention_prefill_kernel
    from pagefleet.kernels.quantized_matmul import _quantized_matmul_kernel
    from pagefleet.kernels.reshape_and_cache import _reshape_and_cache_kernel
    from pagefleet.kernels.selective_scan import _selective_scan_kernel

    return [
        ("reshape_and_cache", _reshape_and_cache_kernel, {"BLOCK_D": 128}),
        (
            "paged_attention_decode",
            _paged_attention_decode_kernel,
            {"BLOCK_D": 128, "TILE_N": DEFAULT_TILE_N, "HAS_SINKS": True},
        ),
        (
            "paged_attention_prefill",
            _paged_attention_prefill_kernel,
            {"BLOCK_M": DEFAULT_BLOCK_M, "BLOCK_D": 128, "TILE_N": DEFAULT_TILE_N, "HAS_SINKS": True},
        ),
        ("copy_blocks", _copy_blocks_kernel, {"BLOCK_S": 16, "BLOCK_D": 128}),
        ("lora_shrink", _lora_shrink_kernel, {"BLOCK_R": 64, "BLOCK_K": 128}),
        ("lora_expand", _lora_expand_kernel, {"BLOCK_R": 64, "BLOCK_O": 128}),
        (
            "quantized_matmul_4bit",
            _quantized_matmul_kernel,
            {"FOUR_BIT": True, "GROUPS_PER_BLOCK": 1, "BLOCK_M": 16, "BLOCK_N": 64},
        ),
        (
            "quantized_matmul_8bit",
            _quantized_matmul_kernel,
            {"FOUR_BIT": False, "GROUPS_PER_BLOCK": 1, "BLOCK_M": 32, "BLOCK_N": 64},
        ),
        (
            "quantized_matmul_8bit_16",
            _quantized_matmul_kernel,
            {"FOUR_BIT": False, "GROUPS_PER_BLOCK": 2, "BLOCK_M": 16, "BLOCK_N": 64},
        ),
        *(
            (
                f"fused_experts_gate_up_{activation}",
                _gate_up_kernel,
                {"HAS_BIAS": activation == 2, "ACTIVATION": activation, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64},
            )
            for activation in range(3)
        ),
        ("fused_experts_down", _down_kernel, {"HAS_BIAS": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}),
        # The state layers at the engine's settings: Qwen3.5's 128-wide keys and values, Granite
        # 4's heads of 64 and states of 128, a chunk of one 16-token block (the Triton path's).
        (
            "causal_conv1d",
            _causal_conv1d_kernel,
            {"K": 4, "HAS_BIAS": True, "SILU": True, "BLOCK_C": 64, "BLOCK_K": 4},
        ),
        ("gated_delta_rule", _gated_delta_rule_kernel, {"L2NORM": True, "BLOCK_K": 128, "BLOCK_V": 64}),
        (
            "chunked_gated_delta_rule",
            _chunked_gated_delta_rule_kernel,
            {"L2NORM": True, "HAS_LIMITS": True, "CHUNK": 16, "BLOCK_C": 16, "BLOCK_K": 128, "BLOCK_V": 64},
        ),
        (
            "selective_scan",
            _selective_scan_kernel,
            {"ROUND": True, "SKIP_IN_X_DTYPE": True, "BLOCK_P": 16, "BLOCK_N": 128},
        ),
        (
            "chunked_selective_scan",
            _chunked_selective_scan_kernel,
            {
                "ROUND": True,
                "SKIP_IN_X": True,
                "HAS_LIMITS": True,
                "CHUNK": 16,
                "BLOCK_C": 16,
                "BLOCK_P": 16,
                "BLOCK_N": 128,
            },
        ),
    ]


def _signature(fn: Any, dtype: str) -> dict[str, str]:
    signature = {}
    for name in inspect.signature(fn.fn).parameters:
        if name.isupper():
            signature[name] = "constexpr"
        elif name in _TYPED_POINTERS:
            signature[name] = _TYPED_POINTERS[name]
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        elif name in _FLOAT_SCALARS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return signature


def compile_all(capabilities: list[int], dtypes: list[str], names: list[str] | None = None) -> list[str]:
    """Compile every kernel (or those named) for every target and dtype; one line per cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    lines = []
    for capability in capabilities:
        target = GPUTarget("cuda", capability, 32)
        for name, fn, constexprs in _kernels():
            if names is not None and name not in names:
                continue
            for dtype in dtypes:
                started = time.perf_counter()
                source = ASTSource(fn=fn, signature=_signature(fn, _DTYPES[dtype]), constexprs=constexprs)
                compiled = triton.compile(source, target=target)
                cubin = compiled.asm["cubin"]
                lines.append(
                    f"sm_{capability} {name:24s} {dtype}: {len(cubin)} bytes of cubin "
                    f"in {time.perf_counter() - started:.1f}s"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", type=int, default=[90, 80], help="CUDA compute capabilities")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=sorted(_DTYPES))
    parser.add_argument("--kernels", nargs="+", help="only these kernels (by the names printed)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("gpu_compile: unset TRITON_INTERPRET; interpreted kernels cannot be compiled")
    for line in compile_all(args.targets, args.dtypes, args.kernels):
        print(line, flush=True)


if __name__ == "__main__":
    main()
