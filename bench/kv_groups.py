"""KV cache groups: how many long sequences a fixed KV budget holds on a Gemma-3-shaped
model, with sliding-window layers in groups of their own (the default) against every layer
keeping every block (`disable_hybrid_kv_cache_manager`, vLLM's flag), in the same run.

    python bench/kv_groups.py [--prompt-tokens 8192] [--budget-gib 2] [--model gemma4-e2b|deepseek-v3] [--engine]

Gemma 3's layer pattern (18 layers, five sliding layers of window 1,024 per global one,
1 KV head of 256 dims, bfloat16): the model's config goes through the engine's own
grouping (`KVGroups`) and block sizing, and the real `KVCacheManager` admits sequences of
`--prompt-tokens` distinct tokens, prefilled in chunks of 2,048 and one decode step each,
until the next one's blocks are not free. Prints both counts and their ratio.

`--model gemma4-e2b`: Gemma 4 E2B's pattern instead (`gemma4_e2b_config`), whose global
layers' keys have another shape and whose last 20 layers hold no cache of their own.

`--model deepseek-v3`: DeepSeek-V3's latent cache (one head of 512 + 64 values per token and
layer) against the same attention cached in full (128 heads of 192-dim keys and 128-dim
values): bytes per token and layer as the engine sizes its blocks, and sequences that fit.

With `--engine`, the real engine confirms it on random weights in the same layer pattern
(hidden 64, so that prefilling takes seconds): as many requests as the grouped cache holds
by the count above, submitted at once on the same KV budget; prints the most sequences
decoding at once and the preemptions, for both settings.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from common import progress
from transformers import Gemma3TextConfig

from pagefleet.engine.core.kv_cache_manager import KVCacheManager
from pagefleet.engine.core.kv_groups import KVGroups
from pagefleet.engine.core.request import Request
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.worker.model_runner import kv_bytes_per_block

BLOCK_SIZE = 16
CHUNK_TOKENS = 2048  # the engine's default max_num_batched_tokens


def gemma3_config(hidden_size: int = 640, head_dim: int = 256) -> dict:
    """Gemma 3 270M's shape (18 layers, window 1,024 as the larger Gemma 3s, pattern 6)."""
    config = Gemma3TextConfig(
        vocab_size=1024,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=head_dim,
        sliding_window=1024,
        max_position_embeddings=32768,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    )
    raw = config.to_dict()
    raw["architectures"] = ["Gemma3ForCausalLM"]
    return raw


def gemma4_e2b_config() -> dict:
    """Gemma 4 E2B's attention shape: 35 layers, four sliding (window 512, 1 KV head of 256)
    per global one (1 KV head of 512), the last 20 layers reading earlier layers' KV."""
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(
        vocab_size=1024,
        hidden_size=1536,
        num_hidden_layers=35,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        num_kv_shared_layers=20,
        sliding_window=512,
        max_position_embeddings=32768,
        layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)],
    )
    return config.to_dict() | {"architectures": ["Gemma4ForCausalLM"]}


def deepseek_v3_config() -> dict:
    """DeepSeek-V3's attention (61 layers, 128 heads, a 512-wide latent and 64 RoPE dims
    cached per token), its experts shrunk: only the cache is measured."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=1024, n_routed_experts=8, n_group=4, topk_group=2, max_position_embeddings=32768
    )
    return config.to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]}


def full_cache_of(config: ModelConfig) -> ModelConfig:
    """The same attention cached in full: every head's keys (nope + rope dims) and values."""
    mla = config.mla
    assert mla is not None
    per_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim  # keys' and values' dims
    return replace(config, mla=None, num_kv_heads=config.num_heads, head_dim=per_head // 2)


SHAPES = {"gemma3": gemma3_config, "gemma4-e2b": gemma4_e2b_config, "deepseek-v3": deepseek_v3_config}


def sequences_that_fit(config: ModelConfig, hybrid: bool, budget_bytes: int, prompt_tokens: int) -> tuple[int, int]:
    """(sequences of `prompt_tokens` the budget holds at once, the pool's block count)."""
    groups = KVGroups.of(config.cache_layer_windows, hybrid)
    block_bytes = kv_bytes_per_block(config, BLOCK_SIZE, torch.bfloat16, None, groups)
    num_blocks = budget_bytes // block_bytes
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True, groups=groups)
    fitted = 0
    while True:
        tokens = [(fitted * 7919 + i) % 1000 for i in range(prompt_tokens)]
        tokens[0] = 1000 + fitted % 24  # distinct from the first token: no prefix is shared
        seq = Request(f"r{fitted}", None, tokens, SamplingParams(), arrival_index=fitted, max_tokens=1).sequences[0]
        for start in range(0, prompt_tokens + 1, CHUNK_TOKENS):
            num_new = min(CHUNK_TOKENS, prompt_tokens + 1 - start)
            if manager.allocate_slots(seq, num_new) is None:
                return fitted, num_blocks
            manager.commit(seq, num_new)
        fitted += 1


