"""The compiled operators' thread team (csrc/cpu_team.h): a loop's result has the same bits
on 1 thread or several, loops from several Python threads at once each get their own
answer, and a forked child (the engine's workers may be forked) gets a team of its own
rather than waiting forever on its parent's threads."""

from __future__ import annotations

import multiprocessing
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
        for _ in range(20):  # back to back: the team's threads are awake, then asleep below
            assert torch.equal(weight.matmul(x), alone), f"{count} threads"
    torch.set_num_threads(2)
    time.sleep(0.01)  # long enough for the team to fall asleep
    assert torch.equal(weight.matmul(x), alone), "the first loop after the team slept"


def test_loops_from_several_python_threads_at_once(weight: PackedWeight | QuantizedWeight, threads: None) -> None:
    torch.set_num_threads(2)
    inputs = [torch.randn(1 + i % 3, 576, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    expected = [weight.matmul(x) for x in inputs]

    def run(index: int) -> bool:
        return all(torch.equal(weight.matmul(inputs[index]), expected[index]) for _ in range(50))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(8)))


def _matmul_in_child(weight: PackedWeight | QuantizedWeight, x: torch.Tensor, queue: multiprocessing.Queue) -> None:
    torch.set_num_threads(2)
    queue.put(weight.matmul(x).tolist())


def test_a_forked_child_has_a_team_of_its_own(weight: PackedWeight | QuantizedWeight, threads: None) -> None:
    torch.set_num_threads(2)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(1))
    expected = weight.matmul(x)  # the parent's team exists before the fork
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_matmul_in_child, args=(weight, x, queue))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0, "the child hung or failed on its first parallel loop"
    assert torch.equal(torch.tensor(queue.get(timeout=5)), expected)
