"""The quantized-experts operator (`torch.ops.pagefleet.quantized_experts`, experts served
from GGUF blocks in one call) against its reference, the loop of `quantized_linear` calls
(`QuantizedRoutedExperts.forward_loop`), and against the float32 experts the blocks
dequantize to.

For each block format the engine serves experts in (4-, 5-, 6- and 8-bit, with and without
mins), float32 and bfloat16: equal to the loop up to an activation's last bit (torch's SiLU
and the operator's may differ by an ulp, which can move an int8 rounding of the down
projection's input); with experts that receive no token, more than one item's 64 rows for
one expert, and top-1. Bit for bit, a token's output is the same alone and among others,
and a token whose experts are all on other ranks (-1) gets zeros.
"""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine.layers.quantized import (
    GGML_Q4_0,
    GGML_Q4_1,
    GGML_Q4_K,
    GGML_Q5_K,
    GGML_Q6_K,
    GGML_Q8_0,
    QuantizedWeight,
)
from pagefleet.engine.layers.quantized_experts import QuantizedRoutedExperts, expert_rows, gate_up_weight, kernel_kind
from pagefleet.kernels import cpu_ops
from tests.kernels.test_quantized import random_blocks

HIDDEN, WIDTH, NUM_EXPERTS = 256, 256, 6  # the K formats' super-blocks are 256 wide
FORMATS = {  # (gate/up, down): every kind of the packed layout and of GGML's order
    "Q4_K+Q6_K": (GGML_Q4_K, GGML_Q6_K),
    "Q5_K+Q8_0": (GGML_Q5_K, GGML_Q8_0),
    "Q4_0+Q4_1": (GGML_Q4_0, GGML_Q4_1),
}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture(scope="module")
def operators() -> None:
    assert cpu_ops.load() and cpu_ops.has_quantized_linear(), "the AVX2 build must carry the quantized operators"


def _experts(gate_up_type: int, down_type: int, seed: int = 0) -> QuantizedRoutedExperts:
    generator = torch.Generator().manual_seed(seed)

    def stacked(rows: int, in_features: int, ggml_type: int) -> QuantizedWeight:
        blocks = torch.from_numpy(random_blocks(NUM_EXPERTS * rows, in_features, ggml_type, generator))
        return QuantizedWeight.from_blocks(blocks, ggml_type)

    gate, up = stacked(WIDTH, HIDDEN, gate_up_type), stacked(WIDTH, HIDDEN, gate_up_type)
    down = stacked(HIDDEN, WIDTH, down_type)
    return QuantizedRoutedExperts(
        [gate_up_weight(expert_rows(gate, e, WIDTH), expert_rows(up, e, WIDTH)) for e in range(NUM_EXPERTS)],
        [expert_rows(down, e, HIDDEN) for e in range(NUM_EXPERTS)],
    )


def _routes(num_tokens: int, top_k: int, unused: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """(hidden [T, HIDDEN], weights, experts): the last `unused` experts never chosen."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=generator)
    logits[:, NUM_EXPERTS - unused :] = float("-inf")
    weights, experts = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return torch.randn(num_tokens, HIDDEN, generator=generator), weights, experts


@DTYPES
@pytest.mark.parametrize("formats", list(FORMATS), ids=list(FORMATS))
@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (9, 3), (150, 2), (5, 1)])
def test_the_operator_equals_the_loop_of_quantized_matmuls(
    operators: None, dtype: torch.dtype, formats: str, num_tokens: int, top_k: int
) -> None:
    layer = _experts(*FORMATS[formats])
    assert layer.stacked[0] is not None, "one type per projection: the experts are held stacked"
    hidden, weights, experts = _routes(num_tokens, top_k, unused=1)
    hidden = hidden.to(dtype)
    expected = layer.forward_loop(hidden, weights, experts)
    got = layer(hidden, weights, experts)
    assert got.dtype == dtype and got.shape == expected.shape
    scale = expected.float().abs().max().item()
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # a bfloat16 step is 2^-8
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance * scale, rtol=0)
    # against the float experts the blocks dequantize to: int8 activations are within a percent or so
    dense = _dense_reference(layer, hidden.float(), weights, experts)
    torch.testing.assert_close(got.float(), dense, atol=0.05 * dense.abs().max().item(), rtol=0)


def _dense_reference(
    layer: QuantizedRoutedExperts, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    gate_up = [_dequantized(w) for w in layer.gate_up]
    down = [_dequantized(w) for w in layer.down]
    out = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for slot, expert in enumerate(experts[token].tolist()):
            gate, up = (hidden[token] @ gate_up[expert].T).chunk(2)
            out[token] += weights[token, slot] * (down[expert] @ (torch.nn.functional.silu(gate) * up))
    return out


def _dequantized(weight) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return weight.dequantize().float()


@DTYPES
def test_a_tokens_output_is_the_same_alone_and_among_others(operators: None, dtype: torch.dtype) -> None:
    layer = _experts(GGML_Q4_K, GGML_Q6_K)
    hidden, weights, experts = _routes(99, 3, unused=0)
    hidden = hidden.to(dtype)
    together = layer(hidden, weights, experts)
    for token in (0, 50, 98):
        alone = layer(hidden[token : token + 1], weights[token : token + 1], experts[token : token + 1])
        assert torch.equal(alone[0], together[token]), f"token {token} changed with the batch"


def test_experts_on_other_ranks_add_nothing(operators: None) -> None:
    layer = _experts(GGML_Q4_K, GGML_Q6_K)
    hidden, weights, experts = _routes(4, 2, unused=0)
    elsewhere = experts.clone()
    elsewhere[0] = -1  # every slot of token 0 on another rank
    elsewhere[1, 1] = -1
    got = layer(hidden, weights, elsewhere)
    assert torch.equal(got[0], torch.zeros(HIDDEN))
    only_first = layer(hidden[1:2], weights[1:2, :1], experts[1:2, :1])
    assert torch.equal(got[1], only_first[0])


def test_bad_arguments_are_refused_by_name(operators: None) -> None:
    layer = _experts(GGML_Q4_K, GGML_Q6_K)
    gate_up, down = layer.stacked
    assert gate_up is not None and down is not None
    hidden, weights, experts = _routes(2, 2, unused=0)
    arguments = [hidden, weights, experts, gate_up.quants, gate_up.scales, gate_up.mins, kernel_kind(gate_up)]
    arguments += [down.quants, down.scales, down.mins, kernel_kind(down), NUM_EXPERTS, WIDTH, 0, 1.702, 7.0]
    torch.ops.pagefleet.quantized_experts(*arguments)  # as given: accepted
    with pytest.raises(RuntimeError, match="gate_up"):
        torch.ops.pagefleet.quantized_experts(*arguments[:11], NUM_EXPERTS + 1, *arguments[12:])
    with pytest.raises(RuntimeError, match="experts: 9 is not below 6"):
        torch.ops.pagefleet.quantized_experts(*arguments[:2], torch.full_like(experts, 9), *arguments[3:])
