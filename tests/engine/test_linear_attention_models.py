"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet layers whose per-request state
lives in the state cache. Greedy output equals transformers' (float32) token for token
however the engine schedules the work; every slot comes back; what the state cannot go
through yet is refused by name (the KV connectors with state: test_kv_connector_state.py)."""

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
    # 10 blocks of 8 tokens for five prompts of up to 60: preempted, recomputed from zeros,
    # or swapped out and back with their states.
    "preempt_recompute": {"num_kv_blocks": 10, "block_size": 8},
    "preempt_swap": {"num_kv_blocks": 10, "block_size": 8, "preemption_mode": "swap"},
}


@pytest.fixture(scope="module")
def linear_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("linear-attention")
    return {arch: build_tiny_model(arch, root / arch) for arch in LINEAR_ATTENTION_ARCHITECTURES}


def _greedy(max_tokens: int = NEW_TOKENS, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, n=n)


def assert_every_slot_free(llm: LLM) -> None:
    states = llm.engine.kv_cache.states
    assert states is not None and states.device.num_free_slots == states.device.num_slots
    assert states.host.num_free_slots == states.host.num_slots
    assert_no_block_leaked(llm)


# Every schedule on one model of each kernel family (the state cache's paths are shared
# code); the plain one on the others (their own layers: experts, Qwen3-Next's layout, RoPE).
GREEDY_CASES = [
    (arch, schedule)
    for arch in LINEAR_ATTENTION_ARCHITECTURES
    for schedule in SCHEDULES
    if schedule == "plain" or arch in ("qwen3_5", "granite4")
]


@pytest.mark.parametrize(("arch", "schedule"), GREEDY_CASES)
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
    stats = llm.stats()
    if schedule == "preempt_recompute":
        assert stats.num_preemptions_recompute > 0, "the tiny cache forced no preemption"
    if schedule == "preempt_swap":
        assert stats.num_preemptions_swap > 0, "the tiny cache forced no swap"
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
    states = engine.kv_cache.states
    assert states is not None and states.device.num_slots == 4
    for index, prompt in enumerate(random_prompts([9, 30, 3, 17, 12, 25], TINY_VOCAB, seed=6)):
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, _greedy(max_tokens=40))
    for _ in range(6):
        engine.step()
    assert states.device.num_free_slots == 0  # four running, two waiting for a slot
    for index in range(6):
        engine.abort_request(f"r{index}")
    assert_every_slot_free(llm)


@pytest.mark.parametrize("arch", ["qwen3_5", "granite4"])
def test_a_shared_prefix_resumes_from_its_state_snapshot(linear_models: dict[str, Path], arch: str) -> None:
    """A prompt's chunk ends at its last block boundary, where the engine keeps a copy of the
    state: a later prompt with the same first blocks starts there (the attention layers'
    blocks from the prefix cache, the state layers' from the snapshot), and its tokens are
    transformers' and, for a repeated prompt, the first run's bits."""
    model_dir = linear_models[arch]
    llm = LLM(str(model_dir), dtype="float32", block_size=8)
    system, tails = random_prompts([24], TINY_VOCAB, seed=7)[0], random_prompts([7, 11], TINY_VOCAB, seed=9)
    first = llm.generate([system + tails[0]], _greedy())[0]  # 31 tokens: a snapshot after 24
    repeated, other = llm.generate([system + tails[0]], _greedy())[0], llm.generate([system + tails[1]], _greedy())[0]
    assert (first.num_cached_tokens, repeated.num_cached_tokens, other.num_cached_tokens) == (0, 24, 24)
    assert repeated.outputs[0].token_ids == first.outputs[0].token_ids
    assert repeated.outputs[0].logprobs == first.outputs[0].logprobs
    for prompt, output in ((system + tails[0], first), (system + tails[1], other)):
        assert output.outputs[0].token_ids == hf_greedy(model_dir, prompt, NEW_TOKENS)[0]
    assert_every_slot_free(llm)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
        ("tensor_parallel_size", 2),
        ("enable_lora", True),
        # KV leaving the replica moves with the prefix cache's state snapshots.
        ("kv_role", "prefill"),
        ("kv_cache_dir", "/tmp/pagefleet-unused"),
    ],
)
def test_what_the_state_cannot_go_through_yet_is_refused(
    linear_models: dict[str, Path], setting: str, value: object
) -> None:
    with pytest.raises(InvalidParameterError, match=setting):
        LLM(str(linear_models["qwen3_5"]), dtype="float32", enable_prefix_caching=False, **{setting: value})


def test_pagefleet_serve_answers_and_moves_a_prompt_with_its_state(
    linear_models: dict[str, Path], tmp_path: Path
) -> None:
    """Through the OpenAI API: streamed and whole greedy answers are transformers' tokens;
    a prompt prefilled for a decode replica is pulled over HTTP with its state (this replica
    serves both sides) and decodes to the same tokens."""
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
        long_prompt = random_prompts([37], TINY_VOCAB, seed=10)[0]
        request = {"model": server.model, "prompt": long_prompt, "temperature": 0.0, "ignore_eos": True}
        prefilled = httpx.post(
            f"{server.url}/v1/completions",
            json={**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
        assert prefilled.status_code == 200, prefilled.text
        params = prefilled.json()["kv_transfer_params"]
        decoded = httpx.post(
            f"{server.url}/v1/completions",
            json={**request, "max_tokens": 6, "return_token_ids": True, "kv_transfer_params": params},
        )
        assert decoded.status_code == 200, decoded.text
        assert decoded.json()["choices"][0]["token_ids"] == hf_greedy(model_dir, long_prompt, 6)[0]
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'pagefleet:num_state_slots{model_name="' in metrics
        assert 'pagefleet:num_free_state_slots{model_name="' in metrics
    finally:
        stop_server(server)


def test_max_num_seqs_is_lowered_to_the_state_slots_that_fit(linear_models: dict[str, Path]) -> None:
    """At the defaults a large state (a real Qwen3.5's is tens of MiB a sequence) would not
    fit 256 slots and their snapshots: the slots are lowered until the state cache takes at
    most half the KV budget, and the engine runs no more sequences than it has slots."""
    from pagefleet.engine.worker.state_cache import state_bytes_per_slot

    llm = LLM(str(linear_models["qwen3_5"]), dtype="float32")
    row = state_bytes_per_slot(llm.engine.parts.model_config, llm.engine.config.torch_dtype)
    budget = 2 * 256 * row * 0.75  # three quarters of what 256 slots and snapshots take
    small = LLM(str(linear_models["qwen3_5"]), dtype="float32", kv_cache_memory=int(budget))
    states = small.engine.kv_cache.states
    assert states is not None and states.device.num_slots == int(budget * 0.5) // (2 * row) < 256
    assert small.engine.config.max_num_seqs == states.device.num_slots
    prompts = random_prompts([9] * (states.device.num_slots + 3), TINY_VOCAB, seed=13)
    outputs = small.generate(prompts, _greedy(max_tokens=4))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert_every_slot_free(small)
    with pytest.raises(InvalidParameterError, match="kv_cache_memory"):
        LLM(str(linear_models["qwen3_5"]), dtype="float32", kv_cache_memory=2 * row - 1)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_the_language_model_of_a_qwen3_5_image_checkpoint_equals_transformers(
    linear_models: dict[str, Path], arch: str, tmp_path: Path
) -> None:
    """Qwen3.5 is released as image checkpoints (Qwen3_5ForConditionalGeneration): its text
    model is served from them, the vision tower's weights skipped."""
    import torch
    import transformers as tf

    text = tf.AutoModelForCausalLM.from_pretrained(linear_models[arch], dtype=torch.float32)
    tower = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text.config.hidden_size)
    whole_config, whole_model = {
        "qwen3_5": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration),
        "qwen3_5_moe": (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration),
    }[arch]
    config = whole_config(text_config=text.config.to_dict(), vision_config=tower, tie_word_embeddings=False)
    model = whole_model(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(tmp_path)
    tf.AutoTokenizer.from_pretrained(linear_models[arch]).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=8)
    assert llm.engine.parts.model_config.language_model_of == type(model).__name__
    prompts = random_prompts([17, 33], TINY_VOCAB, seed=14)
    for prompt, output in zip(prompts, llm.generate(prompts, _greedy()), strict=True):
        assert output.outputs[0].token_ids == hf_greedy(linear_models[arch], prompt, NEW_TOKENS)[0]
