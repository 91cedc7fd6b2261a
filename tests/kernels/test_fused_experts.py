"""The fused-experts operators against the plain-torch loop over experts.

The compiled CPU operator (`torch.ops.pagefleet.fused_experts`) and the Triton kernels
(interpreted) equal `fused_experts_torch` for float32 and bfloat16, every activation, with
and without biases, with experts that receive no token, one token, and top-1. The CPU
operator's contract is checked bit for bit: a token's output is the same alone and among 99
others, and its contributions are added in ascending expert order whatever the slot order.
Sizes are not multiples of the 16-lane vectors, so every tail runs. Expert ids of -1 (held
by another tensor-parallel rank) are skipped by all three: the sum is the one whose skipped
pairs weigh 0, and a token with every slot elsewhere gets zeros.
"""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine.layers.experts import ExpertActivation, RoutedExperts
from pagefleet.kernels import cpu_ops
from pagefleet.kernels.checks import KernelArgumentError
from pagefleet.kernels.fused_experts import ACTIVATIONS, fused_experts, fused_experts_torch, moe_align

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
HIDDEN = 40  # every module here; 2 x 16 lanes + 8
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture(scope="module")
def operators() -> None:
    assert cpu_ops.load(), "g++ and ninja are on every machine here: the operators must build"


def _experts(
    num_experts: int, hidden: int, width: int, kind: str, bias: bool, dtype: torch.dtype, seed: int = 0
) -> RoutedExperts:
    generator = torch.Generator().manual_seed(seed)
    module = RoutedExperts(num_experts, hidden, width, ExpertActivation(kind), bias)
    for parameter in module.parameters():
        # std 0.3: gates reach gpt-oss's clamp at 7 now and then
        parameter.data = (torch.randn(parameter.shape, generator=generator) * 0.3).to(dtype)
    return module


def _routes(
    num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, unused: int = 0, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [T, HIDDEN], weights, experts): random routes, the last `unused` experts never chosen, each
    token's experts in the router's order (by weight, not by id)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    logits[:, num_experts - unused :] = float("-inf")
    weights, experts = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    hidden = torch.randn(num_tokens, HIDDEN, generator=generator)
    return hidden, weights, experts


def _compiled(module: RoutedExperts, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor):  # type: ignore[no-untyped-def]
    activation = module.activation
    return torch.ops.pagefleet.fused_experts(
        hidden,
        weights.float().contiguous(),
        experts.contiguous(),
        module.gate_up,
        module.down,
        module.gate_up_bias,
        module.down_bias,
        ACTIVATIONS.index(activation.kind),
        activation.alpha,
        activation.limit,
    )


@DTYPES
@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_cpu_operator_equals_the_reference(operators: None, dtype: torch.dtype, kind: str, bias: bool) -> None:
    module = _experts(7, 40, 24, kind, bias, dtype)
    hidden, weights, experts = _routes(13, 7, 3, dtype, unused=2)
    hidden, weights = hidden.to(dtype), weights.to(dtype)
    expected = module.forward_torch(hidden, weights, experts)
    torch.testing.assert_close(_compiled(module, hidden, weights, experts), expected, **TOLERANCE[dtype])
    torch.testing.assert_close(module(hidden, weights, experts), expected, **TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 1), (1, 4), (5, 1), (150, 2)])
def test_cpu_operator_on_few_tokens_and_top_1(operators: None, dtype: torch.dtype, num_tokens: int, top_k: int) -> None:
    """Wider shapes (vectors with tails: 40 = 2 x 16 + 8, width 56 = 3 x 16 + 8); 150 tokens
    on 3 experts fill several 64-row items of one expert; float32 routing weights, as
    Mixtral and Gemma 4 keep them."""
    module = _experts(5, 40, 56, "silu", False, dtype)
    hidden, weights, experts = _routes(num_tokens, 5, top_k, dtype, unused=2 if top_k < 3 else 0)
    hidden = hidden.to(dtype)
    expected = module.forward_torch(hidden, weights, experts)
    torch.testing.assert_close(module(hidden, weights, experts), expected, **TOLERANCE[dtype])


