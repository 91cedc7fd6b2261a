"""The gateway hashes a request's prompt exactly as the engine will: the engine's prompt path
(its chat route's rendering, its tokenizer) and its KV cache manager's registration give the
same block hashes as the gateway's PromptHasher, fed what a replica's /tokenizer_info says."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import AutoTokenizer

from pagefleet.engine.core.block_pool import take_events
from pagefleet.engine.core.kv_cache_manager import KVCacheManager
from pagefleet.engine.core.request import Sequence
from pagefleet.engine.front.inputs import prefix_hash_root
from pagefleet.engine.loader.source import resolve_model_dir
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.server.chat import chat_prompt
from pagefleet.engine.server.tokenizer_info import _describe
from pagefleet.gateway.hash_runs import HashRuns
from pagefleet.gateway.prompt_hashes import PromptHasher
from pagefleet.protocol.block_hash import block_hashes, chain_root
from pagefleet.protocol.openai import ChatCompletionRequest
from pagefleet.protocol.tokenizer_info import TokenizerInfo

BLOCK_SIZE = 4
# A template that takes tools itself (SmolLM2's does not: the engine writes them into the
# system message), for the GPT-2-style tokenizer the tiny test models use.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SYSTEM = "You are a careful assistant for a travel company. Answer in one short sentence. " * 3
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HISTORY = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Is Paris sunny?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    {"role": "user", "content": "And <|im_start|> Rome, tomorrow?"},
]


def _engine_hashes(
    tokenizer: Any, payload: dict[str, Any], chat: bool, adapter: str | None = None, long_rope_after: int | None = None
) -> list[int]:
    """What the engine registers in its prefix cache for the request's prompt."""
    if chat:
        token_ids = chat_prompt(SimpleNamespace(tokenizer=tokenizer), ChatCompletionRequest.model_validate(payload))  # type: ignore[arg-type]
    elif isinstance(payload["prompt"], str):
        token_ids = list(tokenizer.encode(payload["prompt"]))  # LLMEngine.prompt_token_ids
    else:
        token_ids = list(payload["prompt"])
    lora = LoRARequest(adapter, 1, "/adapters/" + adapter) if adapter else None
    cache = KVCacheManager(num_blocks=256, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache.pool.enable_events()
    long_rope = long_rope_after is not None and len(token_ids) > long_rope_after  # LLMEngine._rotates_long
    root = prefix_hash_root(lora, payload.get("cache_salt"), long_rope)
    seq = Sequence(0, token_ids, len(token_ids), hash_root=root)
    assert cache.allocate_slots(seq, len(token_ids)) is not None
    cache.commit(seq, len(token_ids))
    assert cache.pool.events is not None
    return [event.block_hash for event in take_events(cache.pool.events) if event.stored]


def _hasher(tokenizer: Any) -> PromptHasher:
    """The gateway's hasher, from what the replica's /tokenizer_info answers."""
    return PromptHasher(TokenizerInfo.model_validate_json(_describe(tokenizer, "m", BLOCK_SIZE)))


def _payloads(model: str) -> list[tuple[dict[str, Any], bool]]:
    chat = {"model": model, "messages": HISTORY}
    return [
        ({"model": model, "prompt": SYSTEM + "Where is the Louvre?"}, False),
        ({"model": model, "prompt": list(range(3, 40))}, False),
        (
            {"model": model, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]},
            True,
        ),
        (chat, True),
        ({**chat, "tools": [WEATHER]}, True),
        ({**chat, "tools": [WEATHER], "tool_choice": "none"}, True),
        ({**chat, "cache_salt": "tenant-a"}, True),
    ]


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def gpt2_style_tokenizer(tiny_llama: Path) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("which", ["smollm2_tokenizer", "gpt2_style_tokenizer"])
def test_the_gateways_hashes_are_the_engines(which: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(which)
    hasher = _hasher(tokenizer)
    # The second pass takes every link of every chain from what the hasher remembers.
    for payload, chat in _payloads("m") * 2:
        for adapter in (None, "sql-lora"):
            engine = _engine_hashes(tokenizer, payload, chat, adapter)
            hashed = hasher.hashes(payload, chat, adapter)
            assert hashed is not None, payload
            num_tokens, gateway = hashed
            # The gateway hashes the blocks the engine can take from its cache: all but the
            # prompt's last token, whose logits are computed in any case.
            assert len(engine) == num_tokens // BLOCK_SIZE and len(gateway) == (num_tokens - 1) // BLOCK_SIZE > 4
            assert gateway == engine[: len(gateway)], (which, payload, adapter)


def test_a_longrope_models_long_prompts_hash_from_the_long_root_as_the_engines(smollm2_tokenizer: Any) -> None:
    """Phi-3-128k and Phi-4-mini rotate a prompt longer than their pretraining length by
    other factors: its blocks have a root of their own, which the replica's /tokenizer_info
    lets the gateway compute. Here the pretraining length is 40 tokens."""
    info = TokenizerInfo.model_validate_json(_describe(smollm2_tokenizer, "m", BLOCK_SIZE, long_rope_after=40))
    hasher = PromptHasher(info)
    for prompt in (list(range(3, 40)), list(range(3, 80))):
        payload = {"model": "m", "prompt": prompt}
        hashed = hasher.hashes(payload, False, None)
        assert hashed is not None
        engine = _engine_hashes(smollm2_tokenizer, payload, False, long_rope_after=40)
        assert hashed[1] == engine[: len(hashed[1])] and hashed[1]
        plain = _engine_hashes(smollm2_tokenizer, payload, False)
        assert (hashed[1][0] == plain[0]) == (len(prompt) <= 40), "only the long prompt takes the long root"


def test_adapters_and_salts_start_chains_apart(smollm2_tokenizer: Any) -> None:
    hasher = _hasher(smollm2_tokenizer)
    payload = {"model": "m", "prompt": SYSTEM}
    chains = [
        hasher.hashes(payload, False, None),
        hasher.hashes(payload, False, "sql-lora"),
        hasher.hashes({**payload, "cache_salt": "tenant-a"}, False, None),
        hasher.hashes({**payload, "cache_salt": "tenant-b"}, False, None),
    ]
    first_blocks = {chain[1][0] for chain in chains if chain is not None}
    assert len(first_blocks) == 4, "no two of them may share a block"


def test_cached_pieces_do_not_change_the_tokens(smollm2_tokenizer: Any) -> None:
    """The second request with the same system prompt reuses its tokens: the result is
    still the whole text's tokenization."""
    hasher = _hasher(smollm2_tokenizer)
    for question in ("Where is the Louvre?", " where is it?", "\n\nAnd  the Prado?"):
        text = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        assert hasher.token_ids(text, add_special_tokens=False) == smollm2_tokenizer.encode(text)


def test_bodies_the_engine_would_refuse_have_no_hashes(smollm2_tokenizer: Any) -> None:
    hasher = _hasher(smollm2_tokenizer)
    assert hasher.hashes({"model": "m", "messages": "not a list"}, True, None) is None
    assert hasher.hashes({"model": "m", "prompt": {"odd": 1}}, False, None) is None
    assert hasher.hashes({"model": "m", "prompt": ""}, False, None) is None
    assert hasher.hashes({"model": "m", "prompt": [5, -3, 2**40]}, False, None) is None, "ids outside the vocabulary"


def test_the_shared_renderer_gives_transformers_tokens(smollm2_tokenizer: Any) -> None:
    """The engine renders chat prompts with runtime/chat_prompt.py, not transformers: on
    SmolLM2's template both give the same tokens, with and without a system prompt."""
    from pagefleet.engine.front.chat_template import apply_chat_template

    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [
            {"role": "system", "content": SYSTEM},
            *[{"role": m["role"], "content": m["content"] or ""} for m in HISTORY[1:2]],
        ],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ]
    for conversation in conversations:
        for generation_prompt in (True, False):
            expected = smollm2_tokenizer.apply_chat_template(
                conversation, add_generation_prompt=generation_prompt, tokenize=True
            )
            expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
            assert apply_chat_template(smollm2_tokenizer, conversation, generation_prompt) == expected


