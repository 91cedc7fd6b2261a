"""Paged-attention kernels vs their torch references and vs SDPA on gathered keys.

    python bench/kernels.py [--dtype bfloat16] [--batches 1 16 64 256] [--contexts 128 1024 8192]
    python bench/kernels.py --cases experts [--tokens 1 32 512]
    python bench/kernels.py --cases quantized-experts [--tokens 1 32 512]

On CUDA: decode and prefill time of the Triton kernels, of their torch references, and of
`scaled_dot_product_attention` on keys/values gathered into contiguous tensors first (the
gather is timed too: it is what a non-paged kernel would need), with the decode kernel's
achieved memory bandwidth as a fraction of the device's peak. Shapes are Llama-3-8B's
attention (32 query heads, 8 kv heads, head_dim 128), block size 16.

On a CPU there is no GPU to time the kernels on: it says so and times the CPU decode paths
instead (the compiled operator, the plain-torch backend, gathered SDPA), and the routed
experts of a mixture-of-experts layer (the compiled fused-experts operator against the
plain-torch loop over experts, float32 and bfloat16), and the same layer's experts in a
Q4_K_M file's blocks (gate/up Q4_K, down Q6_K; the compiled quantized-experts operator
against its reference, a `quantized_linear` call per expert and projection).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from common import progress

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def _time(fn: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    """Median seconds per call, after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def _paged_inputs(batch: int, context: int, dtype: torch.dtype, device: torch.device):  # type: ignore[no-untyped-def]
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    return key_cache, value_cache, tables, lengths


def _gathered_sdpa(query, key_cache, value_cache, tables, lengths, causal: bool):  # type: ignore[no-untyped-def]
    batch, context = tables.shape[0], int(lengths[0])
    keys = key_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2)  # [b, kvh, L, D]
    values = value_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2)
    q = query.reshape(batch, -1, *query.shape[-2:]).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, is_causal=causal, enable_gqa=True)


def _peak_bandwidth(device: torch.device) -> float | None:
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8  # double data rate


