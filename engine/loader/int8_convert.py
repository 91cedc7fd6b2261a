"""Write an int8 W8A8 checkpoint in compressed-tensors form from a float Hugging Face one.

    python -m pagefleet.engine.loader.int8_convert SRC_DIR DST_DIR [--smoothing 0.5] [--static-input-scale S]

As llm-compressor's W8A8 recipe does (SmoothQuant, then int8 weights; it rounds with GPTQ,
this to nearest): a Llama-family model is first smoothed, so that per-token int8
activations lose less. A few outlier input channels carry most of an activation row's
range; SmoothQuant divides each input channel j of a layer by s_j = max|x_j|^a /
max|w_j|^(1-a) (a = `--smoothing`, measured on calibration text) and multiplies the weight
column by it, folding the division into what comes before (the RMSNorm before q/k/v and
before gate/up; up_proj's rows before down_proj), so the float model computes the same
function. Calibration: 2048 tokens of Python's own documentation (`pydoc_data.topics`),
none of the topics the benchmarks evaluate on. `--smoothing 0` skips it.

Then every linear projection (`*_proj.weight`) becomes int8 with a per-channel scale
(max |w| / 127); embeddings, norms and lm_head stay float (the recipes ignore lm_head).
Activations are dynamic per token unless a static scale is given. The result loads in
pagefleet (`quantization="compressed-tensors"`) and in vLLM.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagefleet.engine.models.loading import iter_weights

_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "actorder": None}


def quantization_config(static_input_scale: bool) -> dict:
    """config.json's `quantization_config` for int8 weights per channel and int8 inputs."""
    strategy, dynamic = ("tensor", False) if static_input_scale else ("token", True)
    inputs = {**_INT8, "strategy": strategy, "dynamic": dynamic}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**_INT8, "strategy": "channel", "dynamic": False},
                "input_activations": inputs,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def quantize_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [out, in] and float32 scales [out, 1]: round(w / scale), scale = max |w| / 127."""
    weight = weight.float()
    amax = weight.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (weight / scales).round().clamp(-128, 127).to(torch.int8), scales


# Topics of pydoc_data.topics left out of calibration: the texts tests and benchmarks score.
EVALUATION_TOPICS = ("assignment", "compound")
CALIBRATION_TOKENS = 2048


def calibration_text() -> str:
    from pydoc_data.topics import topics

    return "\n".join(text for name, text in sorted(topics.items()) if name not in EVALUATION_TOPICS)


def _input_channel_maxima(source: Path, layers: list[str], num_tokens: int) -> dict[str, torch.Tensor]:
    """max |x_j| over the calibration tokens of the inputs of each module in `layers`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    token_ids = AutoTokenizer.from_pretrained(source).encode(calibration_text())[:num_tokens]
    maxima: dict[str, torch.Tensor] = {}

    def record(name: str):  # type: ignore[no-untyped-def]
        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            channel_max = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(dim=0)
            maxima[name] = torch.maximum(maxima[name], channel_max) if name in maxima else channel_max

        return hook

    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_pre_hook(record(name)) for name in layers]
    with torch.no_grad():
        for start in range(0, len(token_ids), 512):
            model(torch.tensor([token_ids[start : start + 512]]))
    for handle in handles:
        handle.remove()
    return maxima


def smooth(
    source: Path, tensors: dict[str, torch.Tensor], strength: float, calibration_tokens: int = CALIBRATION_TOKENS
) -> None:
    """SmoothQuant on a Llama-family checkpoint's float tensors, in place (see above)."""
    config = json.loads((source / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    groups = []  # (the input's maxima, the layers that read it, what produces it: a norm or up_proj)
    for i in range(num_layers):
        hf = f"model.layers.{i}."
        groups.append((hf + "self_attn.q_proj", [hf + f"self_attn.{p}_proj" for p in "qkv"], hf + "input_layernorm"))
        groups.append(
            (hf + "mlp.gate_proj", [hf + "mlp.gate_proj", hf + "mlp.up_proj"], hf + "post_attention_layernorm")
        )
        groups.append((hf + "mlp.down_proj", [hf + "mlp.down_proj"], hf + "mlp.up_proj"))
    maxima = _input_channel_maxima(source, sorted({reader for reader, _, _ in groups}), calibration_tokens)
    for reader, layers, producer in groups:
        weight_max = torch.stack([tensors[f"{layer}.weight"].float().abs().amax(dim=0) for layer in layers]).amax(dim=0)
        scales = (maxima[reader].clamp(min=1e-5) ** strength / weight_max.clamp(min=1e-5) ** (1 - strength)).clamp(
            min=1e-5
        )
        for layer in layers:
            name = f"{layer}.weight"
            tensors[name] = (tensors[name].float() * scales).to(tensors[name].dtype)  # columns
        name = f"{producer}.weight"
        produced = tensors[name].float()
        produced = produced / scales if produced.dim() == 1 else produced / scales.unsqueeze(1)  # norm, or up's rows
        tensors[name] = produced.to(tensors[name].dtype)


def convert(
    source: Path,
    target: Path,
    static_input_scale: float | None = None,
    smoothing: float = 0.5,
    calibration_tokens: int = CALIBRATION_TOKENS,
) -> None:
    """Write the W8A8 checkpoint of the float model in `source` to `target` (see above)."""
    target.mkdir(parents=True, exist_ok=True)
    tensors = dict(iter_weights(source))
    config = json.loads((source / "config.json").read_text())
    if smoothing > 0 and config.get("model_type") in ("llama", "mistral", "qwen2", "qwen3"):
        smooth(source, tensors, smoothing, calibration_tokens)
    for name, tensor in list(tensors.items()):
        if name.endswith("_proj.weight") and tensor.dim() == 2:
            layer = name.removesuffix(".weight")
            tensors[name], scales = quantize_channels(tensor)
            tensors[layer + ".weight_scale"] = scales.to(tensor.dtype)
            if static_input_scale is not None:
                tensors[layer + ".input_scale"] = torch.tensor([static_input_scale], dtype=tensor.dtype)
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = quantization_config(static_input_scale is not None)
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in source.iterdir():  # tokenizer and generation config
        weights = path.suffix in (".safetensors", ".bin", ".pt") or path.name.endswith(".index.json")
        if path.is_file() and not weights and path.name != "config.json":
            shutil.copy2(path, target / path.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a float Hugging Face model directory")
    parser.add_argument("target", type=Path, help="where to write the int8 W8A8 checkpoint")
    parser.add_argument("--static-input-scale", type=float, default=None, help="one activation scale for all layers")
    parser.add_argument("--smoothing", type=float, default=0.5, help="SmoothQuant's strength a (0: none)")
    args = parser.parse_args()
    convert(args.source, args.target, args.static_input_scale, args.smoothing)
    print(f"wrote {args.target}")


if __name__ == "__main__":
    main()
