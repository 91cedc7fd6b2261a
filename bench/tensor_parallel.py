"""Tensor parallelism: the same model whole on one rank and split across several, one run.

    python bench/tensor_parallel.py [--requests 32] [--prompt-tokens 128] [--output-tokens 64]

Each rank is one process with one OpenMP thread (OMP_NUM_THREADS=1 for the whole run), so
on this 2-core machine tp=2 uses both cores where tp=1 uses one; tp=1 with two threads is
the fair single-process baseline. Reported per layout: output tokens/s, the ratio to tp=1
with one thread, and the share of rank 0's time spent in all-reduces and the logits'
gather (waiting for the other ranks included).

SmolLM2-135M has 9 attention heads and 3 KV heads, so it splits only 3 ways (3 ranks on 2
cores here); a random-weight model of SmolLM2's size with 8 heads and 2 KV heads (hidden
576, 30 layers, its vocabulary) shows tp=2. On a GPU machine, run the same script: each
rank takes one device (nccl), and `--device cuda` makes the comparison the one that
matters there.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank; the workers inherit it

import argparse  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from common import progress  # noqa: E402

from pagefleet.engine import LLM, SamplingParams  # noqa: E402

SMOLLM2 = "smollm2-135m-instruct"


def eight_head_model(directory: Path) -> Path:
    """SmolLM2-135M's shape with 8 heads (head_dim 72) and 2 KV heads, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def timed(model: str, tp: int, threads: int, prompts: list[list[int]], params: SamplingParams, device: str) -> tuple:
    """(output tokens/s, rank 0's share of time in collectives) of one generate."""
    torch.set_num_threads(threads)
    llm = LLM(model, dtype="float32", tensor_parallel_size=tp, skip_tokenizer_init=True, device=device)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
        shard = llm.engine.parts.model.shard  # type: ignore[attr-defined]
        shard.reduce_seconds = 0.0
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return tokens / elapsed, shard.reduce_seconds / elapsed
    finally:
        llm.engine.shutdown()
        torch.set_num_threads(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as directory:
        progress("building the 8-head model")
        models = {SMOLLM2: (SMOLLM2, 3), "smollm2-shaped, 8 heads": (str(eight_head_model(Path(directory))), 2)}
        print(f"\n{args.requests} requests, {args.prompt_tokens} prompt + {args.output_tokens} output tokens")
        print(f"{'model':26} {'layout':22} {'tok/s':>8} {'vs tp=1':>8} {'in collectives':>15}")
        for label, (model, split) in models.items():
            layouts = [(1, 1, "tp=1, 1 thread"), (1, 2, "tp=1, 2 threads"), (split, 1, f"tp={split}, 1 thread each")]
            baseline = None
            for tp, threads, name in layouts:
                progress(f"{label}: {name}")
                throughput, share = timed(model, tp, threads, prompts, params, args.device)
                baseline = baseline or throughput
                collectives = f"{share:14.0%}" if tp > 1 else f"{'-':>14}"
                print(f"{label:26} {name:22} {throughput:8.1f} {throughput / baseline:7.2f}x {collectives}", flush=True)


if __name__ == "__main__":
    main()
