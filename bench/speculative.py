"""Speculative decoding (n-gram prompt lookup, suffix decoding) against none, same run.

    python bench/speculative.py [--workloads extractive,structured,chat] [--concurrency 1,16,64]
                                [--temperatures 0] [--methods ngram,suffix] [--dtype float32]
                                [--max-tokens 128] [--rounds 1]

SmolLM2-135M-Instruct, offline: `--concurrency` c requests of one workload are queued at
once and run to the end (c = 1 runs eight requests one after the other). Workloads:
`extractive` (repeat a given text: the Zen of Python, from the standard library's `this`),
`structured` (JSON records of a given shape, which repeat their keys), `chat` (open
questions; little to copy). For each cell: output tokens/s, TPOT p50/p99 (time between a
request's first and last token over its tokens after the first) and the mean tokens per
speculating step, with speculation (each of `--methods`) and without, and the ratios. The
engine runs at its defaults plus `speculative_config` (`METHODS` below), with the weights
dequantized (`quantization="none"`); the load switch decides per step. Outputs (greedy,
and seeded sampling) are checked token for token against the run without speculation.
Targets (issue 36): extractive at concurrency 1, TPOT at most 0.5x; structured at
concurrency 1 with suffix, at most 0.6x; chat at every concurrency and every workload at
concurrency 64, throughput at least 0.97x.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import statistics
import time

from common import progress

MODEL = "smollm2-135m-instruct"
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix"},  # vLLM's defaults: up to 24 drafts
}
with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints it
    import this
ZEN = codecs.decode(this.s, "rot13").splitlines()[2:]
TOPICS = ["the sea", "mountains", "bread", "trains", "music", "winter", "bees", "libraries"]
ASKS = [
    "Tell me something interesting about",
    "Explain to a child",
    "Write a poem about",
    "What surprises people about",
]
SHAPES = ["name, age, city", "title, author, year", "city, country, population", "product, price, stock"]
SUBJECTS = ["engineers", "novels", "capitals", "tools", "painters", "films", "rivers", "fruits", "cars", "songs"]
COPY_ASKS = ["Repeat the following text exactly, line by line:", "Copy this text word for word:", "Quote this back:"]


def prompts(workload: str, count: int) -> list[list[dict[str, str]]]:
    """`count` different requests of one workload (up to 64 and more, no two alike: suffix
    decoding must not find a request's own answer in an earlier one's)."""
    chats = []
    for index in range(count):
        if workload == "extractive":
            start, lines = index % 12, 6 + (index // 12) % 3
            text = "\n".join(ZEN[start : start + lines])
            content = f"{COPY_ASKS[(index // 36) % len(COPY_ASKS)]}\n\n{text}"
        elif workload == "structured":
            shape, subject = SHAPES[index % 4], SUBJECTS[(index // 4) % 10]
            content = (
                f"Write {8 - 2 * (index // 40)} JSON records about {subject} with the fields {shape}, one per line."
            )
        else:
            ask, topic = ASKS[index % 4], TOPICS[(index // 4) % 8]
            content = f"{ask} {topic}, in {2 + index // 32} sentences."
        chats.append([{"role": "user", "content": content}])
    return chats


def run(llm, chats: list, concurrency: int, temperature: float, max_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    """Tokens/s, TPOTs and outputs of `chats`, `concurrency` at a time."""
    from pagefleet.engine import RequestOutputKind, SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
    tpots, outputs, total = [], {}, 0
    started = time.perf_counter()
    for first in range(0, len(chats), concurrency):
        times: dict[str, list[float]] = {}
        for index, chat in enumerate(chats[first : first + concurrency], start=first):
            engine.add_request(f"r{index}", llm.apply_chat_template(chat), params)
            outputs[f"r{index}"] = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                new = output.outputs[0].token_ids if output.outputs else []
                if new:
                    now = time.perf_counter()
                    times.setdefault(output.request_id, []).extend([now] * len(new))
                    outputs[output.request_id].extend(new)
        for stamps in times.values():
            total += len(stamps)
            if len(stamps) > 1:
                tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    seconds = time.perf_counter() - started
    tpots.sort()
    return {
        "tokens_per_s": total / seconds,
        "tpot_p50": statistics.median(tpots),
        "tpot_p99": tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))],
        "outputs": [outputs[key] for key in sorted(outputs, key=lambda k: int(k[1:]))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="extractive,structured,chat")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--temperatures", default="0")
    parser.add_argument("--methods", default="ngram", help="of ngram, suffix")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="runs per engine and cell; the best counts")
    args = parser.parse_args()
    from pagefleet.engine import LLM

    configs = {"none": None} | {method: METHODS[method] for method in args.methods.split(",")}
    print(
        "workload   | conc | temp | method | tok/s none / method | ratio | TPOT p50 none / method | ratio "
        "| p99 ratio | tokens/draft step | equal"
    )
    for workload in args.workloads.split(","):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            chats = prompts(workload, 8 if concurrency == 1 else concurrency)
            for temperature in (float(t) for t in args.temperatures.split(",")):
                cell: dict[str, dict] = {}
                for round_index in range(args.rounds):  # the engines alternate; each keeps its best round
                    for name, config in configs.items():
                        # A fresh engine per run: no prefix cache or suffix history from another.
                        # Dequantized weights: a quantized step's matmul path depends on its
                        # row count, so outputs could not be compared token for token.
                        llm = LLM(MODEL, dtype=args.dtype, speculative_config=config, quantization="none")
                        run(llm, prompts("chat", 2), 2, 0.0, 16)  # warm-up
                        before = llm.stats().spec_decode
                        progress(f"{workload} c={concurrency} t={temperature} {name} round {round_index + 1}")
                        result = run(llm, chats, concurrency, temperature, args.max_tokens)
                        after = llm.stats().spec_decode
                        if before is not None and after is not None:
                            drafts = after.num_drafts - before.num_drafts
                            accepted = after.num_accepted_tokens - before.num_accepted_tokens
                            result["per_step"] = (drafts + accepted) / drafts if drafts else 0.0
                        llm.shutdown()
                        if name not in cell or result["tokens_per_s"] > cell[name]["tokens_per_s"]:
                            cell[name] = result
                none = cell.pop("none")
                for name, other in cell.items():
                    equal = sum(a == b for a, b in zip(none["outputs"], other["outputs"], strict=True))
                    print(
                        f"{workload:10s} | {concurrency:4d} | {temperature:4.1f} | {name:6s} | "
                        f"{none['tokens_per_s']:6.1f} / {other['tokens_per_s']:6.1f} | "
                        f"{other['tokens_per_s'] / none['tokens_per_s']:5.2f}x | "
                        f"{none['tpot_p50'] * 1000:6.1f} / {other['tpot_p50'] * 1000:6.1f} ms | "
                        f"{other['tpot_p50'] / none['tpot_p50']:5.2f}x | "
                        f"{other['tpot_p99'] / none['tpot_p99']:5.2f}x | "
                        f"{other.get('per_step', 0.0):5.2f} | {equal}/{len(chats)}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
