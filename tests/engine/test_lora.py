"""Multi-LoRA serving against PEFT: tiny random models of each family, two random adapters
of different ranks (and different target modules), mixed in one batch with base-model
requests; greedy output token for token as transformers + PEFT give it, and as the base
model with the adapter merged into its weights gives it."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefleet.engine import LLM, InvalidParameterError, LoRARequest, SamplingParams
from tests.engine.helpers import assert_no_block_leaked, random_prompts

FAMILIES = ["llama", "qwen2", "gpt2"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# (rank, alpha, target modules) of the two adapters of each family.
ADAPTERS = {
    "gpt2": [(8, 16, ["c_attn", "c_proj", "c_fc"]), (4, 4, ["c_attn"])],
    "default": [
        (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        (4, 8, ["q_proj", "v_proj", "down_proj"]),
    ],
}


def _base(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()


@cache
def _adapter_dirs(model_dir: Path, arch: str) -> list[Path]:
    """Two random PEFT adapters saved next to the model (B random too: PEFT would start it at 0)."""
    from peft import LoraConfig, get_peft_model

    dirs = []
    for index, (rank, alpha, modules) in enumerate(ADAPTERS.get(arch, ADAPTERS["default"])):
        torch.manual_seed(100 + index)
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=modules,
            init_lora_weights=False,
            fan_in_fan_out=arch == "gpt2",
        )
        peft_model = get_peft_model(_base(model_dir), config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.2)
        target = model_dir.parent / f"{model_dir.name}-lora-{index}"
        peft_model.save_pretrained(target)
        dirs.append(target)
    return dirs


def _peft_greedy(model_dir: Path, adapter: Path | None, prompt: list[int], tokens: int) -> list[int]:
    from peft import PeftModel

    model = _base(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_mixed_batch_equals_transformers_with_peft(tiny_models: dict[str, Path], arch: str) -> None:
    model_dir = tiny_models[arch]
    first, second = _adapter_dirs(model_dir, arch)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    adapters = [LoRARequest("first", 1, str(first)), LoRARequest("second", 2, str(second)), None]
    prompts = random_prompts([5, 17, 9, 30, 12, 3], vocab=300, seed=1)
    loras = [adapters[i % 3] for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras)
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        adapter = Path(lora.lora_path) if lora is not None else None
        expected = _peft_greedy(model_dir, adapter, prompt, GREEDY.max_tokens or 0)
        assert output.outputs[0].token_ids == expected, (arch, lora)
    base = [o.outputs[0].token_ids for o, lora in zip(outputs, loras, strict=True) if lora is None]
    adapted = [o.outputs[0].token_ids for o, lora in zip(outputs, loras, strict=True) if lora is not None]
    assert base and adapted and set(map(tuple, adapted)) - set(map(tuple, base)), "the adapters changed nothing"
    assert sorted(llm.list_loras()) == ["first", "second"]
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("arch", FAMILIES)
def test_an_adapter_equals_its_weights_merged_into_the_model(
    tiny_models: dict[str, Path], arch: str, tmp_path: Path
) -> None:
    from peft import PeftModel

    model_dir = tiny_models[arch]
    first, _ = _adapter_dirs(model_dir, arch)
    merged = PeftModel.from_pretrained(_base(model_dir), first).merge_and_unload()
    merged.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).exists():
            (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 21], vocab=300, seed=2)]
    served = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    with_adapter = served.generate(prompts, GREEDY, lora_request=LoRARequest("first", 1, str(first)))
    folded = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in with_adapter] == [o.outputs[0].token_ids for o in folded]


def test_one_slot_two_adapters_alternating_evict_and_reload_without_changing_outputs(
    tiny_models: dict[str, Path],
) -> None:
    model_dir = tiny_models["llama"]
    first, second = _adapter_dirs(model_dir, "llama")
    adapters = [LoRARequest("first", 1, str(first)), LoRARequest("second", 2, str(second))]
    prompts = random_prompts([6, 11, 19, 4], vocab=300, seed=3)
    roomy = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    loras = [adapters[i % 2] for i in range(len(prompts))]
    expected = roomy.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras)
    one_slot = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=1, max_lora_rank=8)
    for _ in range(2):  # all in one batch, and again: the slot changes hands every time
        got = one_slot.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    manager = one_slot.engine.lora
    assert manager is not None and manager.num_loads >= 4, "one slot, two adapters: each load evicts the other"
    assert_no_block_leaked(one_slot)


def test_prefix_cache_never_shares_blocks_between_adapters(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["llama"]
    first, second = _adapter_dirs(model_dir, "llama")
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompt = [{"prompt_token_ids": random_prompts([40], vocab=300, seed=4)[0]}]
    one = SamplingParams(max_tokens=1, temperature=0)
    a, b = LoRARequest("first", 1, str(first)), LoRARequest("second", 2, str(second))
    assert llm.generate(prompt, one, lora_request=a)[0].num_cached_tokens == 0
    assert llm.generate(prompt, one, lora_request=a)[0].num_cached_tokens == 32  # its own blocks: hits
    assert llm.generate(prompt, one, lora_request=b)[0].num_cached_tokens == 0  # another adapter: none
    assert llm.generate(prompt, one)[0].num_cached_tokens == 0  # nor the base model
    assert_no_block_leaked(llm)


def test_bad_adapters_are_refused_clearly(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    first, _ = _adapter_dirs(model_dir, "llama")
    prompt = [{"prompt_token_ids": [1, 2, 3]}]
    with pytest.raises(InvalidParameterError, match="enable_lora"):
        LLM(str(model_dir), dtype="float32", num_kv_blocks=16).generate(
            prompt, lora_request=LoRARequest("x", 1, str(first))
        )
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=16, enable_lora=True, max_lora_rank=8)
    with pytest.raises(InvalidParameterError, match="adapter_config.json"):
        llm.generate(prompt, lora_request=LoRARequest("missing", 1, str(tmp_path)))
    # Parts PEFT can save that are not served are refused, never served without them.
    config = json.loads((first / "adapter_config.json").read_text())
    for name, change in (("dora", {"use_dora": True}), ("saves", {"modules_to_save": ["lm_head"]})):
        shutil.copytree(first, tmp_path / name)
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(InvalidParameterError, match="use_dora" if name == "dora" else "modules_to_save"):
            llm.generate(prompt, lora_request=LoRARequest(name, 2, str(tmp_path / name)))
    shutil.copytree(first, tmp_path / "extra")
    weights = load_file(str(first / "adapter_model.safetensors"))
    weights["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(4)
    save_file(weights, str(tmp_path / "extra" / "adapter_model.safetensors"))
    with pytest.raises(InvalidParameterError, match="not LoRA pairs"):
        llm.generate(prompt, lora_request=LoRARequest("extra", 3, str(tmp_path / "extra")))
    small = LLM(str(model_dir), dtype="float32", num_kv_blocks=16, enable_lora=True, max_lora_rank=8)
    small.generate(prompt, lora_request=LoRARequest("first", 1, str(first)))
    with pytest.raises(InvalidParameterError, match="already loaded"):
        small.generate(prompt, lora_request=LoRARequest("first", 1, str(tmp_path)))
    assert_no_block_leaked(llm)
    assert_no_block_leaked(small)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_cpu_operator_matches_its_torch_reference(dtype: torch.dtype) -> None:
    """Runs of several slots (one of them twice, one with no adapter on this projection),
    three segments of a fused projection (whole 64-column tiles and a tail), ranks below
    the slots' maximum, runs longer than one 16-row item and of odd lengths."""
    from pagefleet.engine.lora.layer import LoRABatch, LoRAContext, LoRALayer
    from pagefleet.kernels import cpu_ops

    if not cpu_ops.load():
        pytest.skip("no compiled CPU operators on this machine")
    torch.manual_seed(0)
    segments = [(0, 136), (136, 152), (152, 280)]
    layer = LoRALayer(
        LoRAContext(), 48, 280, segments, max_loras=3, max_rank=16, dtype=dtype, device=torch.device("cpu")
    )
    for slot, rank in ((0, 6), (1, 16)):
        pieces = {s: (torch.randn(rank, 48), torch.randn(end - start, rank)) for s, (start, end) in enumerate(segments)}
        del pieces[1]  # this adapter leaves the middle segment alone
        layer.load(slot, pieces)
    token_slots = [0] * 5 + [-1] * 3 + [1] * 37 + [2] * 4 + [0] * 2
    chunk_slots = [(0, 5), (None, 3), (1, 20), (1, 17), (2, 4), (0, 2)]  # two chunks of slot 1 make one run
    assert [-1 if slot is None else slot for slot, count in chunk_slots for _ in range(count)] == token_slots
    batch = LoRABatch.of(chunk_slots, torch.device("cpu"))
    assert batch is not None and [run[0] for run in batch.runs] == [0, 1, 2, 0]
    layer.context.batch = batch
    x = torch.randn(len(token_slots), 48, dtype=dtype)
    y = torch.randn(len(token_slots), 280, dtype=dtype)
    # The reference in float32 on the same (rounded) weights: the operator sums in float32.
    reference = y.float().clone()
    float_layer = LoRALayer(LoRAContext(), 48, 280, segments, 3, 16, torch.float32, torch.device("cpu"))
    float_layer.a.copy_(layer.a.float())
    float_layer.b.copy_(layer.b.float())
    float_layer.ranks.copy_(layer.ranks)
    float_layer.add_delta_torch(x.float(), reference, batch.runs)
    result = layer.apply(x, y.clone())
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(result.float(), reference, rtol=tolerance, atol=tolerance)
    untouched = [row for row, slot in enumerate(token_slots) if slot in (-1, 2)]
    assert torch.equal(result[untouched], y[untouched])


