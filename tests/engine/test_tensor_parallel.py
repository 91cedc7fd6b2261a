"""Tensor parallelism on the CPU: two ranks (the engine and one spawned worker, gloo, one
OpenMP thread each) give transformers' greedy output token for token, hold half the
weights each (half of every mixture's routed experts: expert parallelism), fail clearly
when a worker dies, and leave no process behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.distributed.shard import Shard
from pagefleet.engine.errors import EngineDeadError
from pagefleet.engine.layers.experts import RoutedExperts
from pagefleet.engine.models.loading import load_model
from tests.conftest import TINY_VOCAB, build_tiny_model
from tests.engine.helpers import assert_no_block_leaked, hf_greedy, random_prompts, same_kv_memory

NEW_TOKENS = 10
PROMPT_LENGTHS = [5, 17, 33, 1, 48]
SCHEDULES: dict[str, dict[str, Any]] = {
    "plain": {},
    "preempt_recompute": {"num_kv_blocks": 10, "block_size": 8},
    "chunked_swap": {"max_num_batched_tokens": 16, "num_kv_blocks": 10, "block_size": 8, "preemption_mode": "swap"},
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_models(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Llama with 2 KV heads (one per rank), 4 (two per rank) and 1 (replicated), Qwen2,
    Gemma 2 (soft-caps, sandwich norms), Gemma 4 (global layers' KV heads replicated, shared
    KV, stacked experts split and per-layer embeddings), Qwen3-MoE and Mixtral (per-expert
    tensors, half the experts on each rank), Qwen2-MoE (experts split, its shared expert split
    as an MLP), gpt-oss (sinks split with their heads, the output bias added once, stacked
    experts and their biases split), DeepSeek-V3 (latent attention's heads split, its one
    cached head replicated, experts split), Llama 4 (RoPE rows reordered per head, top-1
    experts split, shared expert split), Phi-3 (fused checkpoint tensors), GPT-2."""
    root = tmp_path_factory.mktemp("tp-models")
    extra = {arch: build_tiny_model(arch, root / arch) for arch in ("llama_kv4", "llama_kv1")}
    shared = {
        arch: tiny_models[arch]
        for arch in (
            *("qwen2", "gemma2", "gemma4", "qwen3_moe", "qwen2_moe", "mixtral"),
            *("gpt_oss", "deepseek_v3", "llama4", "phi3", "gpt2"),
        )
    }
    return {"llama_kv2": tiny_models["llama"], **extra, **shared}


def _worker_pids(llm: LLM) -> list[int]:
    workers = llm.engine.runner.workers
    assert workers is not None
    return [process.pid for process in workers.processes if process.pid is not None]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


# Every sharding (KV heads split or replicated, biases, soft-caps, fused checkpoint tensors,
# GPT-2's fused projections) with chunked prefills and swapping in one run, which runs every
# path of the workers' step; one architecture also plain and preempted by recompute.
ARCH_SCHEDULES = [("llama_kv2", "plain"), ("llama_kv2", "preempt_recompute")] + [
    (arch, "chunked_swap")
    for arch in (
        *("llama_kv2", "llama_kv4", "llama_kv1", "qwen2", "gemma2", "gemma4"),
        *("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3", "llama4", "phi3", "gpt2"),
    )
]


@pytest.mark.parametrize(("arch", "schedule"), ARCH_SCHEDULES)
def test_two_ranks_give_transformers_greedy_output(tp_models: dict[str, Path], arch: str, schedule: str) -> None:
    model_dir = tp_models[arch]
    llm = LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, **same_kv_memory(model_dir, SCHEDULES[schedule]))
    try:
        prompts = random_prompts(PROMPT_LENGTHS, TINY_VOCAB)
        outputs = llm.generate(prompts, GREEDY)
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.outputs[0].token_ids == hf_greedy(model_dir, prompt, NEW_TOKENS)[0]
        if "num_kv_blocks" in SCHEDULES[schedule]:  # a cache too small for the batch
            stats = llm.stats()
            assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
        assert_no_block_leaked(llm)
    finally:
        llm.engine.shutdown()


