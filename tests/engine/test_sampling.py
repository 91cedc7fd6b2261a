"""Sampling behaviour users rely on: seeds, n samples, stops, limits, logprobs, penalties."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagefleet.engine import LLM, PromptTooLongError, RequestOutput, RequestOutputKind, SamplingParams
from pagefleet.engine.core.request import Sequence
from pagefleet.engine.front.detokenizer import Detokenizer
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, hf_prompt_logprobs, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", block_size=4)


@pytest.fixture(autouse=True)
def _no_leak(llm: LLM):  # type: ignore[no-untyped-def]
    yield
    assert_no_block_leaked(llm)


def _greedy(**kwargs) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(temperature=0.0, ignore_eos=True, **{"max_tokens": 16, **kwargs})


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    prompt, *others = random_prompts([9, 20, 5, 31], TINY_VOCAB, seed=4)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=20, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    mixed = (
        llm.generate(
            [others[0], prompt, others[1], others[2]],
            [SamplingParams(temperature=1.0, max_tokens=7), seeded, SamplingParams(temperature=0.7, seed=9), _greedy()],
        )[1]
        .outputs[0]
        .token_ids
    )
    assert alone == mixed
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, seed=124, max_tokens=20))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_greedy_samples_equal_the_greedy_output(llm: LLM) -> None:
    (prompt,) = random_prompts([13], TINY_VOCAB, seed=5)
    greedy = llm.generate([prompt], _greedy())[0].outputs[0].token_ids
    outputs = llm.generate([prompt], _greedy(n=4))[0].outputs
    assert [o.index for o in outputs] == [0, 1, 2, 3]
    assert all(o.token_ids == greedy for o in outputs)


def test_n_seeded_samples_differ_and_reproduce(llm: LLM) -> None:
    (prompt,) = random_prompts([13], TINY_VOCAB, seed=6)
    params = SamplingParams(n=4, temperature=1.2, seed=7, max_tokens=12, ignore_eos=True)
    first = [o.token_ids for o in llm.generate([prompt], params)[0].outputs]
    again = [o.token_ids for o in llm.generate([prompt], params)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) > 1, "four samples at temperature 1.2 should not all agree"


def test_n_samples_share_the_prompt_blocks(llm: LLM) -> None:
    engine = llm.engine
    (prompt,) = random_prompts([10], TINY_VOCAB, seed=8)  # 2 full blocks of 4 + 2 tokens
    request = engine.add_request("shared", prompt, _greedy(n=4, max_tokens=3))
    free_before = engine.kv_cache.num_free_blocks
    engine.step()  # prefill the prompt once, then fork
    tables = [engine.kv_cache.block_table(seq) for seq in request.sequences]
    assert all(table[:3] == tables[0][:3] for table in tables)
    pool = engine.kv_cache.pool
    assert [pool.ref_count(b) for b in tables[0][:3]] == [4, 4, 4]
    assert free_before - engine.kv_cache.num_free_blocks == 3, "the prompt is stored once"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_cow_copies >= 3


def test_stop_string_ends_the_text_before_it(llm: LLM) -> None:
    (prompt,) = random_prompts([6], TINY_VOCAB, seed=9)
    full = llm.generate([prompt], _greedy(max_tokens=24))[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), "pick a prompt whose text is not blank here"
    completion = llm.generate([prompt], _greedy(max_tokens=24, stop=[stop]))[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full[: full.index(stop)]
    kept = llm.generate([prompt], _greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == full[: full.index(stop) + len(stop)]


def test_stop_token_min_tokens_and_max_tokens(llm: LLM) -> None:
    (prompt,) = random_prompts([6], TINY_VOCAB, seed=10)
    tokens = llm.generate([prompt], _greedy())[0].outputs[0].token_ids
    stop_token = tokens[2]
    first_stop = tokens.index(stop_token)
    stopped = llm.generate([prompt], _greedy(stop_token_ids=[stop_token]))[0].outputs[0]
    assert stopped.token_ids == tokens[: first_stop + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_token
    at_least = llm.generate([prompt], _greedy(stop_token_ids=[stop_token], min_tokens=8))[0].outputs[0]
    assert len(at_least.token_ids) >= 8
    assert stop_token not in at_least.token_ids[:7]
    limited = llm.generate([prompt], _greedy(max_tokens=5))[0]
    assert len(limited.outputs[0].token_ids) == 5 and limited.outputs[0].finish_reason == "length"
    assert limited.usage.prompt_tokens == 6 and limited.usage.completion_tokens == 5


def test_logprobs_and_prompt_logprobs(llm: LLM, tiny_llama: Path) -> None:
    (prompt,) = random_prompts([11], TINY_VOCAB, seed=11)
    output = llm.generate([prompt], _greedy(max_tokens=4, logprobs=3, prompt_logprobs=2))[0]
    for token_id, position in zip(output.outputs[0].token_ids, output.outputs[0].logprobs, strict=True):
        assert position[token_id].rank == 1, "greedy picks the top token"
        assert len(position) == 3
        ranks = sorted(lp.rank for lp in position.values())
        assert ranks == [1, 2, 3]
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    ours = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:], strict=True)]
    assert ours == pytest.approx(hf_prompt_logprobs(tiny_llama, prompt), abs=2e-4)


def test_repetition_penalty_matches_transformers(llm: LLM, tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    (prompt,) = random_prompts([8], TINY_VOCAB, seed=12)
    ours = llm.generate([prompt], _greedy(max_tokens=16, repetition_penalty=1.5))[0].outputs[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = model.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.5, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert ours == theirs
    plain = llm.generate([prompt], _greedy(max_tokens=16))[0].outputs[0].token_ids
    penalised = llm.generate([prompt], _greedy(max_tokens=16, frequency_penalty=2.0, presence_penalty=2.0))
    assert penalised[0].outputs[0].token_ids != plain


def test_invalid_requests_raise_and_leave_nothing_behind(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], _greedy())
    with pytest.raises(PromptTooLongError, match="512"):
        llm.generate([[1] * 600], _greedy())
    with pytest.raises(PromptTooLongError) as raised:
        llm.generate([[1] * 500], _greedy(max_tokens=100))
    assert raised.value.param == "max_tokens"
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[TINY_VOCAB + 5]], _greedy())
    with pytest.raises(ValueError):  # the second prompt is bad: the first must not linger
        llm.generate([[1, 2, 3], []], _greedy())
    assert not llm.engine.has_unfinished_requests()


def test_request_that_can_never_fit_is_rejected(tiny_llama: Path) -> None:
    small = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=4, block_size=4)
    with pytest.raises(PromptTooLongError, match="KV blocks|context window"):
        small.generate([[1] * 10], _greedy(max_tokens=10))
    assert_no_block_leaked(small)


def test_abort_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    for index, prompt in enumerate(random_prompts([12, 30, 7], TINY_VOCAB, seed=13)):
        engine.add_request(f"abort-{index}", prompt, _greedy(n=2, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache.num_free_blocks < engine.kv_cache.pool.num_blocks
    for index in range(3):
        final = engine.abort_request(f"abort-{index}")
        assert final is not None and final.finished
        assert all(o.finish_reason == "abort" for o in final.outputs)
    assert engine.abort_request("abort-0") is None


def test_incremental_detokenization_never_emits_broken_utf8(llm: LLM) -> None:
    tokenizer = llm.tokenizer
    text = "Ünïcödé ✓ 東京 emoji 🚀 test"
    ids = tokenizer.encode(text)
    detokenizer = Detokenizer(tokenizer)
    seq = Sequence(0, [], num_prompt_tokens=0)
    detokenizer.start(seq)
    pieces = []
    for token_id in ids:
        seq.token_ids.append(token_id)
        pieces.append(detokenizer.step(seq, skip_special_tokens=True))
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text
    assert any(piece == "" for piece in pieces), "some character spans several tokens"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_n_samples_survive_preemption(tiny_llama: Path, mode: str) -> None:
    """A tiny cache preempts n=3 requests mid-decode; resumed, they sample the same tokens."""
    prompts = random_prompts([14, 9, 22], TINY_VOCAB, seed=14)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=14, ignore_eos=True)
    roomy = LLM(str(tiny_llama), dtype="float32", block_size=4)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params)]
    tight = LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=24, preemption_mode=mode)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)]
    assert got == expected
    stats = tight.stats()
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    assert_no_block_leaked(tight)


def test_abort_while_swapped_out_frees_host_and_device_blocks(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=12, preemption_mode="swap")
    engine = llm.engine
    for index, prompt in enumerate(random_prompts([10, 10, 10], TINY_VOCAB, seed=15)):
        engine.add_request(f"swap-{index}", prompt, _greedy(max_tokens=30))
    swapped = None
    for _ in range(60):
        engine.step()
        swapped = next((r for r in engine.scheduler.waiting if r.status.value == "swapped"), None)
        if swapped is not None:
            break
    assert swapped is not None, "the tiny cache should have swapped a request out"
    assert engine.kv_cache.num_free_host_blocks < engine.kv_cache.num_host_blocks
    engine.abort_request(swapped.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_block_leaked(llm)


def test_a_failing_step_frees_every_block(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real_execute = llm.engine.runner.execute

    def failing_execute(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "execute", failing_execute)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate(random_prompts([8, 16], TINY_VOCAB, seed=16), _greedy(max_tokens=10))
    assert not llm.engine.has_unfinished_requests()


def _outputs_by_step(llm: LLM, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """Every output the engine gives one request, step by step."""
    llm.engine.add_request("kinds", prompt, params)
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
    return outputs


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_deltas_add_up_to_the_cumulative_output(llm: LLM, temperature: float) -> None:
    """Greedy, both samples meet the stop string (several characters: they may span tokens,
    and no delta may send what it then takes away); sampled, they differ."""
    (prompt,) = random_prompts([6], TINY_VOCAB, seed=9)
    full = llm.generate([prompt], _greedy(max_tokens=24))[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    common = {"n": 2, "temperature": temperature, "seed": 4, "logprobs": 2, "stop": [stop], "max_tokens": 24}
    cumulative = _outputs_by_step(llm, prompt, SamplingParams(**common))
    deltas = _outputs_by_step(llm, prompt, SamplingParams(**common, output_kind=RequestOutputKind.DELTA))
    final = {c.index: c for c in cumulative[-1].outputs}
    if temperature == 0.0:
        assert all(c.stop_reason == stop for c in final.values())
    for index, expected in final.items():
        news = [c for output in deltas for c in output.outputs if c.index == index]
        assert "".join(c.text for c in news) == expected.text
        assert [t for c in news for t in c.token_ids] == expected.token_ids
        assert [p for c in news for p in c.logprobs or []] == expected.logprobs
        assert news[-1].finish_reason == expected.finish_reason and news[-1].stop_reason == expected.stop_reason
        assert all(c.token_ids or c.text or c.finished for c in news), "a delta with nothing new"
    assert deltas[-1].finished and not any(output.finished for output in deltas[:-1])
    assert deltas[-1].usage == cumulative[-1].usage


def test_final_only_gives_one_output_and_generate_leaves_the_params_alone(llm: LLM) -> None:
    (prompt,) = random_prompts([6], TINY_VOCAB, seed=9)
    final_only = _outputs_by_step(llm, prompt, _greedy(output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(final_only) == 1 and final_only[0].finished
    params = _greedy()
    (generated,) = llm.generate([prompt], params)
    assert generated.outputs[0].token_ids == final_only[0].outputs[0].token_ids
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)  # type: ignore[arg-type]