def test_adapters_are_added_listed_and_removed_by_name_or_id_as_in_vllm(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["llama"]
    first, second = _adapter_dirs(model_dir, "llama")
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=32, enable_lora=True, max_loras=2, max_lora_rank=8)
    assert llm.add_lora(LoRARequest("first", 1, str(first))) and llm.add_lora(LoRARequest("second", 7, str(second)))
    assert llm.list_loras() == ["first", "second"]
    assert llm.remove_lora(7) and llm.remove_lora("first")
    assert llm.list_loras() == [] and not llm.remove_lora(7)


def test_lora_modules_take_vllms_forms_on_the_command_line() -> None:
    from pagefleet.cli.flags import parse_flags
    from pagefleet.engine.server.lora import parse_lora_modules
    from pagefleet.engine.server.settings import ServerSettings

    chat = '{"name": "chat", "path": "/adapters/chat", "base_model_name": "smollm2"}'
    for flags in (
        ["--lora-modules", "sql=/adapters/sql", chat, "--port", "9001"],  # vLLM's nargs="+"
        ["--lora-modules", "sql=/adapters/sql", "--lora-modules", chat],
    ):
        settings = parse_flags(ServerSettings, ["--model", "m", "--enable-lora", *flags], "pagefleet serve")
        assert settings is not None
        assert parse_lora_modules(settings.lora_modules) == [("sql", "/adapters/sql"), ("chat", "/adapters/chat")]
    for bad in ("sql", "=/x", '{"name": "chat"}', '{"name": 3, "path": "/x"}', "{not json"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])


