"""What structured outputs cost: the throughput workload with and without a JSON-schema
constraint, on one engine, in alternating rounds.

    python bench/structured.py [--rounds 2] [--dtype float32]

The workload of bench/throughput.py (64 requests, prompts of 64..512 tokens, up to 128
output tokens, greedy, ignore_eos) on SmolLM2-135M-Instruct. Constrained, each request must
answer a JSON object `{"title": string, "items": [string, ...]}` with no length limit, so
most run to max_tokens; a request whose JSON closes ends there. Output tokens per second
count the tokens actually generated. Target: constrained at least 0.9x plain.
"""

from __future__ import annotations

import argparse
import json
import time

from common import fixed_workload, progress

MODEL = "smollm2-135m-instruct"
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "items": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "items"],
}


def one_round(llm, prompts: list[list[int]], params) -> tuple[float, list[str]]:  # type: ignore[no-untyped-def]
    """Output tokens per second over the whole batch, and the texts."""
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / seconds, [o.outputs[0].text for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    from pagefleet.engine import LLM, SamplingParams

    workload = fixed_workload()
    llm = LLM(MODEL, dtype=args.dtype, kv_cache_memory=4 << 30, max_num_batched_tokens=1024)
    plain = SamplingParams(temperature=0.0, max_tokens=workload.output_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=workload.output_tokens, ignore_eos=True, structured_outputs={"json": SCHEMA}
    )
    llm.generate(workload.prompts[:2], constrained, use_tqdm=False)  # warm up, and compile the schema once
    best = {"plain": 0.0, "json schema": 0.0}
    closed = 0
    for round_index in range(args.rounds):
        for name, params in (("plain", plain), ("json schema", constrained)):
            progress(f"round {round_index + 1}: {name}")
            rate, texts = one_round(llm, workload.prompts, params)
            best[name] = max(best[name], rate)
            if name == "json schema":
                closed = sum(1 for text in texts if _is_json(text))
    print(
        f"plain {best['plain']:.1f} tok/s | json schema {best['json schema']:.1f} tok/s "
        f"(x{best['json schema'] / best['plain']:.2f}) | {closed}/{len(workload.prompts)} constrained answers "
        "closed their JSON within max_tokens",
        flush=True,
    )


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