def test_no_token_gives_an_empty_output(operators: None) -> None:
    module = _experts(4, 40, 24, "silu", True, torch.float32)
    out = module(torch.zeros(0, 40), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64))
    assert out.shape == (0, 40)


@DTYPES
def test_a_token_has_the_same_bits_alone_and_in_a_batch(operators: None, dtype: torch.dtype) -> None:
    """100 tokens on 3 experts: groups of 50-80 rows, cut into items and tiles of every size,
    against each token run alone (a group of one row), and the batch in another order."""
    module = _experts(3, 40, 24, "swiglu_oai", True, dtype)
    hidden, weights, experts = _routes(100, 3, 2, dtype)
    hidden = hidden.to(dtype)
    batch = _compiled(module, hidden, weights, experts)
    for token in range(100):
        alone = _compiled(module, hidden[token : token + 1], weights[token : token + 1], experts[token : token + 1])
        assert torch.equal(alone[0], batch[token]), f"token {token} changed with the batch"
    reordered = torch.randperm(100, generator=torch.Generator().manual_seed(2))
    shuffled = _compiled(module, hidden[reordered], weights[reordered], experts[reordered])
    assert torch.equal(shuffled, batch[reordered])


@pytest.mark.parametrize("kind", ["silu", "swiglu_oai"])
def test_whole_tile_bfloat16_experts_equal_the_reference_and_keep_a_tokens_bits(operators: None, kind: str) -> None:
    """bfloat16 experts whose sizes fill whole tiles (hidden 64, width 32: on AMX CPUs the
    `tdpbf16ps` kernel, elsewhere the AVX-512 one): within the reference's rounding, and a
    token's bits the same alone, in a batch of 70 (items of 1 to 33 rows: 1 and 2 blocks of
    16 tokens, a partial block) and in another order."""
    generator = torch.Generator().manual_seed(3)
    module = RoutedExperts(4, 64, 32, ExpertActivation(kind), bias=kind == "swiglu_oai")
    for parameter in module.parameters():
        parameter.data = (torch.randn(parameter.shape, generator=generator) * 0.3).bfloat16()
    logits = torch.randn(70, 4, generator=generator)
    weights, experts = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1)
    hidden = torch.randn(70, 64, generator=generator).bfloat16()
    batch = _compiled(module, hidden, weights, experts)
    torch.testing.assert_close(batch, module.forward_torch(hidden, weights, experts), **TOLERANCE[torch.bfloat16])
    for token in (0, 31, 69):
        alone = _compiled(module, hidden[token : token + 1], weights[token : token + 1], experts[token : token + 1])
        assert torch.equal(alone[0], batch[token]), f"token {token} changed with the batch"
    reordered = torch.randperm(70, generator=torch.Generator().manual_seed(4))
    assert torch.equal(_compiled(module, hidden[reordered], weights[reordered], experts[reordered]), batch[reordered])


@pytest.mark.parametrize("kind", ["silu", "swiglu_oai"])
def test_experts_packed_for_the_tiles_keep_every_bit(operators: None, kind: str) -> None:
    """On AMX CPUs, bfloat16 experts of a whole-tile shape are served packed (kernels/
    amx_tiles.py): the packed operator gives the unpacked one's bits, token by token
    alone and in a batch of 70, and the reference still reads the weights as loaded."""
    module = _experts(4, 64, 32, kind, kind == "swiglu_oai", torch.bfloat16, seed=5)
    if not torch.ops.pagefleet.amx_tiles_fit(64, 64):
        pytest.skip("no AMX tiles on this CPU: experts stay unpacked")
    generator = torch.Generator().manual_seed(6)
    weights, experts = torch.topk(torch.softmax(torch.randn(70, 4, generator=generator), dim=-1), 2, dim=-1)
    hidden = torch.randn(70, 64, generator=generator).bfloat16()
    unpacked, reference = _compiled(module, hidden, weights, experts), module.forward_torch(hidden, weights, experts)
    loaded = module.gate_up.clone()
    module.pack()
    assert module.packed and not torch.equal(module.gate_up, loaded)
    assert torch.equal(module(hidden, weights, experts), unpacked)
    assert torch.equal(module.forward_torch(hidden, weights, experts), reference)
    for token in (0, 16, 69):
        alone = module(hidden[token : token + 1], weights[token : token + 1], experts[token : token + 1])
        assert torch.equal(alone[0], unpacked[token]), f"token {token} changed with the batch"


