"""vLLM's prompt shapes, a tokenizer from another directory, and an engine with none."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from pagefleet.engine import LLM, AsyncEngine, SamplingParams, TextPrompt, TokensPrompt
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32")


def _tokens(outputs) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in outputs]


def test_prompt_dicts_are_read_as_vllm_reads_them(llm: LLM) -> None:
    ids = random_prompts([9], TINY_VOCAB, seed=50)[0]
    text = "Hello world! How are you?"
    plain = _tokens(llm.generate([ids, text], GREEDY))
    tokens_prompt: TokensPrompt = {"prompt_token_ids": ids}
    text_prompt: TextPrompt = {"prompt": text}
    assert _tokens(llm.generate([tokens_prompt, text_prompt], GREEDY)) == plain
    assert _tokens(llm.generate(tokens_prompt, GREEDY)) == plain[:1], "one dict is one prompt"
    assert llm.generate(text_prompt, GREEDY)[0].prompt == text
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt": text, "multi_modal_data": {}}, GREEDY)  # type: ignore[arg-type]
    assert_no_block_leaked(llm)


def test_async_engine_takes_prompt_dicts(tiny_llama: Path, llm: LLM) -> None:
    ids = random_prompts([7], TINY_VOCAB, seed=51)[0]
    engine = AsyncEngine(model=str(tiny_llama), dtype="float32")

    async def last() -> list[int]:
        final = None
        async for output in engine.generate({"prompt_token_ids": ids}, GREEDY):
            final = output
        assert final is not None
        return final.outputs[0].token_ids

    try:
        assert asyncio.run(last()) == _tokens(llm.generate(ids, GREEDY))[0]
    finally:
        engine.shutdown()


def test_tokenizer_from_another_directory(tiny_llama: Path, tmp_path: Path, llm: LLM) -> None:
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(tiny_llama / name, weights_only / name)
    separate = LLM(str(weights_only), dtype="float32", tokenizer=str(tiny_llama))
    text = "Paris is the capital of France."
    assert _tokens(separate.generate(text, GREEDY)) == _tokens(llm.generate(text, GREEDY))
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        LLM(str(weights_only), dtype="float32")  # no tokenizer there, and none named


def test_skip_tokenizer_init_runs_on_token_ids_alone(tiny_llama: Path, tmp_path: Path, llm: LLM) -> None:
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama / name, weights_only / name)
    bare = LLM(str(weights_only), dtype="float32", skip_tokenizer_init=True)
    ids = random_prompts([12], TINY_VOCAB, seed=52)[0]
    output = bare.generate(ids, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))[0]
    assert output.outputs[0].token_ids == _tokens(llm.generate(ids, GREEDY))[0]
    assert output.outputs[0].text == ""
    with pytest.raises(ValueError, match="token ids"):
        bare.generate("some text", GREEDY)
    with pytest.raises(ValueError, match="stop"):
        bare.generate(ids, SamplingParams(stop=["x"]))
    assert_no_block_leaked(bare)
