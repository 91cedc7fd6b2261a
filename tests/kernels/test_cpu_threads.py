"""The compiled operators' parallel loops (torch's OpenMP threads; a quantized layer is split
from 32 KiB of weights a thread): a result has the same bits on 1 thread or several, and loops
from several Python threads at once each get their own answer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagefleet.engine.layers.quantized import GGML_Q4_1, PackedWeight, QuantizedWeight
from pagefleet.kernels import cpu_ops
from tests.kernels.test_quantized import random_blocks


@pytest.fixture(scope="module")
def weight() -> PackedWeight | QuantizedWeight:
    """A Q4_1 weight large enough that a loop over its columns is split over threads."""
    assert cpu_ops.has_quantized_linear(), "every machine here has AVX2: the quantized matmul must build"
    blocks = random_blocks(1024, 576, GGML_Q4_1, torch.Generator().manual_seed(3))
    quantized = QuantizedWeight.from_blocks(torch.from_numpy(blocks), GGML_Q4_1)
    return PackedWeight.pack(quantized) if cpu_ops.quantized_packed_layout() else quantized


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_bits_do_not_depend_on_the_thread_count(weight: PackedWeight | QuantizedWeight, threads: None) -> None:
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    torch.set_num_threads(1)
    alone = weight.matmul(x)
    for count in (2, 3):
        torch.set_num_threads(count)
        for _ in range(20):  # back to back: the threads spin between loops, then sleep below
            assert torch.equal(weight.matmul(x), alone), f"{count} threads"
    torch.set_num_threads(2)
    time.sleep(0.01)  # long enough for the threads to fall asleep
    assert torch.equal(weight.matmul(x), alone), "the first loop after the threads slept"


def test_loops_from_several_python_threads_at_once(weight: PackedWeight | QuantizedWeight, threads: None) -> None:
    torch.set_num_threads(2)
    inputs = [torch.randn(1 + i % 3, 576, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    expected = [weight.matmul(x) for x in inputs]

    def run(index: int) -> bool:
        return all(torch.equal(weight.matmul(inputs[index]), expected[index]) for _ in range(50))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(8)))