def test_unloading_an_adapter_while_it_and_another_run_changes_no_token(tiny_models: dict[str, Path]) -> None:
    """The unload is handed to the engine thread (AsyncEngine is the engine's one door), so
    a slot is never cleared under a running step: requests on the unloaded adapter and on
    the other one finish with exactly the tokens they would have had."""
    import asyncio

    from pagefleet.engine import AsyncEngine

    model_dir = tiny_models["llama"]
    first, second = _adapter_dirs(model_dir, "llama")
    adapters = [LoRARequest("first", 1, str(first)), LoRARequest("second", 2, str(second))]
    prompts = random_prompts([6, 11, 19, 4, 9, 14], vocab=300, seed=5)
    loras = [adapters[i % 2] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    args = dict(dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    reference = LLM(str(model_dir), **args)
    expected = reference.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)

    async def unload_midway() -> list[list[int]]:
        engine = AsyncEngine(model=str(model_dir), **args)
        try:
            for adapter in adapters:
                await engine.add_lora(adapter)
            streams = [
                engine.generate({"prompt_token_ids": p}, params, f"r{i}", lora_request=lora)
                for i, (p, lora) in enumerate(zip(prompts, loras, strict=True))
            ]
            firsts = [await anext(stream) for stream in streams]  # every request is running
            assert not any(output.finished for output in firsts)
            assert await engine.remove_lora("first")
            finals = [[output async for output in stream][-1] for stream in streams]
            assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
            return [final.outputs[0].token_ids for final in finals]
        finally:
            engine.shutdown()

    assert asyncio.run(unload_midway()) == [o.outputs[0].token_ids for o in expected]
