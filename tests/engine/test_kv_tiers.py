"""The KV file tier: greedy float32 output is token for token transformers' whichever path
supplied the prompt's KV (recompute, a local prefix hit, the file tier, the file tier under
swap and recompute preemption, with LoRA adapters, with n > 1), no block leaks, and a file
that is torn, corrupted or of another layout is a miss, never used."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.kv_connector.file_tier import FileTierConnector
from pagefleet.engine.kv_tiers.file_tier import FileTier
from pagefleet.engine.kv_transfer.params import RemoteKV
from pagefleet.engine.lora.request import LoRARequest
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, hf_greedy, random_prompts
from tests.engine.test_lora import _adapter_dirs, _peft_greedy

NEW_TOKENS = 24
PROMPT_LENGTHS = [40, 70, 33, 97]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PATHS = {
    "file": {},
    "file_then_swap": {"num_kv_blocks": 10, "block_size": 16, "preemption_mode": "swap"},
    "file_then_recompute": {"num_kv_blocks": 10, "block_size": 16, "preemption_mode": "recompute"},
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, TINY_VOCAB, seed=3)


@pytest.fixture(scope="module")
def expected(tiny_llama: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(tiny_llama, prompt, NEW_TOKENS)[0] for prompt in prompts]


@pytest.fixture(scope="module")
def stored(tiny_llama: Path, prompts: list[list[int]], expected: list[list[int]], tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """A directory filled by one engine (which also checks the recompute and local-hit paths)."""
    directory = tmp_path_factory.mktemp("kv-tier")
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dir=str(directory))
    computed = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in computed] == expected
    assert [o.num_cached_tokens for o in computed] == [0, 0, 0, 0]
    again = llm.generate(prompts, GREEDY)  # local prefix hits, not the file tier
    assert [o.outputs[0].token_ids for o in again] == expected
    assert all(o.num_cached_tokens > 0 for o in again)
    tier = llm.stats().kv_tier
    assert tier is not None and tier.hits == 0 and tier.written_blocks > 0
    assert_no_block_leaked(llm)
    full_blocks = sum((length - 1) // 16 for length in PROMPT_LENGTHS)
    assert len(list(directory.glob("*/*.kv"))) >= full_blocks
    return directory


@pytest.mark.parametrize("path", list(PATHS))
def test_a_new_replica_reads_the_prefix_and_answers_as_transformers(
    tiny_llama: Path, prompts: list[list[int]], expected: list[list[int]], stored: Path, path: str
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dir=str(stored), **PATHS[path])
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # Every full block before the last prompt token came from the files.
    assert [o.num_cached_tokens for o in outputs] == [(length - 1) // 16 * 16 for length in PROMPT_LENGTHS]
    stats = llm.stats()
    assert stats.kv_tier is not None and stats.kv_tier.hits == len(prompts) and stats.kv_tier.bad_files == 0
    if path != "file":
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0, "the tiny cache forced no preemption"
    assert_no_block_leaked(llm)


def test_n_samples_are_the_same_from_the_file_tier_as_computed(
    tiny_llama: Path, prompts: list[list[int]], stored: Path, tmp_path: Path
) -> None:
    seeded = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    computed = LLM(str(tiny_llama), dtype="float32").generate(prompts, seeded)
    tiered = LLM(str(tiny_llama), dtype="float32", kv_cache_dir=str(stored))
    read = tiered.generate(prompts, seeded)
    assert all(o.num_cached_tokens > 0 for o in read)
    assert [[c.token_ids for c in o.outputs] for o in read] == [[c.token_ids for c in o.outputs] for o in computed]
    assert_no_block_leaked(tiered)


def test_an_adapters_blocks_are_its_own_in_the_file_tier(tiny_llama: Path, tmp_path: Path) -> None:
    first, second = _adapter_dirs(tiny_llama, "llama")
    a, b = LoRARequest("first", 1, str(first)), LoRARequest("second", 2, str(second))
    prompt = random_prompts([50], TINY_VOCAB, seed=9)[0]
    settings = {"dtype": "float32", "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    writer = LLM(str(tiny_llama), kv_cache_dir=str(tmp_path), **settings)  # type: ignore[arg-type]
    writer.generate([prompt], GREEDY, lora_request=a)
    reader = LLM(str(tiny_llama), kv_cache_dir=str(tmp_path), **settings)  # type: ignore[arg-type]
    with_a = reader.generate([prompt], GREEDY, lora_request=a)[0]
    assert with_a.num_cached_tokens == 48
    assert with_a.outputs[0].token_ids == _peft_greedy(tiny_llama, first, prompt, NEW_TOKENS)
    with_b = reader.generate([prompt], GREEDY, lora_request=b)[0]
    assert with_b.num_cached_tokens == 0  # another adapter's chain: no file of its own
    assert with_b.outputs[0].token_ids == _peft_greedy(tiny_llama, second, prompt, NEW_TOKENS)
    assert reader.generate([prompt], GREEDY)[0].num_cached_tokens == 0  # nor the base model
    assert_no_block_leaked(reader)


def test_a_torn_corrupted_or_foreign_file_is_a_miss(
    tiny_llama: Path, prompts: list[list[int]], expected: list[list[int]], stored: Path, tmp_path: Path
) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(stored, copy)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dir=str(copy))
    prompt = prompts[3]  # 97 tokens: 6 full blocks before the last token
    tier = _tier(llm)
    stored = tier.read_prefix(_hashes(prompt), prompt[:96], local=0)
    assert stored is not None and stored.num_tokens == 96
    files = [tier.store.path(h) for h in _hashes(prompt)]
    flipped = bytearray(files[4].read_bytes())
    flipped[-100] ^= 0xFF  # corrupted: block 4 and after are recomputed
    files[4].write_bytes(bytes(flipped))
    output = llm.generate([prompt], GREEDY)[0]
    assert output.num_cached_tokens == 64 and output.outputs[0].token_ids == expected[3]
    assert files[4].stat().st_size == len(flipped)  # removed, then written again whole by this engine
    assert tier.store.read(_hashes(prompt)[4], tuple(prompt[64:80])) is not None
    llm.engine.reset_prefix_cache()
    data = files[2].read_bytes()
    files[2].write_bytes(data[: len(data) // 2])  # torn: block 2 and after are recomputed
    output = llm.generate([prompt], GREEDY)[0]
    assert output.num_cached_tokens == 32 and output.outputs[0].token_ids == expected[3]
    assert llm.stats().kv_tier.bad_files == 2  # type: ignore[union-attr]
    # Another layout (block size 8) sharing the directory reads nothing of it.
    other = LLM(str(tiny_llama), dtype="float32", block_size=8, kv_cache_dir=str(copy))
    out = other.generate([prompts[1]], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == expected[1]
    assert_no_block_leaked(llm)
    assert_no_block_leaked(other)


def test_the_cost_model_recomputes_when_reading_would_be_slower(
    tiny_llama: Path, prompts: list[list[int]], expected: list[list[int]], stored: Path
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dir=str(stored))
    tier = _tier(llm)
    assert tier.cost.crossover_tokens(16) == 16  # reading one block beats computing it here
    tier.cost.seconds_per_block = 10.0  # a tier far slower than computing
    outputs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0, 0]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats().kv_tier.refused == len(prompts)  # type: ignore[union-attr]


def test_the_directory_stays_under_its_size_evicting_the_least_recently_used(tiny_llama: Path, tmp_path: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dir=str(tmp_path), kv_cache_dir_size_gib=1e-3)
    tier = _tier(llm)
    block_file = tier.store.block_bytes() + 200
    tier.store.max_bytes = 10 * block_file  # room for about ten blocks
    llm.generate(random_prompts([70] * 6, TINY_VOCAB, seed=21), GREEDY)
    sizes = [file.stat().st_size for file in tmp_path.glob("*/*.kv")]
    assert 0 < sum(sizes) <= tier.store.max_bytes
    assert not list(tmp_path.glob("*/.*.tmp")), "a temporary file was left behind"
    assert_no_block_leaked(llm)


def _tier(llm: LLM) -> FileTier:
    connector = llm.engine.kv_connector.member(FileTierConnector)
    assert connector is not None
    return connector.tier


def _hashes(prompt: list[int]) -> list[int]:
    from pagefleet.protocol.block_hash import chain_root, reusable_prefix

    return reusable_prefix(prompt, 16, chain_root())[1]


def test_a_prompt_answered_in_one_step_is_written_too(tiny_llama: Path, tmp_path: Path) -> None:
    """Its blocks are freed in the step that filled them: the tier still takes them."""
    prompt = random_prompts([65], TINY_VOCAB, seed=23)[0]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    writer = LLM(str(tiny_llama), dtype="float32", kv_cache_dir=str(tmp_path))
    writer.generate([prompt], one)
    assert_no_block_leaked(writer)
    reader = LLM(str(tiny_llama), dtype="float32", kv_cache_dir=str(tmp_path))
    assert reader.generate([prompt], one)[0].num_cached_tokens == 64


def _answer(llm: LLM, prompt: list[int], given: RemoteKV | None) -> RequestOutput:
    engine = llm.engine
    engine.add_request(f"given-{len(engine.requests)}-{prompt[0]}", {"prompt_token_ids": prompt}, GREEDY, given)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.kv_connector.between_steps(wait=True)
    return outputs[-1]


def test_the_connectors_compose_a_request_starts_on_the_longest_prefix_offered(
    tiny_llama: Path, prompts: list[list[int]], expected: list[list[int]], stored: Path
) -> None:
    """The file tier and a peer's pulled prefix, asked in order: the longer one is loaded,
    the other dropped; and a request aborted while its read is on its way holds nothing."""
    prompt = prompts[3]  # 97 tokens: 6 full blocks stored
    reader = LLM(str(tiny_llama), dtype="float32", kv_cache_dir=str(stored))
    whole = _tier(reader).read_prefix(_hashes(prompt), prompt[:96], local=0)
    assert whole is not None and whole.num_tokens == 96
    short_peer = RemoteKV(32, [k[:2] for k in whole.keys], [v[:2] for v in whole.values], origin="peer")
    output = _answer(reader, prompt, short_peer)  # the files hold more: they win
    assert output.num_cached_tokens == 96 and output.outputs[0].token_ids == expected[3]
    assert reader.stats().kv_tier.hits == 2  # type: ignore[union-attr]  (the direct read above, and this one)
    plain = LLM(str(tiny_llama), dtype="float32")  # no files: the peer's prefix
    output = _answer(plain, prompt, RemoteKV(96, whole.keys, whole.values, origin="peer"))
    assert output.num_cached_tokens == 96 and output.outputs[0].token_ids == expected[3]
    reader.engine.reset_prefix_cache()
    reader.engine.add_request("gone", {"prompt_token_ids": prompt}, GREEDY)
    reader.engine.abort_request("gone")
    assert_no_block_leaked(reader)
    assert_no_block_leaked(plain)
