"""The engine on the Triton kernels (interpreted on this CPU, some 50x slower than
compiled) is exact too: greedy output equals transformers' (eager, float32) token for token.
One schedule runs every kernel path; the other cases cover what only a model family brings
(wider heads, sliding and global layers, soft caps, sinks, latent and chunked attention,
copy-on-write). A module of its own, so that it runs beside test_exactness.py's CPU cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagefleet.engine import LLM
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, random_prompts
from tests.engine.test_exactness import PROMPT_LENGTHS, SCHEDULES, _assert_matches_hf, _greedy

# Past the prefill, a few decodes run the decode kernel as well as twelve would.
TRITON_NEW_TOKENS = 5


@pytest.mark.triton
def test_triton_backend_equals_transformers(tiny_llama: Path) -> None:
    """The engine on the Triton kernels (interpreted on this CPU) is exact too. One schedule
    runs every kernel path (the interpreter is slow): whole and chunked prefills, chunks over
    cached context, decodes, swapping out and back, then a prefix-cache hit."""
    llm = LLM(
        str(tiny_llama),
        dtype="float32",
        attention_backend="triton",
        max_num_batched_tokens=16,
        **SCHEDULES["preempt_swap"],
    )
    assert llm.engine.runner.backend.name == "triton"
    prompts = random_prompts(PROMPT_LENGTHS, TINY_VOCAB)
    shared = prompts[4][:40]  # after the batch, a prefix-cache hit: a chunk after a cached prefix
    outputs = llm.generate(prompts, _greedy()) + llm.generate([shared + [5, 6, 7]], _greedy())
    _assert_matches_hf(tiny_llama, prompts + [shared + [5, 6, 7]], outputs)
    assert llm.stats().num_preemptions_swap > 0, "the tiny cache forced no swap"
    assert outputs[-1].usage.cached_prompt_tokens > 0
    assert_no_block_leaked(llm)


@pytest.mark.triton
def test_triton_backend_with_qwen3s_wider_heads(tiny_models: dict[str, Path]) -> None:
    """Qwen3's head_dim (32) is not hidden / heads (16), and its q/k norms sit before the
    kernels: whole prefills and decodes suffice (the schedule's paths ran above)."""
    llm = LLM(str(tiny_models["qwen3"]), dtype="float32", attention_backend="triton")
    prompts = random_prompts(PROMPT_LENGTHS[:3], TINY_VOCAB)
    outputs = llm.generate(prompts, _greedy(TRITON_NEW_TOKENS))
    _assert_matches_hf(tiny_models["qwen3"], prompts, outputs, TRITON_NEW_TOKENS)
    assert_no_block_leaked(llm)


@pytest.mark.triton
def test_triton_backend_sliding_window(tiny_mistral_window: Path) -> None:
    llm = LLM(str(tiny_mistral_window), dtype="float32", attention_backend="triton", max_num_batched_tokens=16)
    prompts = random_prompts(PROMPT_LENGTHS, TINY_VOCAB, seed=7)
    outputs = llm.generate(prompts, _greedy(TRITON_NEW_TOKENS))
    _assert_matches_hf(tiny_mistral_window, prompts, outputs, TRITON_NEW_TOKENS)
    assert_no_block_leaked(llm)


@pytest.mark.triton
@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_triton_backend_interleaved_windows_with_soft_caps_or_sinks(tiny_models: dict[str, Path], arch: str) -> None:
    """Sliding and global layers in one step, prompts longer than the window (8), and in the
    kernels Gemma 2's soft-capped scores or gpt-oss's sinks."""
    llm = LLM(str(tiny_models[arch]), dtype="float32", attention_backend="triton")
    prompts = random_prompts([17, 33], TINY_VOCAB, seed=7)
    outputs = llm.generate(prompts, _greedy(TRITON_NEW_TOKENS))
    _assert_matches_hf(tiny_models[arch], prompts, outputs, TRITON_NEW_TOKENS)
    assert_no_block_leaked(llm)


@pytest.mark.triton
@pytest.mark.parametrize("arch", ["deepseek_v3", "llama4"])
def test_triton_backend_latent_and_chunked_attention(tiny_models: dict[str, Path], arch: str) -> None:
    """DeepSeek-V3's latent cache (one 48-wide head that the kernels read as keys and values)
    and Llama 4's chunked layers (8 positions) beside its global ones, chunked prefills."""
    llm = LLM(str(tiny_models[arch]), dtype="float32", attention_backend="triton", max_num_batched_tokens=16)
    prompts = random_prompts([17, 33], TINY_VOCAB, seed=7)
    outputs = llm.generate(prompts, _greedy(TRITON_NEW_TOKENS))
    _assert_matches_hf(tiny_models[arch], prompts, outputs, TRITON_NEW_TOKENS)
    assert_no_block_leaked(llm)


@pytest.mark.triton
def test_triton_backend_copy_on_write(tiny_llama: Path) -> None:
    """Beams fork mid-block, so copy_blocks runs; results equal the torch backend's."""
    prompts = random_prompts([13, 6], TINY_VOCAB, seed=11)
    beams = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama), dtype="float32", block_size=4, attention_backend=backend)
        beams[backend] = [[c.token_ids for c in o.outputs] for o in llm.beam_search(prompts, 4, max_tokens=8)]
        assert llm.stats().num_cow_copies > 0
        assert_no_block_leaked(llm)
    assert beams["triton"] == beams["torch"]


@pytest.mark.triton
@pytest.mark.parametrize("arch", ["qwen3_5", "granite4"])
def test_triton_backend_chunks_a_linear_attention_prompt_and_keeps_one_answer(tmp_path: Path, arch: str) -> None:
    """Qwen3.5's Gated DeltaNet layers and Granite 4's Mamba-2 layers on the Triton path run
    a prompt's whole blocks in the chunked form (a block a chunk) and the rest token by
    token; the scheduler ends a prompt's
    chunks at block multiples (a budget of 20 cuts at 16). Transformers' greedy tokens,
    batched and chunked; a prompt resumed from its prefix snapshot is cut at the same places
    as its cold run: the same bits."""
    from tests.conftest import build_tiny_model

    model_dir = build_tiny_model(arch, tmp_path / arch)
    settings = dict(dtype="float32", attention_backend="triton", block_size=8)
    batched = LLM(str(model_dir), max_num_batched_tokens=20, **settings)  # type: ignore[arg-type]
    assert batched.engine.runner.state_chunk_size == 8 and batched.engine.kv_cache.state_chunk_size == 8
    prompts = random_prompts([33, 17, 5], TINY_VOCAB, seed=15)
    outputs = batched.generate(prompts, _greedy(TRITON_NEW_TOKENS))
    _assert_matches_hf(model_dir, prompts, outputs, TRITON_NEW_TOKENS)
    alone = LLM(str(model_dir), **settings)  # type: ignore[arg-type]
    first = alone.generate([prompts[0]], _greedy(TRITON_NEW_TOKENS))[0]
    resumed = alone.generate([prompts[0]], _greedy(TRITON_NEW_TOKENS))[0]  # from the snapshot at 32
    assert resumed.num_cached_tokens == 32
    assert resumed.outputs[0].logprobs == first.outputs[0].logprobs
    assert first.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert_no_block_leaked(batched)
    assert_no_block_leaked(alone)
