"""GPT-2 on a flat token batch: learned positions, LayerNorm, fused c_attn, GELU (tanh).

HF stores GPT-2's linear layers as Conv1D, i.e. weights of shape [in, out]; they are
transposed once at load so every matmul is an ordinary `F.linear`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from pagefleet.engine.layers.linear import Linear, frozen_parameter
from pagefleet.engine.lora.adapter import LoRATarget
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.weights import WeightLoader

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"GPT-2 activation {config.hidden_act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.ln_1 = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.ln_2 = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.qkv = Linear(hidden, 3 * hidden, bias=True)
        self.o = Linear(hidden, hidden, bias=True)
        self.fc = Linear(hidden, config.intermediate_size, bias=True)
        self.proj = Linear(config.intermediate_size, hidden, bias=True)
        self.act = _ACTIVATIONS[config.hidden_act]
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv(self.ln_1(hidden))
        q, k, v = (t.reshape(num_tokens, self.num_heads, self.head_dim) for t in qkv.chunk(3, dim=-1))
        attn = backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        hidden = hidden + self.o(attn.reshape(num_tokens, -1))
        return hidden + self.proj(self.act(self.fc(self.ln_2(hidden))))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.wte = self.lm_head.weight if config.tie_word_embeddings else frozen_parameter(*self.lm_head.weight.shape)
        self.wpe = frozen_parameter(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCache,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.wte) + F.embedding(positions, self.wpe)
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            hidden = block(hidden, kv_cache, metadata, backend)
        return self.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def lora_targets(self) -> dict[str, LoRATarget]:
        """PEFT's GPT-2 modules: the fused c_attn, c_proj, and the MLP's c_fc and c_proj."""
        targets = {}
        for i, block in enumerate(self.h):
            assert isinstance(block, GPT2Block)
            modules = {"attn.c_attn": block.qkv, "attn.c_proj": block.o, "mlp.c_fc": block.fc, "mlp.c_proj": block.proj}
            for name, linear in modules.items():
                targets[f"transformer.h.{i}.{name}"] = LoRATarget(linear, 0, 1, 0, linear.weight.shape[0])
        return targets

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        conv1d = torch.Tensor.t  # HF Conv1D keeps [in, out]; a linear layer wants [out, in]
        loader.direct("transformer.wte.weight", "wte")
        loader.direct("transformer.wpe.weight", "wpe")
        loader.direct("transformer.ln_f.weight", "ln_f.weight")
        loader.direct("transformer.ln_f.bias", "ln_f.bias")
        if not self.config.tie_word_embeddings:
            loader.direct("lm_head.weight", "lm_head.weight")
        for i in range(self.config.num_layers):
            hf, ours = f"transformer.h.{i}.", f"h.{i}."
            for norm in ("ln_1", "ln_2"):
                loader.direct(hf + f"{norm}.weight", ours + f"{norm}.weight")
                loader.direct(hf + f"{norm}.bias", ours + f"{norm}.bias")
            for hf_layer, ours_layer in (
                ("attn.c_attn", "qkv"),
                ("attn.c_proj", "o"),
                ("mlp.c_fc", "fc"),
                ("mlp.c_proj", "proj"),
            ):
                loader.direct(hf + f"{hf_layer}.weight", ours + f"{ours_layer}.weight", conv1d)
                loader.direct(hf + f"{hf_layer}.bias", ours + f"{ours_layer}.bias")
        loader.load(weights, ignore=(".attn.bias", ".attn.masked_bias"))
