"""A PEFT LoRA adapter read from disk into host memory, keyed by the model's projections.

PEFT saves `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, `use_rslora`) and
`adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` ([r, in]) and
`lora_B.weight` ([out, r]) per adapted module, named as in the Hugging Face model
(`model.layers.0.self_attn.q_proj`, GPT-2's `transformer.h.0.attn.c_attn`). Each model
names the modules it can adapt (`lora_targets()`); B is scaled here by alpha / r (alpha /
sqrt(r) with rsLoRA), so serving is two matmuls and nothing else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet.engine.errors import AdapterNotFoundError, InvalidParameterError
from pagefleet.engine.layers.linear import Linear
from pagefleet.engine.lora.request import LoRARequest

_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """Where a checkpoint module's LoRA lands: a projection of ours, and which of its fused
    parts (`segment` of `num_segments`, output rows [row_start, row_end))."""

    linear: Linear
    segment: int
    num_segments: int
    row_start: int
    row_end: int


@dataclass(slots=True)
class LoRAAdapter:
    request: LoRARequest
    rank: int
    # checkpoint module name -> (A [r, in], B [out_rows, r] already scaled), on the host
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def load_adapter(
    request: LoRARequest, targets: dict[str, LoRATarget], max_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """Read and check an adapter.

    Raises:
        InvalidParameterError: ("lora_request") a missing directory or file, a rank above
            `max_rank`, a module this model cannot adapt, or weights of the wrong shape.
    """
    from safetensors.torch import load_file

    def fail(message: str) -> InvalidParameterError:
        return InvalidParameterError("lora_request", f"adapter {request.lora_name!r} at {request.lora_path}: {message}")

    directory = Path(request.lora_path)
    config_path, weights_path = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not directory.is_dir():
        raise AdapterNotFoundError("lora_path", f"no adapter found at {request.lora_path}")
    if not config_path.is_file() or not weights_path.is_file():
        raise fail("needs adapter_config.json and adapter_model.safetensors (PEFT's format)")
    try:
        config = json.loads(config_path.read_text())
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise fail(f"adapter_config.json is not a LoRA config ({type(error).__name__}: {error})") from None
    # vLLM's wording for each refusal, which clients and tests match.
    if config.get("peft_type", "LORA") != "LORA":
        raise fail(f"a {config.get('peft_type')} adapter; only LoRA is served")
    if config.get("use_dora"):
        raise fail("pagefleet does not yet support DoRA (use_dora): its magnitude vectors are not served")
    if config.get("modules_to_save"):
        raise fail(f"pagefleet only supports modules_to_save being None, not {config['modules_to_save']}")
    if rank > max_rank:
        raise fail(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(str(weights_path))
    other = sorted(key for key in tensors if not key.endswith((".lora_A.weight", ".lora_B.weight")))
    if other:  # served without them, the adapter would answer wrongly without a word
        raise fail(f"holds weights that are not LoRA pairs ({', '.join(other[:3])}), which are not served")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in tensors:
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(_PREFIX).removesuffix(".lora_A.weight")
        target = targets.get(module)
        if target is None:
            raise fail(f"adapts {module!r}, which this model cannot (it adapts q/k/v/o and gate/up/down projections)")
        lora_a, lora_b = tensors[key], tensors.get(key.replace(".lora_A.", ".lora_B."))
        rows = target.row_end - target.row_start
        if lora_b is None or lora_a.shape != (rank, target.linear.in_features) or lora_b.shape != (rows, rank):
            raise fail(f"the weights of {module!r} do not fit the model")
        weights[module] = (lora_a.to(dtype), (lora_b.float() * scaling).to(dtype))
    if not weights:
        raise fail("holds no LoRA weights")
    return LoRAAdapter(request, rank, weights)
