"""GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights read as stored: the blocks
dequantize to what the `gguf` package's own reader gives (also from the AVX2 kernel's packed
layout and the VNNI kernel's planes of 5- and 6-bit codes), the compiled matmul equals the
dequantize-then-matmul reference within the error its int8 activations allow, on random
blocks and on SmolLM2's tensors, and a row's output is bit for bit the same whatever other
rows share its call (batch invariance)."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from pagefleet.engine.layers.quantized import (
    BLOCK,
    GGML_BLOCKS,
    GGML_Q4_0,
    GGML_Q4_1,
    GGML_Q4_K,
    GGML_Q5_0,
    GGML_Q5_1,
    GGML_Q5_K,
    GGML_Q6_K,
    GGML_Q8_0,
    PackedWeight,
    QuantizedWeight,
    StackedWeight,
    for_this_device,
    quantized_linear,
    quantized_linear_torch,
)
from pagefleet.engine.loader.builtins import find_builtin_gguf
from pagefleet.engine.loader.gguf_weights import GGUFTensors
from pagefleet.kernels import cpu_ops

TYPES = {"Q4_0": GGML_Q4_0, "Q4_1": GGML_Q4_1, "Q5_0": GGML_Q5_0, "Q5_1": GGML_Q5_1, "Q8_0": GGML_Q8_0}
# Super-block formats: 256 weights, float16 scales rounded at load.
K_TYPES = {"Q4_K": GGML_Q4_K, "Q5_K": GGML_Q5_K, "Q6_K": GGML_Q6_K}
ALL_TYPES = TYPES | K_TYPES


@pytest.fixture(scope="module", autouse=True)
def operators() -> None:
    assert cpu_ops.has_quantized_linear(), "every machine here has AVX2: the quantized matmul must build"


def random_blocks(rows: int, in_features: int, ggml_type: int, generator: torch.Generator) -> np.ndarray:
    """GGUF bytes of a random [rows, in_features] weight: uint8 [rows, row bytes]. Every byte
    pattern is a valid block once its float16 scales (and mins) are sane numbers."""
    if ggml_type in K_TYPES.values():
        return random_k_blocks(rows, in_features, ggml_type, generator)
    num_blocks = in_features // BLOCK
    scales = (torch.rand(rows, num_blocks, 1, generator=generator) * 0.02 + 0.001).half()
    parts = [scales.view(torch.uint8)]
    if ggml_type in (GGML_Q4_1, GGML_Q5_1):
        parts.append((torch.randn(rows, num_blocks, 1, generator=generator) * 0.05).half().view(torch.uint8))
    quant_bytes = GGML_BLOCKS[ggml_type][1] - 2 * len(parts)
    parts.append(torch.randint(0, 256, (rows, num_blocks, quant_bytes), dtype=torch.uint8, generator=generator))
    return torch.cat(parts, dim=-1).reshape(rows, -1).numpy()


def random_k_blocks(rows: int, in_features: int, ggml_type: int, generator: torch.Generator) -> np.ndarray:
    """Q4_K/Q5_K: d, dmin (float16) then 6-bit scales and mins and the codes; Q6_K: codes,
    16 signed 8-bit scales, then d."""
    supers = in_features // 256
    block_bytes = GGML_BLOCKS[ggml_type][1]

    def half(low: float, high: float) -> torch.Tensor:
        return (torch.rand(rows, supers, 1, generator=generator) * (high - low) + low).half().view(torch.uint8)

    if ggml_type == GGML_Q6_K:
        rest = torch.randint(0, 256, (rows, supers, block_bytes - 2), dtype=torch.uint8, generator=generator)
        parts = [rest, half(1e-4, 1e-3)]
    else:
        rest = torch.randint(0, 256, (rows, supers, block_bytes - 4), dtype=torch.uint8, generator=generator)
        parts = [half(1e-4, 1e-3), half(0.0, 1e-3), rest]
    return torch.cat(parts, dim=-1).reshape(rows, -1).numpy()


def activation_error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The most int8 activations (per block of 32: scale max|x| / 127, rounded to nearest)
    can move each output: half a step per element, times |w|; plus float rounding."""
    rows, in_features = x.shape
    blocks = x.float().reshape(rows, -1, BLOCK)
    half_step = (blocks.abs().amax(-1, keepdim=True) / 127 / 2).expand_as(blocks).reshape(rows, in_features)
    magnitude = x.float().abs() @ weight.abs().T
    return half_step @ weight.abs().T + 1e-5 * magnitude + 1e-6


