"""`pagefleet serve --speculative-config` (vLLM's flag and JSON): answers are those of an
engine without it, and /metrics reports the drafts under vLLM's names."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from pagefleet.engine import LLM, SamplingParams
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import random_prompts
from tests.processes import idle_with_every_block_free, metrics, start_server, stop_server, wait_for

CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def test_a_speculating_server_answers_as_an_engine_that_does_not(tiny_llama: Path, tmp_path: Path) -> None:
    speculating = start_server(
        str(tiny_llama),
        tmp_path / "speculating.log",
        *("--dtype", "float32", "--num-kv-blocks", "128", "--speculative-config", json.dumps(CONFIG)),
    )
    try:
        prompt = random_prompts([7], TINY_VOCAB, seed=41)[0] * 5
        plain = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        expected = plain.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].text
        body = {"model": speculating.model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{speculating.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected
        # How many drafts the load switch lets through depends on the step times it
        # measures (the engine tests count them); the counters are there either way.
        samples = metrics(speculating)
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert samples[f"vllm:spec_decode_{name}_total{{engine=0}}"] >= 0
            assert samples[f"pagefleet:spec_decode_{name}_total"] >= 0
        assert samples["vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=0,position=2}"] >= 0
        wait_for(lambda: idle_with_every_block_free(speculating))
    finally:
        stop_server(speculating)
