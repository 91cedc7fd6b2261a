"""What block sharing saves: n=4 sampling and beam width 4, with and without sharing.

    python bench/sharing.py [--threads 2] [--requests 6] [--budget-blocks 256]

SmolLM2-135M-Instruct, float32, 512-token prompts, 128 new tokens (ignore_eos). The
baseline is the same engine with `enable_block_sharing=False`: every sample or beam copies
the blocks it would share before it writes, so each owns its whole history (the prompt
included). Both run in the same process.

1. One request at a time: peak KV blocks with and without sharing, the saving, and output
   tokens/s of each.
2. The same KV budget (`--budget-blocks`) and `--requests` requests at once: the most
   requests in flight together, and output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from common import fixed_workload, progress

MODEL = "smollm2-135m-instruct"
PROMPT_TOKENS = 512
NEW_TOKENS = 128
WIDTH = 4


@dataclass(slots=True)
class Run:
    peak_blocks: int  # most blocks in use at once (the block pool's high-water mark)
    peak_requests_in_flight: int
    mean_requests_in_flight: float  # running requests, averaged over steps
    output_tokens_per_s: float
    seconds: float
    num_preemptions: int


def workloads() -> dict[str, Any]:
    from pagefleet.engine import SamplingParams

    return {
        "n=4 sampling": SamplingParams(n=WIDTH, temperature=1.0, seed=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        "beam width 4": SamplingParams(
            n=WIDTH, use_beam_search=True, beam_width=WIDTH, max_tokens=NEW_TOKENS, ignore_eos=True
        ),
    }


def run(llm: Any, prompts: list[list[int]], params: Any) -> Run:
    """Run `prompts` to the end on a fresh engine."""
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"sharing-{index}", prompt, params)
    in_flight = []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        in_flight.append(engine.stats().num_running_requests)
    seconds = time.perf_counter() - started
    stats = engine.stats()
    return Run(
        peak_blocks=stats.peak_used_blocks,
        peak_requests_in_flight=max(in_flight),
        mean_requests_in_flight=sum(in_flight) / len(in_flight),
        output_tokens_per_s=stats.num_generation_tokens / seconds,
        seconds=seconds,
        num_preemptions=stats.num_preemptions_recompute + stats.num_preemptions_swap,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=6, help="requests at once in part 2")
    parser.add_argument("--budget-blocks", type=int, default=256, help="KV blocks in part 2")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    import torch

    from pagefleet.engine import LLM

    torch.set_num_threads(args.threads)
    prompts = fixed_workload(args.requests, PROMPT_TOKENS, PROMPT_TOKENS, NEW_TOKENS).prompts
    results: dict[str, Any] = {}
    for name, params in workloads().items():
        for sharing in (True, False):
            label = "shared" if sharing else "unshared"
            common = dict(dtype="float32", enable_prefix_caching=False, enable_block_sharing=sharing)
            progress(f"{name}, {label}: one request")
            single = run(LLM(MODEL, **common), prompts[:1], params)
            progress(f"{name}, {label}: {args.requests} requests in {args.budget_blocks} blocks")
            budget = run(LLM(MODEL, num_kv_blocks=args.budget_blocks, **common), prompts, params)
            results.setdefault(name, {})[label] = {"single": asdict(single), "budget": asdict(budget)}
        shared, unshared = results[name]["shared"], results[name]["unshared"]
        saving = 1 - shared["single"]["peak_blocks"] / unshared["single"]["peak_blocks"]
        results[name]["block_saving"] = saving
        one = (shared["single"], unshared["single"])
        many = (shared["budget"], unshared["budget"])
        speedup = one[0]["output_tokens_per_s"] / one[1]["output_tokens_per_s"]
        print(
            f"{name}, one request: peak KV blocks {one[0]['peak_blocks']} shared vs {one[1]['peak_blocks']} "
            f"unshared ({saving:.1%} fewer); {one[0]['output_tokens_per_s']:.1f} vs "
            f"{one[1]['output_tokens_per_s']:.1f} tok/s (x{speedup:.2f})\n"
            f"{name}, {args.requests} requests in {args.budget_blocks} blocks: in flight "
            f"{many[0]['mean_requests_in_flight']:.2f} vs {many[1]['mean_requests_in_flight']:.2f} on average "
            f"(peak {many[0]['peak_requests_in_flight']} vs {many[1]['peak_requests_in_flight']}), "
            f"preemptions {many[0]['num_preemptions']} vs {many[1]['num_preemptions']}; "
            f"{many[0]['output_tokens_per_s']:.1f} vs {many[1]['output_tokens_per_s']:.1f} tok/s "
            f"(x{many[0]['output_tokens_per_s'] / many[1]['output_tokens_per_s']:.2f})",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
