"""int8 W8A8 checkpoints in vLLM's compressed-tensors form, served as int8.

config.json's `quantization_config` says `"quant_method": "compressed-tensors"` and
`"format": "int-quantized"`; its config groups quantize weights to int8, symmetric, per
output channel (or per tensor) and input activations to int8, symmetric, per token and
dynamic (or per tensor with a static scale). Each quantized Linear stores `weight` as int8,
`weight_scale` ([out, 1], or one value) and, when static, `input_scale`; layers the config
ignores (usually lm_head) stay float. This is what llm-compressor's W8A8 recipes write.

The float model loads as from any checkpoint, each int8 weight dequantized (w = scale * q):
that is all tensor parallelism or `quantization="none"` need. Then, with the int8 path on,
each linear layer takes its checkpoint's int8 weights (q/k/v and gate/up stacked as our
fused layers are) and frees the float ones.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch
from torch import nn

from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.layers.int8 import Int8Weight
from pagefleet.engine.layers.linear import Linear

if TYPE_CHECKING:
    from pagefleet.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

_SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".weight_zero_point", ".input_zero_point")


def _refuse(message: str) -> NoReturn:
    raise InvalidParameterError("quantization", message)


def _check_int8(args: dict, what: str, strategies: tuple[str, ...]) -> None:
    if args.get("type", "int") != "int" or args.get("num_bits") != 8:
        _refuse(
            f"{what}: only int8 is served (num_bits 8, type int); got {args.get('num_bits')} bit {args.get('type')}"
        )
    if not args.get("symmetric", True):
        _refuse(f"{what}: only symmetric int8 is served (symmetric: true)")
    if args.get("strategy") not in strategies:
        _refuse(f"{what}: strategy must be {' or '.join(strategies)}; got {args.get('strategy')!r}")


def is_int8_checkpoint(model_dir: Path) -> bool:
    """Whether `model_dir` holds an int8 W8A8 compressed-tensors checkpoint; False for an
    unquantized one. A quantization pagefleet cannot serve is refused, naming what."""
    config = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    if config is None:
        return False
    method = config.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts, dequantized as they load (engine/loader/mxfp4.py)
        return False
    if method != "compressed-tensors":
        _refuse(
            f"{method!r} checkpoints are not served; pagefleet serves GGUF files, int8 W8A8 compressed-tensors "
            "and gpt-oss's MXFP4 experts"
        )
    for name, group in config.get("config_groups", {}).items():
        if group.get("format", config.get("format")) != "int-quantized":
            _refuse(f"config group {name}: format must be int-quantized (int8 W8A8)")
        _check_int8(group.get("weights") or {}, f"config group {name} weights", ("channel", "tensor"))
        inputs = group.get("input_activations")
        if inputs is None:
            _refuse(f"config group {name}: weight-only int8 (W8A16) is not served; W8A8 quantizes activations too")
        _check_int8(inputs, f"config group {name} input activations", ("token", "tensor"))
        if inputs.get("dynamic", False) != (inputs.get("strategy") == "token"):
            _refuse(f"config group {name} input activations: per token and dynamic, or per tensor and static")
    return True


class Int8Checkpoint:
    """The int8 weights of a W8A8 checkpoint, collected as the float model loads."""

    def __init__(self, scales: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`scales`: the checkpoint's scale and zero-point tensors (read before the weights,
        which come first in a file's order)."""
        self._scales = dict(scales)
        for name, zero_point in self._scales.items():
            if name.endswith("zero_point") and bool(zero_point.any()):
                _refuse(f"{name}: asymmetric int8 (a nonzero zero point) is not served")
        self.weights: dict[str, Int8Weight] = {}

    @staticmethod
    def wants(name: str) -> bool:
        """Whether the constructor needs tensor `name` (a scale or zero point)."""
        return name.endswith(_SCALE_SUFFIXES)

    def float_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors for the float model: each int8 weight dequantized (and
        kept, by layer name), scales and zero points dropped."""
        for name, tensor in weights:
            if name.endswith(_SCALE_SUFFIXES):
                continue
            if tensor.dtype == torch.int8 and name.endswith(".weight"):
                layer = name.removesuffix(".weight")
                scale = self._scales.get(layer + ".weight_scale")
                if scale is None:
                    _refuse(f"{name} is int8 but the checkpoint has no {layer}.weight_scale")
                scales = scale.float().reshape(-1).expand(tensor.shape[0]).contiguous()
                input_scale = self._scales.get(layer + ".input_scale")
                if input_scale is not None:
                    input_scale = input_scale.float().reshape(())
                weight = Int8Weight(tensor, scales, input_scale)
                self.weights[layer] = weight
                tensor = weight.dequantize()
            yield name, tensor

    def quantize(self, model: nn.Module, config: ModelConfig) -> None:
        """Put the int8 weights in `model` (single-rank, Llama family); logs what it kept."""
        if config.family != "llama":
            logger.info("int8 W8A8: %s weights are served dequantized", config.architecture)
            return
        modules = dict(model.named_modules())
        used: set[str] = set()
        float_bytes = int8_bytes = 0
        for module_name, sources in _llama_sources(config).items():
            parts = [self.weights.get(source) for source in sources]
            if any(part is None for part in parts):
                continue  # ignored by the checkpoint's config: float
            linear = modules[module_name]
            assert isinstance(linear, Linear)
            fused = Int8Weight.cat([part for part in parts if part is not None])
            float_bytes += linear.weight.numel() * linear.weight.element_size()
            linear.quantize(fused)
            int8_bytes += fused.nbytes
            used.update(sources)
        left = sorted(set(self.weights) - used)
        logger.info(
            "int8 W8A8: %d projections served as int8 (%.0f MiB, %.0f MiB in float)%s",
            len(used),
            int8_bytes / 2**20,
            float_bytes / 2**20,
            f"; dequantized: {', '.join(left)}" if left else "",
        )
        self.weights.clear()


def _llama_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Our fused linear layers (module paths) and the checkpoint's layers they stack."""
    from pagefleet.engine.models.llama import FUSED_PROJECTIONS  # here: models imports this module

    sources = {"lm_head": ["lm_head"]} if not config.tie_word_embeddings else {}
    for i in range(config.num_layers):
        for ours, parts in FUSED_PROJECTIONS.items():
            sources[f"layers.{i}.{ours}"] = [f"model.layers.{i}.{part}" for part in parts]
    return sources