def int8_emulation(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The operator's arithmetic in float64: x rounded to its int8 blocks, times the weight."""
    rows = x.shape[0]
    blocks = x.float().reshape(rows, -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    rounded = (torch.round(blocks * inverse) * scale).reshape(rows, -1)
    return rounded.double() @ weight.double().T


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_dequantize_as_the_gguf_package_reads_them(type_name: str) -> None:
    ggml_type = TYPES[type_name]
    raw = random_blocks(48, 128, ggml_type, torch.Generator().manual_seed(1))
    ours = QuantizedWeight.from_blocks(torch.from_numpy(raw), ggml_type)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type))
    assert ours.shape == (48, 128)
    torch.testing.assert_close(ours.dequantize(), torch.from_numpy(expected), rtol=1e-6, atol=1e-7)
    rows = torch.tensor([5, 0, 47])
    assert torch.equal(ours.dequantize(rows), ours.dequantize()[rows])


@pytest.mark.parametrize("type_name", K_TYPES)
def test_super_blocks_dequantize_as_the_gguf_package_reads_them(type_name: str) -> None:
    """Each group's scale (d * sc) and min (dmin * m, or -32 d * sc for Q6_K) are kept in
    float16: rounding moves each by at most 2^-11 of itself, far below a 4-bit step."""
    ggml_type = K_TYPES[type_name]
    raw = random_blocks(24, 512, ggml_type, torch.Generator().manual_seed(2))
    ours = QuantizedWeight.from_blocks(torch.from_numpy(raw), ggml_type)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)))
    assert ours.shape == (24, 512)
    mins = ours.mins.float().repeat_interleave(ours.group, dim=1)
    bound = 2**-11 * ((expected - mins).abs() + mins.abs()) + 1e-7
    assert ((ours.dequantize() - expected).abs() <= bound).all()


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_the_packed_layout_dequantizes_to_the_same_weights(type_name: str) -> None:
    """The AVX2 kernel's layout (8 columns interleaved, 37 columns: a padded last group)
    holds exactly the weights, and an embedding lookup reads the same rows from it."""
    ggml_type = ALL_TYPES[type_name]
    in_features = 512 if type_name in K_TYPES else 288
    weight = QuantizedWeight.from_blocks(
        torch.from_numpy(random_blocks(37, in_features, ggml_type, torch.Generator().manual_seed(6))), ggml_type
    )
    packed = PackedWeight.pack(weight)
    assert packed.shape == weight.shape == (37, in_features)
    assert torch.equal(packed.dequantize(), weight.dequantize())
    rows = torch.tensor([36, 0, 9, 9])
    assert torch.equal(packed.dequantize(rows), weight.dequantize(rows))


PLANES_TYPES = {"Q5_0": GGML_Q5_0, "Q5_1": GGML_Q5_1, "Q5_K": GGML_Q5_K, "Q6_K": GGML_Q6_K}


@pytest.mark.parametrize("type_name", PLANES_TYPES)
def test_the_planes_layout_holds_the_same_weights_in_fewer_bytes(type_name: str) -> None:
    """VNNI's layout of 5- and 6-bit codes (nibbles, then planes of their high bits; Q6_K's
    mins derived) holds exactly the weights, an embedding lookup reads the same rows, and on
    a VNNI CPU its matmul gives the bits of the byte-a-code layout, whatever the rows."""
    ggml_type = PLANES_TYPES[type_name]
    in_features = 512 if type_name in K_TYPES else 256
    weight = QuantizedWeight.from_blocks(
        torch.from_numpy(random_blocks(37, in_features, ggml_type, torch.Generator().manual_seed(9))), ggml_type
    )
    planes = weight.with_planes()
    assert planes.shape == weight.shape and planes.planes and not weight.planes
    assert planes.quants.shape[1] == in_features // 2 + in_features * (2 if ggml_type == GGML_Q6_K else 1) // 8
    assert planes.nbytes / weight.nbytes == (0.7 if ggml_type == GGML_Q6_K else 2 / 3)
    assert torch.equal(planes.dequantize(), weight.dequantize())
    rows = torch.tensor([36, 0, 9, 9])
    assert torch.equal(planes.dequantize(rows), weight.dequantize(rows))
    assert torch.equal(QuantizedWeight.cat([planes, planes]).dequantize(), weight.dequantize().repeat(2, 1))
    if cpu_ops.quantized_packed_layout():
        return  # an AVX2 CPU never serves this layout
    x = torch.randn(70, in_features, generator=torch.Generator().manual_seed(10))
    for count in (1, 5, 70):
        assert torch.equal(planes.matmul(x[:count]), quantized_linear(x[:count], weight)), f"{count} rows"


