"""One prompt, many outputs, stored once: best_of, beam search, sharing stats, preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.core.request import Request
from pagefleet.engine.front.llm_engine import LLMEngine
from tests.conftest import NEWER_FAMILIES, TINY_ARCHITECTURES, TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, hf_model, random_prompts

MAX_TOKENS = 10
# (length_penalty, early_stopping): transformers' default, early stopping, and "never"
# with a penalty that favours long beams (its other heuristic).
BEAM_SETTINGS = [(1.0, False), (0.5, True), (2.0, "never")]


def _hf_beams(model_dir: Path, prompt: list[int], k: int, length_penalty: float, early_stopping: bool | str, stop: int):
    """transformers' k best beams, each cut after its stop token."""
    with torch.no_grad():
        sequences = hf_model(model_dir).generate(
            torch.tensor([prompt]),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=stop,
            pad_token_id=stop,
        )
    beams = []
    for row in sequences[:, len(prompt) :].tolist():
        beams.append(row[: row.index(stop) + 1] if stop in row else row)
    return beams


def _beam_params(k: int, length_penalty: float = 1.0, early_stopping: bool | str = False, **kwargs) -> SamplingParams:
    return SamplingParams(
        n=k,
        use_beam_search=True,
        beam_width=k,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        **{"max_tokens": MAX_TOKENS, **kwargs},
    )


# The newer families add nothing to the blocks beams share: one width is enough for them.
BEAM_CASES = [(arch, k) for arch in TINY_ARCHITECTURES for k in (1, 2, 4) if k == 4 or arch not in NEWER_FAMILIES]


@pytest.mark.parametrize(("arch", "k"), BEAM_CASES)
def test_beam_search_equals_transformers(tiny_models: dict[str, Path], arch: str, k: int) -> None:
    model_dir = tiny_models[arch]
    llm = LLM(str(model_dir), dtype="float32", block_size=4)
    prompts = random_prompts([5, 17, 33, 9], TINY_VOCAB, seed=1)
    # A stop token the beams really emit (the third token of prompt 0's best beam), so some
    # beams finish early and the finished-beam ranking is exercised, not only the length limit.
    best = llm.generate(prompts[0], _beam_params(k, *BEAM_SETTINGS[0]))[0].outputs[0]
    stop = best.token_ids[2]
    finished_early = 0
    for length_penalty, early_stopping in BEAM_SETTINGS:
        params = _beam_params(k, length_penalty, early_stopping, stop_token_ids=[stop])
        for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
            expected = _hf_beams(model_dir, prompt, k, length_penalty, early_stopping, stop)
            assert [c.token_ids for c in output.outputs] == expected, (
                f"{len(prompt)}-token prompt, length_penalty={length_penalty}, early_stopping={early_stopping}"
            )
            finished_early += sum(c.finish_reason == "stop" for c in output.outputs)
    assert finished_early > 0, "no beam ended on the stop token"
    assert_no_block_leaked(llm)


def _check_block_accounting(engine: LLMEngine, request: Request) -> None:
    """Every reference in the pool belongs to a live beam; shared blocks exist once."""
    pool = engine.kv_cache.pool
    tables = [engine.kv_cache.block_table(seq) for seq in request.sequences]
    distinct = {block_id for table in tables for block_id in table}
    assert sum(block.ref_count for block in pool.blocks) == sum(len(t) for t in tables)
    assert engine.kv_cache.num_free_blocks == pool.num_blocks - len(distinct)


