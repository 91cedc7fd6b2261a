"""Latent attention's prompt chunks, absorbed against expanded (`mla_prefill`), on a
DeepSeek-V3-shaped model scaled to this machine (random weights, bench/shaped_models.py:
the published per-head shape and latent widths, 16 heads, 8 layers).

For each prompt length, a batch of prompts answered with one token each (the time is their
prefill) by the engine in both settings, in the same run and alternating rounds; prints
prompt tokens/s for both and expanded/absorbed. Also prints how many of the batch's greedy
answers (16 tokens) agree between the two settings: they compute each prompt's attention
with other rounding.

    cd bench && OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE ../.venv/bin/python latent_prefill.py [--lengths 512 2048]
"""

from __future__ import annotations

import argparse
import json
import time

from common import fixed_workload, progress
from shaped_models import shaped_model_dir

MODES = ("absorbed", "expanded")


def prompt_tokens_per_s(llm, prompts: list[list[int]]) -> float:  # type: ignore[no-untyped-def]
    from pagefleet.engine import SamplingParams

    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=1))
    return sum(map(len, prompts)) / (time.perf_counter() - started)


def greedy_answers(llm, prompts: list[list[int]]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    from pagefleet.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--prompts", type=int, default=4, help="prompts a batch")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from pagefleet.engine import LLM

    model_dir = str(shaped_model_dir("deepseek-v3-scaled"))
    engines = {
        mode: LLM(model_dir, dtype="float32", mla_prefill=mode, enable_prefix_caching=False, separate_process=False)
        for mode in MODES
    }
    report: dict = {"model": "deepseek-v3-scaled", "dtype": "float32", "lengths": {}}
    for length in args.lengths:
        prompts = fixed_workload(args.prompts, length, length, 1, 129280, seed=length).prompts
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        for round_index in range(args.rounds):
            for mode in MODES:
                progress(f"{length}-token prompts, round {round_index + 1}: {mode}")
                rates[mode].append(prompt_tokens_per_s(engines[mode], prompts))
        answers = {mode: greedy_answers(engines[mode], prompts) for mode in MODES}
        best = {mode: max(rates[mode]) for mode in MODES}
        report["lengths"][length] = {
            "prompt_tokens_per_s": {mode: round(best[mode], 1) for mode in MODES},
            "expanded_over_absorbed": round(best["expanded"] / best["absorbed"], 3),
            "same_greedy_answers": sum(a == b for a, b in zip(*answers.values(), strict=True)),
            "of": len(prompts),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