def test_experts_the_tiles_do_not_take_stay_as_loaded(operators: None) -> None:
    """float32 experts, and bfloat16 ones whose sizes are not whole tiles, are never packed."""
    for dtype, hidden, width in ((torch.float32, 64, 32), (torch.bfloat16, 40, 24)):
        module = _experts(4, hidden, width, "silu", False, dtype)
        loaded = module.gate_up.clone()
        module.pack()
        assert not module.packed and torch.equal(module.gate_up, loaded)


@DTYPES
def test_contributions_add_in_ascending_expert_order(operators: None, dtype: torch.dtype) -> None:
    """Each (token, expert) contribution alone (top-1 with its weight: 0 + c is c), then the
    token's sum in the dtype by ascending expert id: the operator's bits, whatever order the
    router listed the experts in. The same sums in slot order differ somewhere, so the order
    is what this test sees."""
    module = _experts(6, 40, 24, "gelu_tanh", False, dtype)
    hidden, weights, experts = _routes(32, 6, 4, dtype)
    hidden = hidden.to(dtype)
    out = _compiled(module, hidden, weights, experts)
    parts = [_compiled(module, hidden, weights[:, s : s + 1], experts[:, s : s + 1]) for s in range(4)]
    by_expert, by_slot = torch.zeros_like(out), torch.zeros_like(out)
    for token in range(32):
        for slot in sorted(range(4), key=lambda s: int(experts[token, s])):
            by_expert[token] += parts[slot][token]
        for slot in range(4):
            by_slot[token] += parts[slot][token]
    assert torch.equal(out, by_expert)
    assert not torch.equal(out, by_slot), "no token's sum depends on the order: the test proves nothing"


def _elsewhere(experts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts with about a third of the pairs and all of token 0's set to -1, as another
    rank's; weights with those pairs' zeroed): the first as a rank routes, the second the
    same sum over every expert, by which to check it."""
    dropped = torch.rand(experts.shape, generator=torch.Generator().manual_seed(3)) < 0.35
    dropped[0] = True
    assert 0 < int(dropped[1:].sum()) < dropped[1:].numel(), "some pairs kept, some dropped"
    return experts.masked_fill(dropped, -1), weights.masked_fill(dropped, 0.0)


@DTYPES
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_experts_of_another_rank_are_skipped(operators: None, dtype: torch.dtype, bias: bool) -> None:
    """The CPU operator's bits equal its own sum with the skipped pairs' weights at 0 (each
    such contribution is a zero, and x + 0 is x); the reference's within rounding."""
    module = _experts(7, 40, 24, "swiglu_oai", bias, dtype)
    hidden, weights, experts = _routes(13, 7, 3, dtype)
    hidden, weights = hidden.to(dtype), weights.to(dtype)
    local, zeroed = _elsewhere(experts, weights)
    out = _compiled(module, hidden, weights, local)
    assert torch.equal(out, _compiled(module, hidden, zeroed, experts))
    assert torch.equal(out[0], torch.zeros(40, dtype=dtype)), "a token with no expert here gets zeros"
    expected = module.forward_torch(hidden, zeroed, experts)
    torch.testing.assert_close(module.forward_torch(hidden, weights, local), expected, **TOLERANCE[dtype])
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_unknown_activation_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown expert activation 'relu'"):
        ExpertActivation("relu")


def test_moe_align_pads_each_expert_to_whole_blocks() -> None:
    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])  # pairs 0..5: e2, e0, e2, e3, e0, e2
    sorted_pairs, block_experts = moe_align(experts, 5, 4)
    pad = 6
    assert sorted_pairs.tolist()[:12] == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert block_experts.tolist()[:3] == [0, 2, 3] and set(block_experts.tolist()[3:]) == {-1}


