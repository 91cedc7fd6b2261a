"""vLLM code runs unchanged: the engine arguments, LLM methods and SamplingParams fields
users bring from vLLM, each doing what it does there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.errors import InvalidParameterError
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, hf_model, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(model=str(tiny_llama), dtype="float32", block_size=4, enforce_eager=True, gpu_memory_utilization=0.02)


@pytest.fixture(autouse=True)
def _no_leak(llm: LLM):  # type: ignore[no-untyped-def]
    yield
    assert_no_block_leaked(llm)


def _greedy(**kwargs) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(temperature=0.0, ignore_eos=True, **{"max_tokens": 12, **kwargs})


def _next_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([tokens])).logits[0, -1].float()


def test_engine_arguments_from_vllm(llm: LLM, tiny_llama: Path) -> None:
    # gpu_memory_utilization on a CPU: that fraction of free host memory for the KV cache.
    assert llm.stats().num_total_blocks > 0
    assert llm.get_tokenizer() is llm.tokenizer and llm.get_tokenizer() is not None
    with pytest.raises(InvalidParameterError) as refused:
        LLM(model=str(tiny_llama), trust_remote_code=True)
    assert refused.value.param == "trust_remote_code"
    with pytest.raises(InvalidParameterError) as refused:
        LLM(model=str(tiny_llama), gpu_memory_utilization=1.5)
    assert refused.value.param == "gpu_memory_utilization"
    with pytest.raises(InvalidParameterError, match="not both"):
        LLM(model=str(tiny_llama), gpu_memory_utilization=0.5, kv_cache_memory=1 << 20)


def test_prefix_cache_hits_are_reported_and_reset_forgets_them(llm: LLM) -> None:
    (prompt,) = random_prompts([22], TINY_VOCAB, seed=11)
    llm.reset_prefix_cache()
    first = llm.generate({"prompt_token_ids": prompt}, _greedy(max_tokens=2))[0]
    again = llm.generate({"prompt_token_ids": prompt}, _greedy(max_tokens=2))[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 20  # five full blocks of four; the last token is always computed
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], _greedy(max_tokens=2))[0].num_cached_tokens == 0


def test_reset_prefix_cache_refuses_while_blocks_are_in_use(llm: LLM) -> None:
    (prompt,) = random_prompts([9], TINY_VOCAB, seed=12)
    llm.engine.add_request("held", prompt, _greedy())
    llm.engine.step()
    try:
        assert llm.reset_prefix_cache() is False
    finally:
        llm.engine.abort_request("held")
    assert llm.reset_prefix_cache() is True


def test_allowed_token_ids_keep_only_those(llm: LLM) -> None:
    (prompt,) = random_prompts([7], TINY_VOCAB, seed=13)
    allowed = [5, 17, 42]
    for params in (
        _greedy(allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, allowed_token_ids=allowed),
    ):
        tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert tokens and set(tokens) <= set(allowed)


def test_logit_bias_moves_the_greedy_choice_and_logprobs_stay_raw(llm: LLM, tiny_llama: Path) -> None:
    (prompt,) = random_prompts([8], TINY_VOCAB, seed=14)
    logits = _next_logits(tiny_llama, prompt)
    unbiased_first = int(logits.argmax())
    runner_up = int(logits.topk(2).indices[1])
    plain = llm.generate([prompt], _greedy(max_tokens=1))[0].outputs[0]
    assert plain.token_ids == [unbiased_first]
    biased = llm.generate([prompt], _greedy(max_tokens=1, logit_bias={runner_up: 100.0}, logprobs=0))[0].outputs[0]
    assert biased.token_ids == [runner_up]
    raw = torch.log_softmax(logits, -1)[runner_up].item()
    assert biased.logprobs is not None and biased.logprobs[0][runner_up].logprob == pytest.approx(raw, abs=1e-4)
    banned = llm.generate([prompt], _greedy(max_tokens=1, logit_bias={unbiased_first: -100.0}))[0].outputs[0]
    assert banned.token_ids == [runner_up]


def test_bad_words_are_never_completed(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    (prompt,) = random_prompts([6], TINY_VOCAB, seed=15)
    free = llm.generate([prompt], _greedy(max_tokens=10))[0].outputs[0]
    # Ban the words the free run produced, one at a time (each as its own decoded text).
    words = sorted({tokenizer.decode([t]).strip() for t in free.token_ids} - {""})
    assert words
    banned_params = _greedy(max_tokens=10, bad_words=words)
    constrained = llm.generate([prompt], banned_params)[0].outputs[0]
    assert not banned_params.bad_words_token_ids, "the caller's params are never written"
    ids_of = {tuple(ids) for ids in llm.engine.with_bad_words_tokenized(banned_params).bad_words_token_ids}
    single = {ids[0] for ids in ids_of if len(ids) == 1}
    assert single and not single & set(constrained.token_ids)
    assert constrained.token_ids != free.token_ids


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    (prompt,) = random_prompts([30], TINY_VOCAB, seed=16)
    truncated = llm.generate([prompt], _greedy(truncate_prompt_tokens=10))[0]
    assert truncated.prompt_token_ids == prompt[-10:]
    assert truncated.outputs[0].token_ids == llm.generate([prompt[-10:]], _greedy())[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_bad_values_name_their_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        SamplingParams(**fields)  # type: ignore[arg-type]
    assert refused.value.param == param


def test_token_ids_outside_the_vocabulary_are_refused_before_anything_runs(llm: LLM) -> None:
    for fields in ({"allowed_token_ids": [TINY_VOCAB]}, {"logit_bias": {TINY_VOCAB + 3: 1.0}}):
        with pytest.raises(InvalidParameterError) as refused:
            llm.generate([[1, 2, 3]], _greedy(**fields))
        assert refused.value.param == next(iter(fields))


def test_structured_outputs_on_a_model_without_stop_tokens(llm: LLM) -> None:
    """The tiny model has no EOS: a constraint ends the sequence where it is complete, and
    one that other constraints leave nothing to satisfy ends it too, without an error."""
    choice = llm.generate(["pick"], SamplingParams(max_tokens=16, structured_outputs={"choice": ["", "x"]}))[0]
    assert choice.error is None and choice.outputs[0].finish_reason == "stop" and choice.outputs[0].text in ("", "x")
    regex = llm.generate(["digits"], SamplingParams(max_tokens=16, seed=1, structured_outputs={"regex": "[0-9]{3}"}))
    assert regex[0].outputs[0].finish_reason == "stop" and len(regex[0].outputs[0].text) == 3
    digits = llm.get_tokenizer().convert_tokens_to_ids(list("0123456789"))
    starved = SamplingParams(
        max_tokens=8,
        temperature=0,
        structured_outputs={"regex": "[0-9]{3}"},
        allowed_token_ids=[t for t in range(10) if t not in digits],
    )
    ended = llm.generate(["nothing fits"], starved)[0]
    assert ended.error is None and ended.outputs[0].finish_reason == "stop" and ended.outputs[0].token_ids == []
