"""One answer per prompt: for every weight format the engine serves, a greedy answer is token
for token the prompt's cold answer (computed alone, nothing cached) whatever path computed
it or brought its KV: a prefix-cache hit, a batch with seven other prompts, 32-token prefill
chunks, preemption by recompute and by swap, a prefill/decode transfer, a read from the KV
file tier, ngram and suffix speculation. SmolLM2's own Q4_1 file (float32 activations, the
default users get), tiny models for the other formats, a tiny Gemma 3 whose cache has
KV groups (a sliding-window group beside a full one), and mixtures of experts (DeepSeek-V3's
latent cache, gpt-oss's sinks, Qwen3-MoE's bfloat16 experts on AMX tiles); each format's
engines are built once for all its paths."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.loader.int8_convert import convert
from tests.conftest import TINY_VOCAB, build_tiny_model
from tests.engine.helpers import assert_no_block_leaked, random_prompts, same_kv_memory
from tests.engine.test_gguf_files import write_gpt2_gguf, write_mixed_llama_gguf
from tests.engine.test_kv_transfer import _pull

NEW_TOKENS = 16
PATHS = [
    "prefix_cached",
    "batch_of_8",
    "chunks_of_32",
    "preempt_recompute",
    "preempt_swap",
    "pd_transfer",
    "file_tier",
    "ngram",
    "suffix",
]
QUESTIONS = [
    "What is the capital of France?",
    "Repeat the sentence twice: The quick brown fox jumps over the lazy dog.",
    "Name three primary colors.",
    "Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape.",
    "Who wrote Romeo and Juliet?",
    "What is 12 times 7?",
    "Spell the word 'necessary' letter by letter.",
    "Translate 'thank you' to Spanish.",
]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _answers(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    return [list(o.outputs[0].token_ids) for o in outputs]


def _pd_answers(model: str, settings: dict, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt prefilled by one engine, its KV pulled by another that decodes."""
    prefill, decode = LLM(model, kv_role="prefill", **settings), LLM(model, kv_role="decode", **settings)
    answers = []
    for index, prompt in enumerate(prompts):
        remote = _pull(prefill, prompt)
        decode.engine.add_request(f"pd-{index}", {"prompt_token_ids": prompt}, _greedy(), remote)
        outputs = []
        while decode.engine.has_unfinished_requests():
            outputs += decode.engine.step()
        answers.append(list(outputs[-1].outputs[0].token_ids))
    for llm in (prefill, decode):
        assert_no_block_leaked(llm)
    return answers


def _run_paths(model: str, settings: dict, prompts: list[list[int]], tier: Path) -> dict[str, list[list[int]]]:
    """Every path's greedy answers to `prompts`, and the cold ones under "cold"."""
    answers: dict[str, list[list[int]]] = {}
    base = LLM(model, **settings)
    cold, cached = [], []
    for prompt in prompts:
        assert base.reset_prefix_cache()
        cold += _answers(base, [prompt])
        cached += _answers(base, [prompt])
    assert base.stats().prefix_cache_hits > 0
    answers["cold"], answers["prefix_cached"] = cold, cached
    assert_no_block_leaked(base)
    del base

    writer = LLM(model, kv_cache_dir=str(tier), **settings)
    answers["batch_of_8"] = _answers(writer, prompts)
    assert_no_block_leaked(writer)
    reader = LLM(model, kv_cache_dir=str(tier), **settings)
    answers["file_tier"] = _answers(reader, prompts)
    tier_stats = reader.stats().kv_tier
    assert tier_stats is not None and tier_stats.hits > 0, "the file tier served nothing"
    assert_no_block_leaked(reader)
    del writer, reader

    chunked = LLM(model, max_num_batched_tokens=32, enable_prefix_caching=False, **settings)
    answers["chunks_of_32"] = _answers(chunked, prompts)
    assert_no_block_leaked(chunked)
    del chunked

    needed_blocks = (max(len(p) for p in prompts) + NEW_TOKENS) // 16 + 1  # the longest request fits alone
    cache = {k: v for k, v in settings.items() if k not in ("num_kv_blocks", "kv_cache_memory")}
    for mode in ("recompute", "swap"):
        small = LLM(model, preemption_mode=mode, **same_kv_memory(model, {"num_kv_blocks": needed_blocks + 2}), **cache)
        answers[f"preempt_{mode}"] = _answers(small, prompts)
        stats = small.stats()
        preemptions = stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute
        assert preemptions > 0, f"the small cache forced no preemption by {mode}"
        assert_no_block_leaked(small)
        del small

    answers["pd_transfer"] = _pd_answers(model, settings, prompts)

    for method, config in {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    }.items():
        speculating = LLM(model, speculative_config=config, enable_prefix_caching=False, **settings)
        answers[method] = _answers(speculating, prompts)
        spec_stats = speculating.stats().spec_decode
        assert spec_stats is not None and spec_stats.num_drafts > 0, f"{method} proposed no draft"
        assert_no_block_leaked(speculating)
        del speculating
    return answers


