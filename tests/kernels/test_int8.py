"""int8 W8A8: the compiled layer (tokens quantized, an int8 GEMM, one rescale) equals its
plain-torch reference exactly, since integer sums have no rounding, with oneDNN's GEMM and
with the AVX2 kernel over the packed layout alike; and the reference stays within the error
that int8 activations allow of the float product."""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine.layers.int8 import Int8Weight, PackedInt8Weight, int8_linear_torch, quantize_tokens
from pagefleet.engine.loader.int8_convert import quantize_channels
from pagefleet.kernels import cpu_ops


@pytest.fixture(scope="module", autouse=True)
def operators() -> None:
    assert cpu_ops.load(), "the compiled operators must build here"


def random_weight(out_features: int, in_features: int, static: bool, seed: int) -> Int8Weight:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    scales = torch.rand(out_features, generator=generator) * 1e-3 + 1e-5
    return Int8Weight(weight, scales, torch.tensor(0.03) if static else None)


@pytest.mark.parametrize("packed", [False, True], ids=["onednn", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 40, 64), (3, 93, 100), (70, 576, 1536)])
def test_the_operator_equals_the_reference_exactly(
    rows: int, out_features: int, in_features: int, static: bool, dtype: torch.dtype, packed: bool
) -> None:
    """Weights of -128 included; a static scale saturates codes at -128 and 127."""
    weight = random_weight(out_features, in_features, static, seed=rows)
    x = (torch.randn(rows, in_features, generator=torch.Generator().manual_seed(7)) * 3).to(dtype)
    x[0, :5] = 0  # zeros, and (below) a row of zeros, which gets scale 1
    if rows > 2:
        x[1] = 0
    y = (PackedInt8Weight.pack(weight) if packed else weight).matmul(x)
    assert y.dtype == dtype and y.shape == (rows, out_features)
    assert torch.equal(y, int8_linear_torch(x, weight))


def test_int8_tokens_keep_products_within_half_a_step_per_element() -> None:
    """Against float32 x @ W.T with W dequantized, the only error is each token's rounding
    to int8: at most half a step (max |x| / 127 / 2) per element, times |w|."""
    generator = torch.Generator().manual_seed(3)
    float_weight = torch.randn(256, 512, generator=generator) * 0.05
    quants, scales = quantize_channels(float_weight)
    weight = Int8Weight(quants, scales.reshape(-1))
    x = torch.randn(9, 512, generator=generator)
    exact = x @ weight.dequantize().T
    half_step = x.abs().amax(dim=1, keepdim=True) / 127 / 2
    bound = half_step * weight.dequantize().abs().sum(dim=1) + 1e-5 * (x.abs() @ weight.dequantize().abs().T)
    assert ((weight.matmul(x) - exact).abs() <= bound).all()


def test_channel_quantization_round_trips_within_half_a_step() -> None:
    weight = torch.randn(64, 96) * torch.linspace(0.01, 2, 64).unsqueeze(1)
    quants, scales = quantize_channels(weight)
    assert quants.dtype == torch.int8 and scales.shape == (64, 1)
    assert (quants.abs().amax(dim=1) == 127).all()  # every row uses its whole range
    assert ((quants.float() * scales - weight).abs() <= scales / 2 * (1 + 1e-6)).all()


def test_static_input_scale_saturates_outliers_as_vllm_does() -> None:
    quants, scales = quantize_tokens(torch.tensor([[0.3, -10.0, 0.03]]), torch.tensor(0.01))
    assert quants.tolist() == [[30, -128, 3]] and scales.item() == pytest.approx(0.01)


def test_fused_layers_stack_rows_and_take_the_largest_static_scale() -> None:
    a, b = random_weight(8, 32, True, 1), random_weight(4, 32, False, 2)
    b = Int8Weight(b.weight, b.scales, torch.tensor(0.05))
    fused = Int8Weight.cat([a, b])
    assert fused.shape == (12, 32) and fused.input_scale is not None and fused.input_scale.item() == pytest.approx(0.05)
    assert torch.equal(fused.weight[8:], b.weight)
    with pytest.raises(ValueError, match="static and dynamic"):
        Int8Weight.cat([a, random_weight(4, 32, False, 3)])


def test_the_packed_layout_unpacks_to_the_same_weight() -> None:
    weight = random_weight(93, 100, False, seed=4)
    packed = PackedInt8Weight.pack(weight)
    assert packed.shape == weight.shape and torch.equal(packed.unpacked().weight, weight.weight)


def test_a_rows_output_does_not_depend_on_the_other_rows() -> None:
    """Batch invariance on the packed kernel: tiles of 4 rows and blocks of 64 fall
    differently among 1, 7, 64 and 300 other rows."""
    weight = PackedInt8Weight.pack(random_weight(96, 576, False, seed=5))
    generator = torch.Generator().manual_seed(6)
    rows = torch.randn(3, 576, generator=generator)
    alone = torch.cat([weight.matmul(rows[i : i + 1]) for i in range(3)])
    for others in (1, 7, 64, 300):
        batch = torch.randn(others + 3, 576, generator=generator)
        at = torch.randperm(others + 3, generator=generator)[:3]
        batch[at] = rows
        assert torch.equal(weight.matmul(batch)[at], alone), f"among {others} other rows"
