"""Explicit mapping from Hugging Face weight names to our parameters.

Each model declares, name by name, where every HF tensor goes (directly, transposed, or as
one part of a fused matrix), or that it is skipped (another tensor-parallel rank's experts).
Loading fails loudly on a missing or unexpected tensor, so a naming mismatch can never
leave random weights behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pagefleet.engine.errors import UnsupportedModelError

Transform = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class _Target:
    param: str
    part: int  # index among the fused sources
    num_parts: int
    transform: Transform | None


class WeightLoader:
    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._targets: dict[str, _Target] = {}
        self._skipped: set[str] = set()

    def direct(self, hf_name: str, param: str, transform: Transform | None = None) -> None:
        self._targets[hf_name] = _Target(param, 0, 1, transform)

    def fused(
        self, hf_names: list[str], param: str, transforms: list[Transform | None] | Transform | None = None
    ) -> None:
        """Concatenate `hf_names` along dim 0 into `param` (e.g. q, k, v -> qkv), each after
        its own transform if `transforms` is a list (a tensor-parallel rank's rows of each)."""
        for index, name in enumerate(hf_names):
            transform = transforms[index] if isinstance(transforms, list) else transforms
            self._targets[name] = _Target(param, index, len(hf_names), transform)

    def skip(self, hf_names: Iterable[str]) -> None:
        """Drop these tensors if the checkpoint has them: they are known, and not this
        model's to hold (the experts of another tensor-parallel rank)."""
        self._skipped.update(hf_names)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], ignore: tuple[str, ...] = ()) -> None:
        parts: dict[str, list[torch.Tensor | None]] = {}
        for name, tensor in weights:
            target = self._targets.get(name)
            if target is None:
                if name in self._skipped or name.endswith(ignore):
                    continue
                raise UnsupportedModelError(f"unexpected weight {name!r} in checkpoint")
            if target.transform is not None:
                tensor = target.transform(tensor)
            parts.setdefault(target.param, [None] * target.num_parts)[target.part] = tensor
        missing = sorted(n for n, t in self._targets.items() if parts.get(t.param, [None])[t.part] is None)
        if missing:
            raise UnsupportedModelError(f"checkpoint lacks weights: {', '.join(missing[:5])}")
        for param_name, pieces in parts.items():
            param = self._params[param_name]
            tensors = [piece for piece in pieces if piece is not None]
            value = torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0]
            if value.shape != param.shape:
                raise UnsupportedModelError(
                    f"weight for {param_name} has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
                )
            param.data = value.to(param.dtype).contiguous()


def conv1d_kernel(weight: torch.Tensor) -> torch.Tensor:
    """A depthwise conv1d's weight [C, 1, K] -> [C, K] (linear-attention layers)."""
    return weight.reshape(weight.shape[0], -1)
