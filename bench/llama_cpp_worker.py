"""Runs inside the llama-cpp-python venv (see peers.py): llama.cpp on one GGUF file.

    python llama_cpp_worker.py TASK.json RESULT.json

TASK: {"model": path, "threads": n, "windows": [[token ids], ...], "prompt": [token ids],
"max_tokens": n, "long_prompt": [token ids]}. Writes the negative log-likelihood of every
token after the first of each window (each window a fresh context; none without windows),
greedy decoding of `prompt`: its tokens and the seconds of each (start-up not timed, a
warm-up first), the seconds of `long_prompt`'s prompt processing (best of two, a fresh
context each), and `llama_print_system_info()`: the instruction sets this build uses.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def main() -> None:
    task_path, result_path = sys.argv[1:3]
    with open(task_path) as handle:
        task = json.load(handle)
    from llama_cpp import Llama

    def load(context: int, logits_all: bool) -> Llama:
        threads = task["threads"]
        return Llama(
            model_path=task["model"],
            n_ctx=context + 16,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            logits_all=logits_all,
            verbose=False,
        )

    nlls = []
    if task["windows"]:
        scorer = load(max(len(w) for w in task["windows"]), logits_all=True)
        for tokens in task["windows"]:
            scorer.reset()
            scorer.eval(tokens)
            logits = np.asarray(scorer.scores[: len(tokens) - 1], dtype=np.float64)
            logits -= logits.max(axis=1, keepdims=True)
            log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
            nlls.extend((-log_probs[np.arange(len(tokens) - 1), tokens[1:]]).tolist())
        del scorer
    llm = load(max(len(task["prompt"]) + task["max_tokens"], len(task["long_prompt"])), logits_all=False)

    def decode(max_tokens: int) -> tuple[list[int], list[float]]:
        tokens, stamps = [], []
        started = time.perf_counter()
        for token in llm.generate(task["prompt"], temp=0.0, top_k=1, reset=True):
            tokens.append(token)
            stamps.append(time.perf_counter() - started)
            if len(tokens) == max_tokens:
                break
        return tokens, stamps

    decode(8)  # warm-up
    tokens, stamps = decode(task["max_tokens"])
    prompt_seconds = []
    for _ in range(2):
        llm.reset()
        started = time.perf_counter()
        llm.eval(task["long_prompt"])
        prompt_seconds.append(time.perf_counter() - started)
    import llama_cpp

    system_info = llama_cpp.llama_print_system_info().decode().strip()
    with open(result_path, "w") as handle:
        json.dump(
            {
                "nlls": nlls,
                "tokens": tokens,
                "stamps": stamps,
                "prompt_seconds": min(prompt_seconds),
                "system_info": system_info,
            },
            handle,
        )


if __name__ == "__main__":
    main()
