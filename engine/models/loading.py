"""Build a model from an HF directory: config -> our module -> weights -> dtype/device."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol, cast

import torch
from safetensors import safe_open

from pagefleet.engine.distributed.shard import Shard
from pagefleet.engine.errors import ModelNotFoundError
from pagefleet.engine.layers.attention import AttentionBackend, KVCache, LayerMetadata
from pagefleet.engine.layers.experts import pack_experts
from pagefleet.engine.layers.linear import pack_linears
from pagefleet.engine.loader.compressed_tensors import Int8Checkpoint, is_int8_checkpoint
from pagefleet.engine.loader.gguf_weights import quantize_from_gguf
from pagefleet.engine.loader.mxfp4 import dequantized_mxfp4, is_mxfp4_checkpoint
from pagefleet.engine.lora.adapter import LoRATarget
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.registry import model_class

logger = logging.getLogger(__name__)


class CausalLM(Protocol):
    """What the runner needs of a model family (one file each, see registry.py)."""

    config: ModelConfig

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCache,
        metadata: LayerMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...

    def lora_targets(self) -> dict[str, LoRATarget]: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard | None = None,
    quantized_gguf: Path | None = None,
    int8: bool = False,
) -> tuple[CausalLM, ModelConfig]:
    """The model, or with `shard` one tensor-parallel rank's part of it. With
    `quantized_gguf`, its linear layers serve that file's quantized tensors as stored; with
    `int8`, an int8 W8A8 checkpoint's int8 weights (else they are dequantized)."""
    started = time.monotonic()
    config = ModelConfig.from_dir(model_dir)
    module = model_class(config.family)(config, shard or Shard())  # parameters start uninitialised (torch.empty)
    weights = iter_weights(model_dir)
    if config.language_model_of is not None:
        weights = language_model_weights(weights)
    if is_mxfp4_checkpoint(model_dir):  # gpt-oss as released
        weights = dequantized_mxfp4(weights)
    checkpoint = None
    if is_int8_checkpoint(model_dir):
        checkpoint = Int8Checkpoint(iter_weights(model_dir, select=Int8Checkpoint.wants))
        weights = checkpoint.float_weights(weights)
    module.load_weights(weights)  # type: ignore[operator]
    module = module.to(device=device, dtype=dtype).eval()
    num_params = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    if quantized_gguf is not None:
        quantize_from_gguf(module, config, quantized_gguf)
    if int8 and checkpoint is not None:
        checkpoint.quantize(module, config)
    pack_linears(module)  # last: packed copies do not follow later changes to the weights
    pack_experts(module)
    model = cast(CausalLM, module)
    logger.info(
        "loaded %s (%s, %.1fM parameters%s, %s) in %.1f s",
        model_dir.name,
        config.architecture,
        num_params / 1e6,
        f" on rank {shard.rank} of {shard.size}" if shard is not None and shard.size > 1 else "",
        dtype,
        time.monotonic() - started,
    )
    return model, config


# Where image checkpoints keep their language model: transformers 5's names and 4's.
_LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")


def language_model_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """An image checkpoint's language model under a text model's names; the vision and
    audio towers and their projections are skipped (only text is served)."""
    for name, tensor in weights:
        prefix = next((p for p in _LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            yield "model." + name[len(prefix) :], tensor
        elif name in ("lm_head.weight", "language_model.lm_head.weight"):
            yield "lm_head.weight", tensor


def iter_weights(model_dir: Path, select: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint (or those whose names `select` takes), from
    safetensors (single or sharded) or a .bin file."""
    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = [model_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if files:
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    if select is None or select(name):
                        yield name, handle.get_tensor(name)
        return
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelNotFoundError(f"no safetensors or pytorch_model.bin weights in {model_dir}")
    for path in bins:
        tensors = torch.load(path, map_location="cpu", weights_only=True).items()
        yield from ((name, tensor) for name, tensor in tensors if select is None or select(name))
