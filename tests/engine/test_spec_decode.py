"""Speculative decoding without a draft model (`speculative_config={"method": "ngram"}`):
what users rely on is that it changes nothing but speed. Greedy output is token for token
the output without it; a seeded sampled request gives the same tokens (the verifier draws
one random number per emitted token, in the same order); penalties, logit bias, min_tokens,
stops, logprobs and structured outputs behave as without it; requests that cannot
speculate (n > 1, beams) run beside those that do; no block is leaked."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.core.request import Request
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.sample.structured_outputs import StructuredOutputsParams
from pagefleet.engine.spec_decode.load_switch import LoadSwitch
from pagefleet.engine.spec_decode.ngram import propose_ngram
from pagefleet.engine.spec_decode.suffix import RecentOutputs, propose_suffix
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat runs of tokens (as extractive answers copy their prompt), so
    drafts are found; the tiny random model accepts some and rejects others."""
    runs = random_prompts([6, 9, 4, 12], TINY_VOCAB, seed=31)
    return [run * 4 + run[:2] for run in runs] + random_prompts([20, 33], TINY_VOCAB, seed=32)


@pytest.fixture(scope="module")
def pair(tiny_llama: Path) -> tuple[LLM, LLM]:
    """The tiny Llama without and with speculation (a small cache: drafts need blocks too)."""
    args = {"dtype": "float32", "num_kv_blocks": 64}
    return LLM(str(tiny_llama), **args), LLM(str(tiny_llama), speculative_config=NGRAM, **args)


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_output_equals_the_output_without_speculation(pair: tuple[LLM, LLM]) -> None:
    """The tiny random model rarely repeats itself: its drafts are rejected and rolled back."""
    plain, speculating = pair
    prompts = _repetitive_prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 23, 57, 31, 40, 9)]
    assert _tokens(speculating, prompts, params) == _tokens(plain, prompts, params)
    stats = speculating.stats().spec_decode
    assert stats is not None and stats.num_drafts > 0
    for llm in pair:
        assert_no_block_leaked(llm)


EXTRACTIVE = [
    "Copy this list exactly, one item per line: apple, banana, cherry, date, elderberry, fig, grape.",
    "Repeat the sentence twice: The quick brown fox jumps over the lazy dog.",
    "Write the numbers from 1 to 25, separated by commas.",
]


FRUITS_AS_JSON = "Put these fruits in a JSON list under the key fruits: apple, banana, cherry, date, fig, grape."
FRUITS = {
    "type": "object",
    "properties": {"fruits": {"type": "array", "items": {"type": "string"}}},
    "required": ["fruits"],
}


@pytest.fixture(scope="module")
def smollm2_speculating() -> LLM:
    # The `smollm2` fixture's dequantized float32 weights, to compare token for token.
    return LLM(
        "smollm2-135m-instruct",
        dtype="float32",
        quantization="none",
        kv_cache_memory=128 << 20,
        speculative_config=NGRAM,
    )


def test_smollm2_copies_its_prompt_with_accepted_drafts_and_the_same_tokens(
    smollm2: LLM, smollm2_speculating: LLM
) -> None:
    """Extractive prompts (the answer copies the prompt): most drafts are accepted, and
    greedy, seeded sampling, penalties, logit bias, min_tokens, stop tokens, logprobs and a
    JSON schema give what they give without speculation."""
    chats = [[{"role": "user", "content": text}] for text in [*EXTRACTIVE, FRUITS_AS_JSON]]
    comma = smollm2.get_tokenizer().encode(",")[0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0.8, seed=7, max_tokens=40, repetition_penalty=1.1, logit_bias={comma: 1.5}),
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=10, stop_token_ids=[comma], frequency_penalty=0.1),
        # Drafts a grammar refuses are cut before verification; each position is masked.
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=FRUITS)),
    ]
    expected = smollm2.chat(chats, params)
    got = smollm2_speculating.chat(chats, params)
    for want, have in zip(expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert (have.outputs[0].text, have.outputs[0].finish_reason) == (
            want.outputs[0].text,
            want.outputs[0].finish_reason,
        )
    want_logprobs, have_logprobs = expected[0].outputs[0].logprobs, got[0].outputs[0].logprobs
    assert want_logprobs is not None and have_logprobs is not None
    for want_position, have_position in zip(want_logprobs, have_logprobs, strict=True):
        assert have_position.keys() == want_position.keys()
        for token, value in want_position.items():
            assert have_position[token].logprob == pytest.approx(value.logprob, abs=1e-4)
    stats = smollm2_speculating.stats().spec_decode
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    per_position = stats.accepted_per_position  # a later position is reached only past the earlier
    assert per_position[0] > 0 and per_position == sorted(per_position, reverse=True)
    assert_no_block_leaked(smollm2_speculating)
    assert_no_block_leaked(smollm2)


def test_requests_that_cannot_speculate_run_beside_those_that_do(pair: tuple[LLM, LLM]) -> None:
    plain, speculating = pair
    prompts = _repetitive_prompts()[:3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),  # speculates
        SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=24, ignore_eos=True),  # n > 1: does not
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ]
    expected = plain.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = speculating.generate([{"prompt_token_ids": p} for p in prompts], params)
    for want, have in zip(expected, got, strict=True):
        assert [o.token_ids for o in have.outputs] == [o.token_ids for o in want.outputs]
    assert_no_block_leaked(speculating)


