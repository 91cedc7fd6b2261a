"""Every kernel compiles to a real cubin for Hopper and Ampere, with no GPU present."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.triton

KERNELS = [
    "reshape_and_cache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "copy_blocks",
    "lora_shrink",
    "lora_expand",
    "quantized_matmul_4bit",
    "quantized_matmul_8bit",
    "quantized_matmul_8bit_16",
    *(f"fused_experts_gate_up_{activation}" for activation in range(3)),
    "fused_experts_down",
    "causal_conv1d",
    "gated_delta_rule",
    "chunked_gated_delta_rule",
    "selective_scan",
    "chunked_selective_scan",
]


def test_every_kernel_compiles_for_sm90_and_sm80() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    result = subprocess.run(
        [sys.executable, "-m", "pagefleet.kernels.gpu_compile", "--targets", "90", "80"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for capability in (90, 80):
        for kernel in KERNELS:
            for dtype in ("fp32", "bf16", "fp16"):
                assert any(line.startswith(f"sm_{capability} {kernel} ") and f" {dtype}: " in line for line in lines), (
                    f"no sm_{capability} cubin for {kernel} {dtype}"
                )
    assert all("bytes of cubin" in line for line in lines)
