"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet layers whose per-request state
lives in the state cache. Greedy output equals transformers' (float32) token for token
however the engine schedules the work; every slot comes back; what the state cannot go
through yet is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.errors import InvalidParameterError
from tests.conftest import LINEAR_ATTENTION_ARCHITECTURES, TINY_VOCAB, build_tiny_model
from tests.engine.helpers import assert_no_block_leaked, hf_greedy, random_prompts

NEW_TOKENS = 12
PROMPT_LENGTHS = [5, 17, 33, 1, 48]
SCHEDULES = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    # 10 blocks of 8 tokens for five prompts of up to 60: preempted, recomputed from zeros.
    "preempt_recompute": {"num_kv_blocks": 10, "block_size": 8},
}


@pytest.fixture(scope="module")
def linear_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("linear-attention")
    return {arch: build_tiny_model(arch, root / arch) for arch in LINEAR_ATTENTION_ARCHITECTURES}


def _greedy(max_tokens: int = NEW_TOKENS, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, n=n)


def assert_every_slot_free(llm: LLM) -> None:
    slots = llm.engine.kv_cache.state_slots
    assert slots is not None and slots.num_free_slots == slots.num_slots
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("arch", LINEAR_ATTENTION_ARCHITECTURES)
def test_greedy_equals_transformers(linear_models: dict[str, Path], arch: str, schedule: str) -> None:
    model_dir = linear_models[arch]
    llm = LLM(str(model_dir), dtype="float32", **SCHEDULES[schedule])
    prompts = random_prompts(PROMPT_LENGTHS, TINY_VOCAB)
    outputs = llm.generate(prompts, _greedy())
    assert all(len(set(o.outputs[0].token_ids)) > 3 for o in outputs), "degenerate model output"
    for prompt, output in zip(prompts, outputs, strict=True):
        expected_tokens, expected_logprobs = hf_greedy(model_dir, prompt, NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == expected_tokens, f"prompt of {len(prompt)} tokens diverged"
        ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids, strict=True)]
        assert ours == pytest.approx(expected_logprobs, abs=2e-4)
    if schedule == "preempt_recompute":
        assert llm.stats().num_preemptions_recompute > 0, "the tiny cache forced no preemption"
    assert_every_slot_free(llm)


def test_a_prompts_tokens_are_the_same_bits_alone_chunked_and_batched(linear_models: dict[str, Path]) -> None:
    """The delta rule runs token by token, so a prompt's state, and every logprob after it,
    is the same bits whether it ran alone, in 16-token chunks or beside other prompts."""
    model_dir = linear_models["qwen3_5"]
    prompt, others = random_prompts([40], TINY_VOCAB, seed=3)[0], random_prompts([7, 29], TINY_VOCAB, seed=4)

    def logprobs(llm: LLM, batch: list[list[int]]) -> list[float]:
        completion = llm.generate(batch, _greedy())[0].outputs[0]
        return [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids, strict=True)]

    alone = logprobs(LLM(str(model_dir), dtype="float32"), [prompt])
    chunked = logprobs(LLM(str(model_dir), dtype="float32", max_num_batched_tokens=16), [prompt])
    assert chunked == alone
    assert logprobs(LLM(str(model_dir), dtype="float32"), [prompt, *others]) == alone


def test_samples_fork_the_prompts_state(linear_models: dict[str, Path]) -> None:
    """n=3 greedy samples: the siblings forked after the prompt each carry a copy of its
    state, so all three are transformers' greedy continuation."""
    model_dir = linear_models["qwen3_next"]
    llm = LLM(str(model_dir), dtype="float32")
    prompt = random_prompts([21], TINY_VOCAB, seed=5)[0]
    (output,) = llm.generate([prompt], _greedy(n=3))
    expected, _ = hf_greedy(model_dir, prompt, NEW_TOKENS)
    assert [c.token_ids for c in output.outputs] == [expected] * 3
    assert_every_slot_free(llm)


def test_aborted_requests_give_back_their_slots(linear_models: dict[str, Path]) -> None:
    llm = LLM(str(linear_models["qwen3_5_moe"]), dtype="float32", max_num_seqs=4)
    engine = llm.engine
    slots = engine.kv_cache.state_slots
    assert slots is not None and slots.num_slots == 4
    for index, prompt in enumerate(random_prompts([9, 30, 3, 17, 12, 25], TINY_VOCAB, seed=6)):
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, _greedy(max_tokens=40))
    for _ in range(6):
        engine.step()
    assert slots.num_free_slots == 0  # four running, two waiting for a slot
    for index in range(6):
        engine.abort_request(f"r{index}")
    assert_every_slot_free(llm)


def test_a_repeated_prompt_is_computed_again(linear_models: dict[str, Path]) -> None:
    """No state is kept at block boundaries yet, so prefix caching is off for these models:
    a repeated prompt reports no cached tokens and gives the same tokens."""
    llm = LLM(str(linear_models["qwen3_5"]), dtype="float32", block_size=8)
    prompt = random_prompts([37], TINY_VOCAB, seed=7)[0]
    first, second = (llm.generate([prompt], _greedy())[0] for _ in range(2))
    assert second.num_cached_tokens == 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_every_slot_free(llm)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("preemption_mode", "swap"), ("kv_cache_dir", "/tmp/pagefleet-unused"), ("kv_role", "producer")],
)
def test_what_the_state_cannot_go_through_yet_is_refused(
    linear_models: dict[str, Path], setting: str, value: str
) -> None:
    with pytest.raises(InvalidParameterError, match=setting):
        LLM(str(linear_models["qwen3_5"]), dtype="float32", **{setting: value})


def test_pagefleet_serve_answers_and_refuses_a_kv_transfer(linear_models: dict[str, Path], tmp_path: Path) -> None:
    """Through the OpenAI API: streamed and whole greedy answers are transformers' tokens,
    and a request asking to hand its KV to a decode replica is refused in the API's shape."""
    import httpx
    import openai

    from tests.processes import start_server, stop_server

    model_dir = linear_models["qwen3_5"]
    server = start_server(str(model_dir), tmp_path / "serve.log", "--dtype", "float32", "--max-num-seqs", "8")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        prompt = random_prompts([13], TINY_VOCAB, seed=8)[0]
        expected, _ = hf_greedy(model_dir, prompt, 6)
        body = dict(model=server.model, prompt=prompt, max_tokens=6, temperature=0.0, logprobs=1)
        whole = client.completions.create(**body, extra_body={"ignore_eos": True})
        assert whole.choices[0].logprobs.tokens and whole.usage.completion_tokens == 6
        streamed = client.completions.create(**body, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
        ids = client.completions.create(**body, extra_body={"ignore_eos": True, "return_token_ids": True})
        assert ids.choices[0].token_ids == expected
        refused = httpx.post(
            f"{server.url}/v1/completions",
            json={
                "model": server.model,
                "prompt": "hi",
                "max_tokens": 2,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"
    finally:
        stop_server(server)
