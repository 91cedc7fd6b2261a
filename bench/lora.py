"""Multi-LoRA throughput: 64 requests spread over 1, 4 and 16 adapters against the base model
alone, on SmolLM2-135M-Instruct, in one run.

    python bench/lora.py [--requests 64] [--prompt-tokens 128] [--output-tokens 64] [--rank 16]

Random adapters of rank `--rank` on every q/k/v/o and gate/up/down projection, written in
PEFT's format (adapter_config.json + adapter_model.safetensors) to a temporary directory.
Each layout is one `LLM.generate` of all requests (greedy, ignore_eos), adapters assigned
round robin, on an engine with `max_loras` = the most adapters, so that one batch holds
them all; the base model is an engine without LoRA. The layouts take turns for `--rounds`
rounds (machines here are noisy). Reported: output tokens/s (mean of the rounds), the
ratio to the base model (target: at least 0.8x with 4 adapters), and the memory one adapter
slot costs (the stacks of every projection at `max_lora_rank`).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from common import progress
from safetensors.torch import save_file

from pagefleet.engine import LLM, LoRARequest, SamplingParams

MODEL = "smollm2-135m-instruct"
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(llm: LLM, count: int, rank: int, directory: Path) -> list[LoRARequest]:
    """`count` random adapters for the model `llm` serves (its own module names and shapes)."""
    targets = llm.engine.parts.model.lora_targets()
    requests = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for module, target in targets.items():
            in_features = target.linear.weight.shape[1]
            rows = target.row_end - target.row_start
            tensors[f"base_model.model.{module}.lora_A.weight"] = 0.02 * torch.randn(
                rank, in_features, generator=generator
            )
            tensors[f"base_model.model.{module}.lora_B.weight"] = 0.02 * torch.randn(rows, rank, generator=generator)
        path = directory / f"adapter-{index}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": MODULES}
        (path / "adapter_config.json").write_text(json.dumps(config))
        requests.append(LoRARequest(f"adapter-{index}", index + 1, str(path)))
    return requests


def timed(
    llm: LLM, prompts: list[dict[str, list[int]]], params: SamplingParams, loras: list[LoRARequest] | None
) -> float:
    """Output tokens per second of one generate of every prompt."""
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]}
        for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    common = {"dtype": "float32", "enable_prefix_caching": False}
    progress("loading the base model, and the base model with LoRA slots")
    base = LLM(MODEL, **common)
    most = max(args.adapters)
    served = LLM(MODEL, **common, enable_lora=True, max_loras=most, max_lora_rank=args.rank)
    with tempfile.TemporaryDirectory() as directory:
        adapters = write_adapters(served, most, args.rank, Path(directory))
        # Warm-up: every adapter read from disk and put in its slot before the clock starts.
        warm = SamplingParams(max_tokens=1, ignore_eos=True)
        base.generate(prompts[:2], warm, use_tqdm=False)
        served.generate(prompts[:most], warm, use_tqdm=False, lora_request=adapters)
        runs: dict[int, list[float]] = {0: [], **{count: [] for count in args.adapters}}
        for round_index in range(args.rounds):  # layouts interleaved, so drift hits them alike
            progress(f"round {round_index + 1}/{args.rounds}: base model")
            runs[0].append(timed(base, prompts, params, None))
            for count in args.adapters:
                progress(f"round {round_index + 1}/{args.rounds}: {count} adapter(s)")
                loras = [adapters[i % count] for i in range(args.requests)]
                runs[count].append(timed(served, prompts, params, loras))
    slot_mib = served.engine.lora.bytes_per_slot / 2**20  # type: ignore[union-attr]
    reference = sum(runs[0]) / len(runs[0])
    shape = f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens"
    print(f"\n{args.requests} requests, {shape}, rank {args.rank}")
    print(f"base model: {reference:.1f} tok/s (runs: {', '.join(f'{r:.1f}' for r in runs[0])})")
    print(f"one adapter slot (every projection at max_lora_rank {args.rank}): {slot_mib:.1f} MiB")
    print(f"{'adapters':>8} {'tok/s':>8} {'vs base':>8}  runs")
    for count in args.adapters:
        mean = sum(runs[count]) / len(runs[count])
        print(f"{count:>8} {mean:8.1f} {mean / reference:7.2f}x  {', '.join(f'{r:.1f}' for r in runs[count])}")


if __name__ == "__main__":
    main()