def test_each_rank_holds_about_half_the_weights(tp_models: dict[str, Path]) -> None:
    model_dir = tp_models["llama_kv2"]
    whole = LLM(str(model_dir), dtype="float32", num_kv_blocks=16)
    split = LLM(str(model_dir), dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
    try:

        def parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
            """(all bytes, bytes of the replicated norms)"""
            params = {id(p): (name, p) for name, p in model.named_parameters()}.values()
            total = sum(p.numel() * p.element_size() for _, p in params)
            norms = sum(p.numel() * p.element_size() for name, p in params if "norm" in name)
            return total, norms

        whole_bytes, norms = parameter_bytes(whole.engine.parts.model)  # type: ignore[arg-type]
        rank_bytes, _ = parameter_bytes(split.engine.parts.model)  # type: ignore[arg-type]
        assert rank_bytes == pytest.approx((whole_bytes - norms) / 2 + norms, rel=0.01)
        whole_kv = whole.engine.runner.kv_caches[0][0]
        rank_kv = split.engine.runner.kv_caches[0][0]
        assert rank_kv.shape[2] * 2 == whole_kv.shape[2], "each rank keeps half the KV heads"
    finally:
        split.engine.shutdown()


EXPERT_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3", "llama4", "gemma4")


def _routed_experts(model: torch.nn.Module) -> dict[str, RoutedExperts]:
    return {name: module for name, module in model.named_modules() if isinstance(module, RoutedExperts)}


@pytest.mark.parametrize("arch", EXPERT_ARCHS)
def test_each_rank_holds_half_of_every_layers_experts(tp_models: dict[str, Path], arch: str) -> None:
    """Loaded as rank 0 and as rank 1 of 2 (loading joins no collective): each rank's routed
    experts are half the bytes of the whole model's, and exactly its rows of its experts
    (the first half's, then the second's: the layout is expert by expert)."""
    model_dir, cpu = tp_models[arch], torch.device("cpu")
    whole = _routed_experts(load_model(model_dir, torch.float32, cpu)[0])  # type: ignore[arg-type]
    assert whole, f"{arch} has routed experts"
    for rank in range(2):
        part = _routed_experts(load_model(model_dir, torch.float32, cpu, Shard(rank, 2))[0])  # type: ignore[arg-type]
        assert part.keys() == whole.keys()
        for name, experts in part.items():
            half = whole[name].num_experts // 2
            assert experts.local_experts == range(rank * half, (rank + 1) * half)
            whole_params = dict(whole[name].named_parameters())
            for param_name, param in experts.named_parameters():
                everything = whole_params[param_name].flatten()
                assert param.numel() * 2 == everything.numel(), f"{name}.{param_name}: half the bytes"
                mine = everything[rank * param.numel() : (rank + 1) * param.numel()]
                assert torch.equal(param.flatten(), mine), f"{name}.{param_name}: rank {rank}'s experts"


class _EachRankAlone:
    """An all-reduce that leaves each rank's part as it is, to see the parts in one process."""

    def fits(self, x: torch.Tensor) -> bool:
        return True

    def __call__(self, x: torch.Tensor) -> None:
        pass


def test_two_ranks_experts_sum_to_the_whole() -> None:
    """Each rank computes only the pairs routed to its experts (the others' ids are -1 to
    it); the two parts add up to one rank's output on every path, tokens with all their
    experts on one rank included."""
    num_experts, hidden_size, width = 6, 40, 24
    whole = RoutedExperts(num_experts, hidden_size, width, bias=True)
    generator = torch.Generator().manual_seed(0)
    for parameter in whole.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.3
    parts = []
    for rank in range(2):
        shard = Shard(rank, 2, shared_memory=_EachRankAlone())  # type: ignore[arg-type]
        part = RoutedExperts(num_experts, hidden_size, width, bias=True, shard=shard)
        for name, parameter in part.named_parameters():
            parameter.data = dict(whole.named_parameters())[name].data.chunk(2)[rank].clone()
        parts.append(part)
    hidden = torch.randn(9, hidden_size, generator=generator)
    weights, experts = torch.rand(9, 2, generator=generator), torch.randint(0, num_experts, (9, 2), generator=generator)
    experts[0], experts[1] = torch.tensor([0, 2]), torch.tensor([5, 3])  # all on rank 0; all on rank 1
    assert parts[1].local_ids(experts)[1].tolist() == [2, 0] and parts[1].local_ids(experts)[0].tolist() == [-1, -1]
    for run in ("forward", "forward_torch"):
        expected = getattr(whole, run)(hidden, weights, experts)
        summed = sum(getattr(part, run)(hidden, weights, experts) for part in parts)
        torch.testing.assert_close(summed, expected, atol=2e-5, rtol=2e-5)


def test_a_dead_worker_fails_the_requests_clearly_and_stopping_leaves_no_process(
    tp_models: dict[str, Path],
) -> None:
    llm = LLM(str(tp_models["llama_kv2"]), dtype="float32", tensor_parallel_size=2)
    pids = _worker_pids(llm)
    assert llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids
    os.kill(pids[0], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker rank 1"):
        llm.generate([[1, 2, 3], [4, 5]], GREEDY)
    assert time.monotonic() - started < 10
    assert_no_block_leaked(llm)
    llm.engine.shutdown()

    healthy = LLM(str(tp_models["llama_kv2"]), dtype="float32", tensor_parallel_size=2)
    pids = _worker_pids(healthy)
    healthy.engine.shutdown()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a worker outlived its engine"


def _children(pid: int) -> list[int]:
    """Child processes of every thread of `pid` (the server starts its engine in a thread)."""
    return [
        int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()
    ]


def test_pagefleet_serve_with_two_ranks_serves_the_openai_api(tp_models: dict[str, Path], tmp_path: Path) -> None:
    import httpx

    from tests.processes import start_server, stop_server

    model_dir = tp_models["llama_kv2"]
    server = start_server(str(model_dir), tmp_path / "serve.log", "--tensor-parallel-size", "2", "--dtype", "float32")
    try:
        workers = _children(server.process.pid)
        assert workers, "rank 1 runs in a child process"
        prompt = random_prompts([12], TINY_VOCAB)[0]
        body = {
            "model": str(model_dir),
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        tokenizer_text = answer.json()["choices"][0]["text"]
        expected = hf_greedy(model_dir, prompt, NEW_TOKENS)[0]
        from transformers import AutoTokenizer

        assert tokenizer_text == AutoTokenizer.from_pretrained(model_dir).decode(expected)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    finally:
        stop_server(server)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "a worker outlived its server"


def _reduce_in_a_rank(rank: int, size: int, port: int, memory_name: str, results: Any) -> None:
    from pagefleet.engine.distributed.shard import Shard
    from pagefleet.engine.distributed.shm import SLOT_BYTES, SharedMemoryAllReduce
    from pagefleet.engine.distributed.workers import init_group

    init_group(rank, size, port, torch.device("cpu"))
    shard = Shard(rank, size, shared_memory=SharedMemoryAllReduce(memory_name, rank, size))
    sums = []
    for elements in (7, 32 * 576, SLOT_BYTES // 4 + 1):  # the last one is past a slot: gloo
        for call in range(3):  # the two buffers alternate
            x = torch.full((elements,), float(rank + 1) * (call + 1))
            sums.append(float(shard.all_reduce(x)[-1]))
    results.put((rank, sums))
    torch.distributed.destroy_process_group()


def test_the_shared_memory_all_reduce_sums_every_rank_and_hands_large_tensors_to_gloo() -> None:
    import multiprocessing

    from pagefleet.engine.distributed.shm import SharedMemoryAllReduce
    from pagefleet.engine.distributed.workers import free_port

    size, port = 3, free_port()
    owner = SharedMemoryAllReduce(f"/dev/shm/pagefleet-test-{os.getpid()}", 0, size, create=True)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [
        context.Process(target=_reduce_in_a_rank, args=(rank, size, port, owner.path, results)) for rank in range(size)
    ]
    for process in ranks:
        process.start()
    try:
        gathered = dict(results.get(timeout=120) for _ in ranks)
    finally:
        for process in ranks:
            process.join(30)
        owner.close(remove=True)
    expected = [6.0 * (call + 1) for _ in range(3) for call in range(3)]  # (1 + 2 + 3) x (call + 1)
    assert gathered == {rank: expected for rank in range(size)}


def test_an_engine_that_is_done_frees_its_ranks_for_the_next(tp_models: dict[str, Path]) -> None:
    """`del llm` (or `with LLM(...)`) stops the workers and leaves the process group, so a
    notebook or a test suite can make the next tensor-parallel engine in the same process."""
    import gc

    import torch.distributed as dist

    model_dir, (prompt,) = tp_models["llama_kv2"], random_prompts([7], TINY_VOCAB)
    first = LLM(str(model_dir), dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
    expected = first.generate([prompt], GREEDY)[0].outputs[0].token_ids
    pids = _worker_pids(first)
    del first
    gc.collect()
    assert not dist.is_initialized() and not any(_alive(pid) for pid in pids)
    with LLM(str(model_dir), dtype="float32", num_kv_blocks=16, tensor_parallel_size=2) as second:
        assert second.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected
        pids = _worker_pids(second)
    assert not dist.is_initialized() and not any(_alive(pid) for pid in pids)