def engine_run(model_dir: Path, hybrid: bool, budget_bytes: int, num_requests: int, prompt_tokens: int) -> dict:
    """The real engine on `num_requests` prompts at once: the most decoding together."""
    from pagefleet.engine import LLM

    llm = LLM(
        str(model_dir),
        dtype="bfloat16",
        kv_cache_memory=budget_bytes,
        skip_tokenizer_init=True,
        disable_hybrid_kv_cache_manager=not hybrid,
        separate_process=False,  # stepped here, to watch the scheduler
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for index in range(num_requests):
        prompt = [(index * 7919 + i) % 1000 for i in range(prompt_tokens)]
        prompt[0] = 1000 + index % 24
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, params)
    most_decoding, started = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        decoding = sum(
            engine.kv_cache.num_computed_tokens(r.sequences[0]) >= r.num_prompt_tokens for r in engine.scheduler.running
        )
        most_decoding = max(most_decoding, decoding)
    stats = llm.stats()
    return {
        "most_decoding_at_once": most_decoding,
        "preemptions": stats.num_preemptions_recompute + stats.num_preemptions_swap,
        "seconds": round(time.perf_counter() - started, 1),
        "blocks": stats.num_total_blocks,
    }


def latent_cache_report(config: ModelConfig, budget: int, prompt_tokens: int) -> dict:
    """Bytes per token and layer of the latent cache and of the full one, as the engine sizes
    its blocks, and the sequences of `prompt_tokens` each budget holds."""
    report: dict = {"model": "deepseek-v3", "prompt_tokens": prompt_tokens, "budget_gib": budget / (1 << 30)}
    for name, cached in (("latent", config), ("full", full_cache_of(config))):
        per_token_layer = kv_bytes_per_block(cached, BLOCK_SIZE, torch.bfloat16) // (BLOCK_SIZE * config.num_layers)
        fitted, _ = sequences_that_fit(cached, True, budget, prompt_tokens)
        report[name] = {"bytes_per_token_and_layer": per_token_layer, "sequences": fitted}
        progress(f"{name}: {per_token_layer} bytes per token and layer, {fitted} sequences of {prompt_tokens}")
    report["ratio"] = round(
        report["full"]["bytes_per_token_and_layer"] / report["latent"]["bytes_per_token_and_layer"], 1
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--budget-gib", type=float, default=2.0)
    parser.add_argument("--model", choices=SHAPES, default="gemma3", help="the layer pattern (default: Gemma 3's)")
    parser.add_argument("--engine", action="store_true", help="also run the real engine on random weights (gemma3)")
    args = parser.parse_args()
    budget = int(args.budget_gib * (1 << 30))
    config = ModelConfig.from_hf(SHAPES[args.model]())
    if config.mla:  # the latent cache against the same attention cached in full
        print(json.dumps(latent_cache_report(config, budget, args.prompt_tokens), indent=2))
        return
    counts = {}
    for hybrid in (True, False):
        fitted, blocks = sequences_that_fit(config, hybrid, budget, args.prompt_tokens)
        counts[hybrid] = fitted
        progress(
            f"{'grouped' if hybrid else 'one group'}: {fitted} sequences of {args.prompt_tokens} in {blocks} blocks"
        )
    result: dict = {
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "budget_gib": args.budget_gib,
        "grouped": counts[True],
        "one_group": counts[False],
        "ratio": round(counts[True] / max(counts[False], 1), 2),
    }
    if args.engine:
        small = gemma3_config(hidden_size=64, head_dim=32)
        small_config = ModelConfig.from_hf(small)
        scale = kv_bytes_per_block(small_config, BLOCK_SIZE, torch.bfloat16) / kv_bytes_per_block(
            config, BLOCK_SIZE, torch.bfloat16
        )
        small_budget = int(budget * scale)  # the same number of blocks as the full-size model's budget
        with tempfile.TemporaryDirectory() as directory:
            from transformers import AutoModelForCausalLM

            model_dir = Path(directory)
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(Gemma3TextConfig(**small)).save_pretrained(model_dir)
            (model_dir / "config.json").write_text(json.dumps(small))
            for hybrid in (True, False):
                progress(f"engine, {'grouped' if hybrid else 'one group'}: {counts[True]} requests")
                key = "engine_grouped" if hybrid else "engine_one_group"
                result[key] = engine_run(model_dir, hybrid, small_budget, counts[True], args.prompt_tokens)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