@pytest.mark.triton
@DTYPES
@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_triton_kernels_equal_the_reference(dtype: torch.dtype, kind: str, bias: bool) -> None:
    """Interpreted: blocks of 16 rows over 7 experts (2 unused), 24 columns in tiles of 16."""
    module = _experts(7, 40, 24, kind, bias, dtype)
    hidden, weights, experts = _routes(11, 7, 2, dtype, unused=2)
    hidden, weights = hidden.to(dtype), weights.to(dtype)
    biases = (module.gate_up_bias, module.down_bias)
    out = fused_experts(hidden, weights, experts, module.gate_up, module.down, *biases, kind, block_n=16, block_k=32)
    expected = fused_experts_torch(hidden, weights, experts, module.gate_up, module.down, *biases, kind)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_moe_align_puts_another_ranks_pairs_in_no_computed_block() -> None:
    experts = torch.tensor([[2, -1], [-1, 3], [0, 2]])  # pairs 0..5: e2, x, x, e3, e0, e2
    sorted_pairs, block_experts = moe_align(experts, 5, 4)
    pad = 6
    assert sorted_pairs.tolist()[:16] == [4, pad, pad, pad, 0, 5, pad, pad, 3, pad, pad, pad, 1, 2, pad, pad]
    assert block_experts.tolist()[:3] == [0, 2, 3] and set(block_experts.tolist()[3:]) == {-1}


@pytest.mark.triton
@DTYPES
def test_triton_skips_experts_of_another_rank(dtype: torch.dtype) -> None:
    """As the CPU operator: its own result with the skipped pairs weighing 0, the reference's
    within rounding (the routes of test_triton_kernels_equal_the_reference). Within float32
    rounding rather than bit for bit: the interpreter's dot is numpy's matmul, whose bits for
    a row can depend on the rows computed beside it (OpenBLAS's Haswell kernels' do), and
    skipping pairs changes a block's rows."""
    module = _experts(7, 40, 24, "silu", True, dtype)
    hidden, weights, experts = _routes(11, 7, 2, dtype, unused=2)
    hidden, weights = hidden.to(dtype), weights.to(dtype)
    local, zeroed = _elsewhere(experts, weights)
    biases = (module.gate_up_bias, module.down_bias)
    out = fused_experts(hidden, weights, local, module.gate_up, module.down, *biases, block_n=16, block_k=32)
    same = fused_experts(hidden, zeroed, experts, module.gate_up, module.down, *biases, block_n=16, block_k=32)
    torch.testing.assert_close(out, same, atol=1e-6, rtol=1e-6)
    expected = fused_experts_torch(hidden, zeroed, experts, module.gate_up, module.down, *biases)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert torch.equal(out[0], torch.zeros(40, dtype=dtype)), "a token with no expert here gets zeros"


@pytest.mark.triton
def test_triton_on_one_token_top_1() -> None:
    module = _experts(3, 40, 24, "silu", False, torch.float32)
    hidden, weights, experts = _routes(1, 3, 1, torch.float32)
    out = fused_experts(hidden, weights, experts, module.gate_up, module.down, block_n=32, block_k=64)
    torch.testing.assert_close(out, module.forward_torch(hidden, weights, experts), **TOLERANCE[torch.float32])


def test_launcher_names_a_wrong_argument() -> None:
    module = _experts(3, 40, 24, "silu", True, torch.float32)
    hidden, weights, experts = _routes(2, 3, 2, torch.float32)
    with pytest.raises(KernelArgumentError, match="gate_up_bias and down_bias"):
        fused_experts(hidden, weights, experts, module.gate_up, module.down, module.gate_up_bias, None)
    with pytest.raises(KernelArgumentError, match="gate_up: expected shape"):
        fused_experts(hidden, weights, experts, module.gate_up[:-2], module.down)
    with pytest.raises(KernelArgumentError, match="activation: 'relu'"):
        fused_experts(hidden, weights, experts, module.gate_up, module.down, activation="relu")