def _repetitive_prompts() -> list[list[int]]:
    """Random tokens whose runs repeat (so that drafts are found), 20 to 80 tokens."""
    runs = random_prompts([5, 9, 4, 12, 7, 6, 11, 8], TINY_VOCAB, seed=50)
    return [(run * 8)[: 20 + 8 * i] for i, run in enumerate(runs)]


def _tiny_llama(root: Path) -> Path:
    return build_tiny_model("llama", root / "llama")


FORMATS: dict[str, Callable[[Path], tuple[str, dict]]] = {
    "float32": lambda root: (str(_tiny_llama(root)), {"dtype": "float32"}),
    "bfloat16": lambda root: (str(_tiny_llama(root)), {"dtype": "bfloat16"}),
    "Q4_1-smollm2-float32": lambda root: ("smollm2-135m-instruct", {"dtype": "float32"}),
    "Q4_1-bfloat16": lambda root: (
        str(write_mixed_llama_gguf(_tiny_llama(root), root / "q4_1.gguf", uniform="Q4_1")),
        {"dtype": "bfloat16"},
    ),
    "Q8_0-float32": lambda root: (
        str(write_mixed_llama_gguf(_tiny_llama(root), root / "q8_0.gguf", uniform="Q8_0")),
        {"dtype": "float32"},
    ),
    "Q8_0-bfloat16": lambda root: (
        str(write_mixed_llama_gguf(_tiny_llama(root), root / "q8_0.gguf", uniform="Q8_0")),
        {"dtype": "bfloat16"},
    ),
    "Q4_K": lambda root: (str(_wide_gpt2_k_quants(root)), {"dtype": "float32"}),
    "W8A8": lambda root: (str(_w8a8(root)), {"dtype": "float32"}),
    # KV cache groups: a sliding layer (window 8) beside a global one; transfers and the file
    # tier move each group's blocks (a sliding group's last window only).
    "gemma3-kv-groups": lambda root: (str(build_tiny_model("gemma3", root / "gemma3")), {"dtype": "float32"}),
    # Gemma 4: global keys of another shape on padded pages, KV-shared layers holding no cache.
    "gemma4-kv-groups": lambda root: (str(build_tiny_model("gemma4", root / "gemma4")), {"dtype": "float32"}),
    # Mixtures of experts: DeepSeek-V3's latent cache (one head, its values the keys' tensor)
    # moved by every path; gpt-oss's sinks on sliding and full layers.
    "deepseek-latent": lambda root: (str(build_tiny_model("deepseek_v3", root / "ds")), {"dtype": "float32"}),
    "gpt-oss-sinks": lambda root: (str(build_tiny_model("gpt_oss", root / "oss")), {"dtype": "float32"}),
    # bfloat16 experts of whole AMX tiles: on AMX CPUs packed for them (kernels/amx_tiles.py).
    "qwen3-moe-bfloat16": lambda root: (str(build_tiny_model("qwen3_moe", root / "qwen3_moe")), {"dtype": "bfloat16"}),
}


def _wide_gpt2_k_quants(root: Path) -> Path:
    """A one-layer GPT-2 256 wide (the K formats' super-blocks), projections in Q4_K/Q5_K/Q6_K."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.conftest import _build_tokenizer

    torch.manual_seed(0)
    config = GPT2Config(n_embd=256, n_layer=1, n_head=4, n_positions=512, vocab_size=TINY_VOCAB, bos_token_id=None)
    GPT2LMHeadModel(config).save_pretrained(root / "wide-gpt2")
    _build_tokenizer().save_pretrained(root / "wide-gpt2")
    return write_gpt2_gguf(root / "wide-gpt2", root / "wide-gpt2-K.gguf", k_quant_projections=True)


def _w8a8(root: Path) -> Path:
    convert(_tiny_llama(root), root / "w8a8", smoothing=0)
    return root / "w8a8"


@functools.cache
def _smollm2_prompts() -> tuple[tuple[int, ...], ...]:
    from transformers import AutoTokenizer

    from pagefleet.engine.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct"))
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    return tuple(tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, list[list[int]]]]:
    """Each format's answers by path, computed the first time a test asks for the format."""

    @functools.cache
    def of(format_name: str) -> dict[str, list[list[int]]]:
        root = tmp_path_factory.mktemp(format_name)
        model, settings = FORMATS[format_name](root)
        smollm2 = model == "smollm2-135m-instruct"
        prompts = [list(p) for p in _smollm2_prompts()] if smollm2 else _repetitive_prompts()
        cache = {"kv_cache_memory": 64 << 20} if smollm2 else {"num_kv_blocks": 64}
        settings = {"block_size": 16, **settings, **cache}
        return _run_paths(model, settings, prompts, root / "kv-tier")

    return of


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("format_name", list(FORMATS))
def test_greedy_tokens_are_the_cold_ones_whatever_the_path(
    results: Callable[[str], dict[str, list[list[int]]]], format_name: str, path: str
) -> None:
    answers = results(format_name)
    assert sum(len(set(a)) > 3 for a in answers["cold"]) >= 6, "degenerate output proves nothing"
    differing = [i for i, (a, b) in enumerate(zip(answers["cold"], answers[path], strict=True)) if a != b]
    assert not differing, f"prompts {differing} changed their answer on {path}"