def bench_cuda(batches: list[int], contexts: list[int], dtype: torch.dtype) -> None:
    from pagefleet.kernels.paged_attention_decode import paged_attention_decode, paged_attention_decode_torch
    from pagefleet.kernels.paged_attention_prefill import paged_attention_prefill

    device = torch.device("cuda")
    peak = _peak_bandwidth(device)
    scale = HEAD_DIM**-0.5
    print(
        f"{torch.cuda.get_device_name(device)}, {dtype}, peak bandwidth {peak / 1e9 if peak else float('nan'):.0f} GB/s"
    )
    print("decode: batch context | triton ms (bandwidth) | torch reference ms | gather+SDPA ms")
    for batch in batches:
        for context in contexts:
            key_cache, value_cache, tables, lengths = _paged_inputs(batch, context, dtype, device)
            query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
            args = (query, key_cache, value_cache, tables, lengths, scale)
            ours = _time(partial(paged_attention_decode, *args), device)
            reference = _time(partial(paged_attention_decode_torch, *args), device, repeats=3)
            gathered = (query[:, None], key_cache, value_cache, tables, lengths, False)
            sdpa = _time(partial(_gathered_sdpa, *gathered), device)
            moved = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * key_cache.element_size()
            fraction = f"{moved / ours / peak:.0%} of peak" if peak else f"{moved / ours / 1e9:.0f} GB/s"
            print(
                f"decode  {batch:4d} {context:5d} | {ours * 1e3:8.3f} ({fraction}) | {reference * 1e3:9.2f} "
                f"(x{reference / ours:.1f}) | {sdpa * 1e3:8.3f} (x{sdpa / ours:.2f})",
                flush=True,
            )
    print("prefill: sequences x tokens (whole prompts) | triton ms | gather+SDPA ms")
    for batch in [b for b in batches if b <= 16]:
        for context in [c for c in contexts if c <= 4096]:
            key_cache, value_cache, tables, lengths = _paged_inputs(batch, context, dtype, device)
            query = torch.randn(batch * context, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
            cu_seqlens = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * context
            args = (query, key_cache, value_cache, tables, cu_seqlens, lengths, scale, context)
            ours = _time(partial(paged_attention_prefill, *args), device)
            sdpa = _time(partial(_gathered_sdpa, query, key_cache, value_cache, tables, lengths, True), device)
            print(
                f"prefill {batch:4d} {context:5d} | {ours * 1e3:8.3f} | {sdpa * 1e3:8.3f} (x{sdpa / ours:.2f})",
                flush=True,
            )


def bench_cpu(dtype: torch.dtype) -> None:
    """The CPU decode paths on SmolLM2's attention shapes (9 query heads, 3 kv heads, head
    size 64), blocks scattered at random: the compiled operator against the plain-torch
    backend (its fallback) and gathered SDPA, all measured here, in this run."""
    from pagefleet.engine.layers.attention import CacheSpec, StepLayout, allocate_kv_cache
    from pagefleet.engine.layers.cpu_attention import CpuAttentionBackend
    from pagefleet.engine.layers.torch_attention import TorchAttentionBackend
    from pagefleet.kernels import cpu_ops

    heads, kv_heads, head_dim = 9, 3, 64
    print("No GPU present: the Triton kernels are checked by the interpreter and compiled for sm_90/sm_80 in tests,")
    print(f"but cannot be timed here. CPU decode attention per layer ({dtype}, heads 9/3, head size 64):")
    print("batch context | compiled ms | torch backend ms (ratio) | gather+SDPA ms (ratio)")
    assert cpu_ops.load(), "the compiled CPU operators could not be built"
    device = torch.device("cpu")
    scale = head_dim**-0.5
    for batch in (1, 16, 64):
        for context in (128, 512, 2048):
            num_blocks = batch * -(-context // BLOCK_SIZE)
            tables = torch.randperm(num_blocks).view(batch, -1).int()
            lengths = torch.full((batch,), context, dtype=torch.int32)
            key_cache = allocate_kv_cache(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype, device).normal_()
            value_cache = allocate_kv_cache(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype, device).normal_()
            query = torch.randn(batch, heads, head_dim, dtype=dtype)
            new = torch.randn(batch, kv_heads, head_dim, dtype=dtype)
            slots = tables[:, -1].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
            step = StepLayout(slots, [context] * batch, tables.tolist(), [])
            spec = CacheSpec(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype, device, None)
            timings = []
            for backend in (CpuAttentionBackend(spec), TorchAttentionBackend(spec)):
                metadata = backend.prepare(step)
                forward = partial(backend.forward, query, new, new, key_cache, value_cache, metadata, scale)
                timings.append(_time(forward, device, repeats=7))
            gathered = (query[:, None], key_cache, value_cache, tables, lengths, False)
            sdpa = _time(partial(_gathered_sdpa, *gathered), device, repeats=5)
            compiled, plain = timings
            print(
                f"decode {batch:4d} {context:5d} | {compiled * 1e3:8.3f} | {plain * 1e3:8.3f} "
                f"(x{plain / compiled:.1f}) | {sdpa * 1e3:8.3f} (x{sdpa / compiled:.1f})",
                flush=True,
            )


def bench_cpu_prefill(dtype: torch.dtype) -> None:
    """The CPU prefill paths on SmolLM2's shapes: one chunk of `length` new tokens (no cached
    prefix, the common case) through the compiled attention operator (every row as a decode
    of its own would compute it, the rows of a block sharing key reads), against torch's SDPA
    on the same keys (what the engine ran before issue 50 on CPUs without AVX-512)."""
    from pagefleet.engine.layers.attention import allocate_kv_cache
    from pagefleet.kernels.cpu_attention import paged_attention_prefill_cpu

    heads, kv_heads, head_dim = 9, 3, 64
    print(f"CPU prefill attention per layer ({dtype}, heads 9/3, head size 64), one causal chunk:")
    print("tokens | compiled ms (GFLOPS) | SDPA ms (ratio)")
    device = torch.device("cpu")
    for length in (128, 512, 1024):
        num_blocks = -(-length // BLOCK_SIZE)
        key_cache = allocate_kv_cache(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype, device).normal_()
        value_cache = allocate_kv_cache(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype, device).normal_()
        tables = torch.randperm(num_blocks).view(1, -1).int()
        query = torch.randn(length, heads, head_dim, dtype=dtype)
        cu_seqlens = torch.tensor([0, length], dtype=torch.int32)
        lengths = torch.tensor([length], dtype=torch.int32)
        compiled = _time(
            partial(paged_attention_prefill_cpu, query, key_cache, value_cache, tables, cu_seqlens, lengths, 0.125),
            device,
        )
        keys = key_cache[tables[0].long()].flatten(0, 1)[:length].transpose(0, 1)[None]  # gathered ahead, untimed
        values = value_cache[tables[0].long()].flatten(0, 1)[:length].transpose(0, 1)[None]
        sdpa_args = (query.transpose(0, 1)[None], keys, values)
        sdpa = _time(
            partial(torch.nn.functional.scaled_dot_product_attention, *sdpa_args, is_causal=True, enable_gqa=True),
            device,
        )
        flops = 2 * 2 * heads * head_dim * length * (length + 1) / 2  # causal: QK and PV over half the square
        print(
            f"prefill {length:5d} | {compiled * 1e3:8.3f} ({flops / compiled / 1e9:4.0f}) | {sdpa * 1e3:8.3f} "
            f"(x{sdpa / compiled:.1f})",
            flush=True,
        )


def bench_cpu_experts(dtypes: list[torch.dtype], token_counts: list[int]) -> None:
    """Routed experts on a Qwen3-30B-A3B-scaled layer (hidden 1024, 64 experts, top-8, expert
    width 256): the compiled operator (`torch.ops.pagefleet.fused_experts`) against the
    plain-torch loop over experts (`RoutedExperts.forward_torch`, its fallback), measured here."""
    from pagefleet.engine.layers.experts import RoutedExperts
    from pagefleet.kernels import cpu_ops

    hidden_size, num_experts, top_k, width = 1024, 64, 8, 256
    assert cpu_ops.load(), "the compiled CPU operators could not be built"
    print(f"Fused experts (hidden {hidden_size}, {num_experts} experts, top-{top_k}, width {width}), per layer:")
    print("dtype tokens | compiled ms | torch loop ms (ratio)")
    device = torch.device("cpu")
    for dtype in dtypes:
        module = RoutedExperts(num_experts, hidden_size, width).to(dtype)
        for parameter in module.parameters():
            parameter.data.normal_(std=0.02)
        for num_tokens in token_counts:
            hidden = torch.randn(num_tokens, hidden_size, dtype=dtype)
            logits = torch.randn(num_tokens, num_experts)
            weights, experts = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
            args = (hidden, weights.to(dtype), experts)
            compiled = _time(partial(module.forward, *args), device)
            loop = _time(partial(module.forward_torch, *args), device, repeats=5)
            name = str(dtype).removeprefix("torch.")
            print(
                f"{name:8s} {num_tokens:5d} | {compiled * 1e3:9.3f} | {loop * 1e3:9.3f} (x{loop / compiled:.2f})",
                flush=True,
            )


def bench_cpu_quantized_experts(token_counts: list[int]) -> None:
    """The experts of bench_cpu_experts' layer as a Q4_K_M file holds them (gate/up Q4_K, down
    Q6_K, random blocks): `torch.ops.pagefleet.quantized_experts` (QuantizedRoutedExperts.forward)
    against its reference, one `quantized_linear` call per expert and projection
    (`forward_loop`), float32 activations, measured here."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from pagefleet.engine.layers.quantized import GGML_Q4_K, GGML_Q6_K, QuantizedWeight
    from pagefleet.engine.layers.quantized_experts import QuantizedRoutedExperts, expert_rows, gate_up_weight
    from pagefleet.kernels import cpu_ops
    from tests.kernels.test_quantized import random_blocks

    hidden_size, num_experts, top_k, width = 1024, 64, 8, 256
    assert cpu_ops.load() and cpu_ops.has_quantized_linear(), "the compiled quantized operators could not be built"
    generator = torch.Generator().manual_seed(0)

    def stacked(rows: int, in_features: int, ggml_type: int) -> QuantizedWeight:
        blocks = torch.from_numpy(random_blocks(num_experts * rows, in_features, ggml_type, generator))
        return QuantizedWeight.from_blocks(blocks, ggml_type)

    gate, up = stacked(width, hidden_size, GGML_Q4_K), stacked(width, hidden_size, GGML_Q4_K)
    down = stacked(hidden_size, width, GGML_Q6_K)
    module = QuantizedRoutedExperts(
        [gate_up_weight(expert_rows(gate, e, width), expert_rows(up, e, width)) for e in range(num_experts)],
        [expert_rows(down, e, hidden_size) for e in range(num_experts)],
    )
    layout = "packed (AVX2)" if cpu_ops.quantized_packed_layout() else "GGML's order (VNNI)"
    print(
        f"Quantized experts (Q4_K gate/up, Q6_K down, {layout}; hidden {hidden_size}, {num_experts} experts, "
        f"top-{top_k}, width {width}), per layer, float32 activations:"
    )
    print("tokens | compiled ms | loop of quantized_linear ms (ratio)")
    device = torch.device("cpu")
    for num_tokens in token_counts:
        hidden = torch.randn(num_tokens, hidden_size)
        weights, experts = torch.topk(torch.softmax(torch.randn(num_tokens, num_experts), dim=-1), top_k, dim=-1)
        compiled = _time(partial(module.forward, hidden, weights, experts), device)
        loop = _time(partial(module.forward_loop, hidden, weights, experts), device, repeats=5)
        print(f"{num_tokens:6d} | {compiled * 1e3:11.3f} | {loop * 1e3:9.3f} (x{loop / compiled:.2f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 1024, 8192])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["attention", "experts"],
        choices=["attention", "experts", "quantized-experts"],
    )
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 32, 512], help="fused experts: tokens per call")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if torch.cuda.is_available():
        progress("timing the Triton kernels on CUDA")
        bench_cuda(args.batches, args.contexts, dtype)
    else:
        progress("no CUDA device: timing the CPU path")
        if "attention" in args.cases:
            bench_cpu(torch.float32 if args.dtype == "float16" else dtype)
            bench_cpu_prefill(torch.float32 if args.dtype == "float16" else dtype)
        if "experts" in args.cases:
            bench_cpu_experts([torch.float32, torch.bfloat16], args.tokens)
        if "quantized-experts" in args.cases:
            bench_cpu_quantized_experts(args.tokens)


if __name__ == "__main__":
    main()