@pytest.mark.parametrize("which", ["smollm2_tokenizer", "gpt2_style_tokenizer"])
def test_text_tokenized_word_by_word_is_the_whole_texts_tokenization(
    which: str, request: pytest.FixtureRequest
) -> None:
    """Byte-level BPE tokenizers are tokenized a word at a time with the words' ids cached:
    on text with every kind of word boundary (contractions, digits, runs of spaces and
    newlines, Unicode spaces and letters, punctuation), the ids are still the whole text's."""
    tokenizer = request.getfixturevalue(which)
    hasher = _hasher(tokenizer)
    assert hasher._words is not None, "SmolLM2's and GPT-2's tokenizers are split word by word"
    rng = random.Random(7)
    pieces = [
        "it's", "we'll", "I'M", "don't", " 12345", "3.14", "x2", "  ", "\n", "\n\n", " \n ", "\t", "\u00a0",
        "\u3000", "\x1c", "café", "naïve", "東京", "🙂", "--", "?!", " (a)", "$5", "hello", " world", "'", "''s",
    ]  # fmt: skip
    ascii_pieces = [piece for piece in pieces if piece.isascii()]
    for choices in [pieces] * 300 + [ascii_pieces] * 300:
        text = "".join(rng.choice(choices) + rng.choice(["", " ", "  "]) for _ in range(rng.randint(1, 30)))
        assert hasher.token_ids(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False), (
            text
        )
    assert hasher.token_ids(SYSTEM, add_special_tokens=False) == tokenizer.encode(SYSTEM, add_special_tokens=False)


def test_hash_runs_reuse_earlier_chains_and_give_block_hashes_answer() -> None:
    """Prompts sharing a start, one a prefix of another, a longer one after a shorter, and
    another root: every answer is the plain chain's, whatever was hashed before."""
    rng = random.Random(3)
    system = [rng.randrange(50_000) for _ in range(200)]
    prompts = [
        system + [1, 2, 3] * 10,
        system + [4, 5] * 20,  # diverges after the system prompt
        system[:100],  # a prefix of the kept chain
        system[:37] + [9] * 80,  # diverges inside a block
        system + [4, 5] * 40,  # longer than anything before
        [7] * 15,  # not one full block
        system,
    ]
    runs, known = HashRuns(kept=2), {}
    for root in (chain_root(), chain_root("adapter")):
        for prompt in prompts:
            assert runs.hashes(prompt, 16, root, known) == block_hashes(prompt, 16, root), prompt[:3]