def test_an_odd_number_of_blocks_keeps_a_byte_a_code() -> None:
    """The planes hold whole block pairs: a Q5_0 row of 9 blocks stays a byte a code."""
    weight = QuantizedWeight.from_blocks(
        torch.from_numpy(random_blocks(8, 288, GGML_Q5_0, torch.Generator().manual_seed(11))), GGML_Q5_0
    )
    assert not weight.takes_planes
    served = for_this_device(weight)
    assert not isinstance(served, QuantizedWeight) or not served.planes


def int8_matmul(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The compiled int8 kernel this CPU runs, on the layout it serves the weight in (AVX2's
    packed columns, VNNI's planes of 5- and 6-bit codes)."""
    served = for_this_device(weight)
    assert not isinstance(served, StackedWeight)
    return served.matmul(x)


OTHER_ROWS = [1, 7, 23, 24, 64, 300]


@pytest.mark.parametrize("type_name", ALL_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_output_does_not_depend_on_the_other_rows(type_name: str, dtype: torch.dtype) -> None:
    """Batch invariance: the same rows computed alone, then among 1, 7, 23, 24, 64 and 300
    others (tiles of 4 rows and blocks of 64 fall differently each time), give the same bits."""
    ggml_type = ALL_TYPES[type_name]
    generator = torch.Generator().manual_seed(8)
    in_features = 512 if type_name in K_TYPES else 288
    weight = QuantizedWeight.from_blocks(
        torch.from_numpy(random_blocks(45, in_features, ggml_type, generator)), ggml_type
    )
    served = for_this_device(weight)
    assert not isinstance(served, StackedWeight)
    rows = torch.randn(3, in_features, generator=generator).to(dtype)
    alone = torch.cat([served.matmul(rows[i : i + 1]) for i in range(3)])
    assert torch.equal(served.matmul(rows), alone)
    for others in OTHER_ROWS:
        batch = torch.randn(others + 3, in_features, generator=generator).to(dtype)
        at = torch.randperm(others + 3, generator=generator)[:3]
        batch[at] = rows
        assert torch.equal(served.matmul(batch)[at], alone), f"among {others} other rows"


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 5, 70])  # tiles of 4 rows, blocks of 64
def test_int8_matmul_equals_its_reference_within_the_int8_activation_error(
    type_name: str, dtype: torch.dtype, rows: int
) -> None:
    ggml_type = ALL_TYPES[type_name]
    generator = torch.Generator().manual_seed(rows)
    # 288 = 9 blocks: four pairs and an odd last block (a super-block format: 512, two);
    # 101 columns: an odd last column.
    in_features = 512 if type_name in K_TYPES else 288
    raw = random_blocks(101, in_features, ggml_type, generator)
    weight = QuantizedWeight.from_blocks(torch.from_numpy(raw), ggml_type)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    x[0, :BLOCK] = 0  # an all-zero block (scale 0)
    y = int8_matmul(x, weight)
    assert y.dtype == dtype and y.shape == (rows, 101)
    dense = weight.dequantize()
    # Exactly the int8 arithmetic, up to float32 summation order (and bf16's output rounding).
    output_rounding = 0 if dtype == torch.float32 else 2**-8
    emulated = int8_emulation(x, dense)
    summation_order = 1e-5 * (x.float().abs() @ dense.abs().T).double() + 1e-6
    assert torch.all((y.double() - emulated).abs() <= summation_order + output_rounding * emulated.abs())
    # And the float reference, within what int8 activations allow.
    reference = quantized_linear_torch(x.float(), weight)
    bound = activation_error_bound(x, dense) + output_rounding * reference.abs()
    assert torch.all((y.float() - reference).abs() <= bound)


@pytest.fixture(scope="module")
def smollm2_tensors() -> GGUFTensors:
    return GGUFTensors(find_builtin_gguf("smollm2-135m-instruct"))


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.3.ffn_down.weight", "blk.0.attn_q.weight"])
def test_matmul_on_smollm2s_own_tensors(smollm2_tensors: GGUFTensors, name: str) -> None:
    weight = smollm2_tensors.quantized(name)
    assert weight is not None
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
    dense = weight.dequantize()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the head's 28 MiB are split over threads
    try:
        y = int8_matmul(x, weight)
    finally:
        torch.set_num_threads(threads)
    reference = quantized_linear_torch(x, weight)
    assert torch.all((y - reference).abs() <= activation_error_bound(x, dense))


def test_the_avx2_path_gives_the_same_results_as_vnni(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """CPUs without AVX-512 VNNI multiply with AVX2's vpmaddubsw on the packed layout:
    forced here in a process of its own, it gives the same integer sums (its floats summed
    in another order; on an AVX2 machine both sides are that kernel)."""
    generator = torch.Generator().manual_seed(7)
    weights = {name: random_blocks(64, 256, ggml_type, generator) for name, ggml_type in ALL_TYPES.items()}
    x = torch.randn(5, 256, generator=generator)
    torch.save({"weights": weights, "x": x}, tmp_path / "inputs.pt")
    script = f"""
import torch
from pagefleet.engine.layers.quantized import QuantizedWeight
from pagefleet.kernels import cpu_ops
cpu_ops.load()
inputs = torch.load({str(tmp_path / "inputs.pt")!r}, weights_only=False)
types = {ALL_TYPES!r}
from pagefleet.engine.layers.quantized import quantized_linear as int8_matmul
out = {{n: int8_matmul(inputs["x"], QuantizedWeight.from_blocks(torch.from_numpy(w), types[n]))
       for n, w in inputs["weights"].items()}}
torch.save(out, {str(tmp_path / "avx2.pt")!r})
"""
    env = dict(os.environ, PAGEFLEET_CPU_NO_VNNI="1")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    avx2 = torch.load(tmp_path / "avx2.pt")
    for name, raw in weights.items():
        weight = QuantizedWeight.from_blocks(torch.from_numpy(raw), ALL_TYPES[name])
        summation_order = 1e-5 * (x.abs() @ weight.dequantize().abs().T) + 1e-6
        assert torch.all((avx2[name] - int8_matmul(x, weight)).abs() <= summation_order)


@pytest.mark.triton
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_triton_kernel_equals_the_reference(type_name: str, dtype: torch.dtype) -> None:
    """The CUDA kernel (run by Triton's interpreter here) dequantizes in registers and
    multiplies in float32: the reference's arithmetic, up to summation order and the
    output's rounding. Rows and columns that fill no tile exercise the masks."""
    from pagefleet.kernels.quantized_matmul import quantized_matmul

    generator = torch.Generator().manual_seed(5)
    in_features = 256 if type_name in K_TYPES else 96
    weight = QuantizedWeight.from_blocks(
        torch.from_numpy(random_blocks(70, in_features, ALL_TYPES[type_name], generator)), ALL_TYPES[type_name]
    )
    x = torch.randn(19, in_features, generator=generator).to(dtype)
    y = quantized_matmul(x, weight.quants, weight.scales, weight.mins, four_bit=weight.format == 0)
    expected = quantized_linear_torch(x.float(), weight)
    summation_order = 1e-5 * (x.float().abs() @ weight.dequantize().abs().T) + 1e-6
    output_rounding = 0 if dtype == torch.float32 else 2**-7  # a bfloat16 ulp (the interpreter truncates)
    bound = summation_order + output_rounding * expected.abs()
    assert torch.all((y.float() - expected).abs() <= bound)
    # One tile shape whatever the row count: the first rows alone give the same bits.
    alone = quantized_matmul(x[:3].contiguous(), weight.quants, weight.scales, weight.mins, weight.format == 0)
    assert torch.equal(alone, y[:3])


@pytest.mark.triton
def test_the_triton_kernel_on_smollm2s_head(smollm2_tensors: GGUFTensors) -> None:
    from pagefleet.kernels.quantized_matmul import quantized_matmul

    weight = smollm2_tensors.quantized("blk.3.ffn_down.weight")
    assert weight is not None
    x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(6))
    y = quantized_matmul(x, weight.quants, weight.scales, weight.mins, four_bit=weight.format == 0)
    torch.testing.assert_close(y, quantized_linear_torch(x, weight), rtol=1e-5, atol=1e-4)
