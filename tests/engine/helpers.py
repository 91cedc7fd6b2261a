"""Shared helpers for engine tests: transformers references and the no-leak check."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch

from pagefleet.engine import LLM
from pagefleet.engine.core.kv_groups import KVGroups
from pagefleet.engine.models.config import ModelConfig


@cache
def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and the log-probability of each chosen token."""
    model = hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return [logprobs[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]


def assert_no_block_leaked(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_running_requests == 0 and stats.num_waiting_requests == 0
    assert stats.num_free_blocks == stats.num_total_blocks, (
        f"{stats.num_total_blocks - stats.num_free_blocks} KV blocks leaked"
    )
    pool = llm.engine.kv_cache.pool
    assert all(block.ref_count == 0 for block in pool.blocks)
    assert llm.engine.kv_cache.num_free_host_blocks == llm.engine.kv_cache.num_host_blocks


def same_kv_memory(model: Path | str, settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with its `num_kv_blocks` scaled to the same bytes of KV whatever the
    model's KV cache groups: a block holds one group's layers, so a model with a sliding
    and a global layer gets twice the blocks of half the size. (A GGUF file or a built-in
    name is a Llama or GPT-2 here: one group.)"""
    scaled = dict(settings)
    model_dir = Path(model)
    if "num_kv_blocks" in scaled and (model_dir / "config.json").is_file():
        scaled["num_kv_blocks"] *= KVGroups.of(ModelConfig.from_dir(model_dir).cache_layer_windows).num_groups
    return scaled