def test_beams_share_blocks_and_free_pruned_ones_at_once(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, enable_prefix_caching=False)
    engine = llm.engine
    (prompt,) = random_prompts([14], TINY_VOCAB, seed=2)  # 3 full blocks and 2 tokens
    request = engine.add_request("beams", prompt, _beam_params(4, max_tokens=24, ignore_eos=True))
    pruned = 0
    saw_four_beams = False
    while engine.has_unfinished_requests():
        before = list(request.sequences)
        engine.step()
        pruned += sum(1 for seq in before if not any(seq is s for s in request.sequences))
        if request.generation_ended:
            break
        _check_block_accounting(engine, request)
        if len(request.sequences) == 4:
            saw_four_beams = True
            prompt_blocks = engine.kv_cache.block_table(request.sequences[0])[:3]
            assert all(engine.kv_cache.block_table(seq)[:3] == prompt_blocks for seq in request.sequences)
            assert [engine.kv_cache.pool.ref_count(b) for b in prompt_blocks] == [4, 4, 4]
            stats = engine.stats()
            assert stats.num_shared_blocks >= 3 and stats.num_blocks_saved_by_sharing >= 9
    assert saw_four_beams and pruned > 0, "the search should have dropped beams mid-way"
    assert engine.stats().num_cow_copies > 0
    assert engine.stats().num_shared_blocks == 0
    assert_no_block_leaked(llm)


def test_best_of_returns_the_n_most_likely_samples(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4)
    (prompt,) = random_prompts([11], TINY_VOCAB, seed=3)
    sampling = dict(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    # logprobs=0: the plain samples carry their cumulative logprob too (as in vLLM, only
    # outputs that asked for logprobs, or that were ranked by it, do).
    everyone = llm.generate(prompt, SamplingParams(n=4, logprobs=0, **sampling))[0].outputs
    best = llm.generate(prompt, SamplingParams(n=2, best_of=4, **sampling))[0].outputs
    assert all(c.cumulative_logprob is not None for c in everyone + best)
    assert llm.generate(prompt, SamplingParams(n=2, **sampling))[0].outputs[0].cumulative_logprob is None
    ranked = sorted(everyone, key=lambda c: -(c.cumulative_logprob or 0.0))
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1]
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_survives_preemption(tiny_llama: Path, mode: str) -> None:
    prompts = random_prompts([14, 9, 22], TINY_VOCAB, seed=4)
    params = _beam_params(4, max_tokens=16, ignore_eos=True)
    roomy = LLM(str(tiny_llama), dtype="float32", block_size=4)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.beam_search(prompts, 4, max_tokens=16, ignore_eos=True)]
    tight = LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=30, preemption_mode=mode)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)]
    assert got == expected
    stats = tight.stats()
    preemptions = stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute
    assert preemptions > 0, "the tiny cache forced no preemption"
    assert_no_block_leaked(tight)


def test_without_sharing_each_sequence_owns_its_blocks(tiny_llama: Path) -> None:
    """Same beams and samples either way; sharing only changes how many blocks they take."""
    (prompt,) = random_prompts([30], TINY_VOCAB, seed=5)
    workloads = [_beam_params(4, max_tokens=12, ignore_eos=True), SamplingParams(n=4, seed=1, max_tokens=12)]
    peaks, results = [], []
    for sharing in (True, False):
        llm = LLM(str(tiny_llama), dtype="float32", block_size=4, enable_block_sharing=sharing)
        outputs = [llm.generate(prompt, params)[0] for params in workloads]
        assert_no_block_leaked(llm)
        peaks.append(llm.stats().peak_used_blocks)
        results.append([[c.token_ids for c in o.outputs] for o in outputs])
    assert results[0] == results[1]
    # 30 tokens = 8 blocks of 4: stored once and shared, or copied by each of 4 sequences.
    assert peaks[0] < peaks[1] and peaks[1] >= 4 * 8


def test_beam_search_rejects_sampling_fields() -> None:
    for field, value in [("top_p", 0.5), ("top_k", 5), ("repetition_penalty", 1.2), ("logprobs", 1)]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(use_beam_search=True, beam_width=2, **{field: value})
    with pytest.raises(ValueError, match="n"):
        SamplingParams(use_beam_search=True, beam_width=2, n=3)
    with pytest.raises(ValueError, match="early_stopping"):
        SamplingParams(use_beam_search=True, beam_width=2, early_stopping="sometimes")
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