def test_suffix_drafts_from_earlier_answers_and_changes_no_token(tiny_llama: Path, pair: tuple[LLM, LLM]) -> None:
    """`suffix` keeps finished requests' outputs: a request asked again is drafted its
    earlier answer, and answers are still those without speculation."""
    plain = pair[0]
    config = {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_spec_factor": 2.0}
    suffix = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, speculative_config=config)
    prompts = random_prompts([12, 30, 21], TINY_VOCAB, seed=33)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = _tokens(plain, prompts, params)
    assert _tokens(suffix, prompts, params) == expected
    assert _tokens(suffix, prompts, params) == expected
    speculator = suffix.engine.parts.speculator
    assert speculator is not None
    request = speculator_probe(prompts[1] + expected[1][:8], max_tokens=32)
    assert speculator.propose(request, request.sequences[0], 6) == expected[1][8:14]
    assert_no_block_leaked(suffix)


def speculator_probe(token_ids: list[int], max_tokens: int) -> Request:
    """A request as the scheduler would hand one to the speculator."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request("probe", None, token_ids, params, arrival_index=0, max_tokens=max_tokens)


def test_speculation_through_preemption_loses_no_block(tiny_llama: Path) -> None:
    """A cache too small for every sequence at once: sequences with drafts get preempted and
    recomputed, and the output is still the output without speculation."""
    prompts = _repetitive_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    args = {"dtype": "float32", "num_kv_blocks": 16, "block_size": 8}
    plain, speculating = LLM(str(tiny_llama), **args), LLM(str(tiny_llama), speculative_config=NGRAM, **args)
    assert _tokens(speculating, prompts, params) == _tokens(plain, prompts, params)
    assert speculating.stats().num_preemptions_recompute > 0
    assert_no_block_leaked(speculating)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be 'ngram'"),
        ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown keys ['model']"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "suffix_decoding_min_token_prob must be in"),
        ({"method": "suffix", "prompt_lookup_max": 3}, "unknown keys ['prompt_lookup_max'] for method 'suffix'"),
    ],
)
def test_a_bad_speculative_config_is_refused_with_the_reason(
    tiny_llama: Path, config: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidParameterError, match="speculative_config") as refused:
        LLM(str(tiny_llama), speculative_config=config)
    assert message in str(refused.value)


def test_prompt_lookup_proposes_what_followed_the_longest_match() -> None:
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 3) == [4, 5, 1]
    assert propose_ngram([9, 2, 3, 8, 1, 2, 3], 3, 3, 3) == []  # only 2 tokens match
    assert propose_ngram([9, 2, 3, 8, 1, 2, 3], 3, 2, 3) == [8, 1, 2]
    assert propose_ngram([7, 7, 7, 7], 3, 1, 2) == [7, 7]  # a cycle: its longest continuation
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []


def test_suffix_lookup_extends_the_longest_match_while_its_continuation_is_frequent() -> None:
    recent = RecentOutputs(max_requests=2)
    for output in ([10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 99, 98], [10, 11, 12, 13, 14, 16]):
        recent.add(output)  # the first is evicted: two requests are kept
    # Three tokens (the match's length); after 13 the two answers part, each half the share.
    assert propose_suffix([5, 10, 11, 12], recent, 8, 24, 1.0, 0.1) == [13, 14, 16]
    assert propose_suffix([5, 10, 11, 12], recent, 8, 24, 1.0, 0.6) == [13]
    assert propose_suffix([5, 10, 11, 12, 13], recent, 8, 24, 0.5, 0.1) == [14, 16]  # half of four
    assert propose_suffix([1, 2, 3, 4, 1, 2], recent, 8, 24, 1.0, 0.1) == [3, 4]  # its own tokens


def test_the_load_switch_speculates_while_verifying_is_cheaper_than_decoding() -> None:
    """Fed step times of a weight-bound model (a fixed 25 ms, 1.4 ms a token and 1 ms a
    sequence with drafts: about this CPU's SmolLM2), with half the drafts accepted: drafts
    at batch 1, none at batch 64; none at all once drafts are almost never accepted."""
    switch = LoadSwitch(max_drafts=4)
    assert switch.draft_length(1) == 4  # nothing measured: measure with drafts
    for tokens, chunks in ((1, 0), (5, 1), (3, 0), (64, 0), (200, 0), (17, 3), (8, 2), (1, 0), (40, 8)):
        switch.observe_step(tokens, chunks, 0.025 + 0.0014 * tokens + 0.001 * chunks)
    switch.observe_verification(100, 50)
    assert switch.draft_length(1) > 0
    assert switch.draft_length(64) == 0
    switch.observe_verification(1000, 10)
    assert switch.draft_length(1) == 0
