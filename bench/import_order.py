"""Offline speed whatever the caller imported first: pagefleet, or torch.

    python bench/import_order.py [--threads 2] [--rounds 2] [--requests 64]

The throughput workload (bench/common.py's fixed workload, SmolLM2 float32 at its
defaults, `LLM.generate`) in a fresh process per run, three ways, alternating:
- `pagefleet first`: `from pagefleet.engine import LLM` before anything imports torch;
- `torch first`: `import torch` first, then `LLM(...)` at its defaults (which runs the
  engine in a process of its own, since this process's OpenMP threads would sleep between
  a step's parallel regions);
- `torch first, same process`: as above with `separate_process=False`, the engine in the
  caller's process (what every caller that imported torch first got before).
OMP_WAIT_POLICY=PASSIVE and OMP_NUM_THREADS=--threads in each. Each run warms up on two
prompts, then times one `generate` of the workload. Prints each way's best tok/s and its
ratio to `pagefleet first`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import progress

RUN = """
import json, sys, time
{first}
from pagefleet.engine import LLM, SamplingParams
sys.path.insert(0, "bench")
from common import fixed_workload

workload = fixed_workload(num_requests={requests})
llm = LLM("smollm2-135m-instruct", dtype="float32", quantization="none"{extra})
params = SamplingParams(temperature=0.0, max_tokens=workload.output_tokens, ignore_eos=True)
llm.generate(workload.prompts[:2], params, use_tqdm=False)
started = time.perf_counter()
llm.generate(workload.prompts, params, use_tqdm=False)
print(json.dumps({{"tokens_per_s": workload.total_output_tokens / (time.perf_counter() - started),
                  "separate_process": llm.separate_process}}))
"""

WAYS = {
    "pagefleet first": ("", ""),
    "torch first": ("import torch", ""),
    "torch first, same process": ("import torch", ", separate_process=False"),
}


def run_once(way: str, threads: int, requests: int) -> dict[str, float]:
    first, extra = WAYS[way]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("GOMP_SPINCOUNT", None)
    code = RUN.format(first=first, extra=extra, requests=requests)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{way} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    best: dict[str, float] = {}
    for round_index in range(args.rounds):
        for way in WAYS:
            result = run_once(way, args.threads, args.requests)
            progress(f"round {round_index + 1} {way}: {result['tokens_per_s']:.1f} tok/s "
                     f"(engine in its own process: {result['separate_process']})")  # fmt: skip
            best[way] = max(best.get(way, 0.0), result["tokens_per_s"])
    reference = best["pagefleet first"]
    print(f"{'way':28} {'tok/s':>8} {'ratio':>6}")
    for way, tokens_per_s in best.items():
        print(f"{way:28} {tokens_per_s:8.1f} {tokens_per_s / reference:6.2f}")


if __name__ == "__main__":
    main()
