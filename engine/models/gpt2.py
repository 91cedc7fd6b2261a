"""GPT-2 on a flat token batch: learned positions, LayerNorm, fused c_attn, GELU (tanh).

HF stores GPT-2's linear layers as Conv1D, i.e. weights of shape [in, out]; they are
transposed once at load so every matmul is an ordinary `F.linear`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.distributed.shard import Shard, columns, rows, vocab_rows
from pagefleet.engine.layers.attention import AttentionBackend, AttentionMetadata, KVCache, LayerMetadata
from pagefleet.engine.layers.linear import Linear, frozen_parameter
from pagefleet.engine.layers.logits import LogitsHead
from pagefleet.engine.layers.quantized import PackedWeight, QuantizedWeight
from pagefleet.engine.lora.adapter import LoRATarget
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.weights import Transform, WeightLoader

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


class GPT2Block(nn.Module):
    """Column-parallel c_attn and c_fc (this rank's heads and MLP rows), row-parallel
    projections (one all-reduce each; their bias lives on rank 0 alone, added once)."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"GPT-2 activation {config.hidden_act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        hidden = config.hidden_size
        self.shard = shard
        self.num_heads, self.head_dim = config.num_heads // shard.size, config.head_dim
        local = self.num_heads * self.head_dim
        intermediate = config.intermediate_size // shard.size
        self.ln_1 = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.ln_2 = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.qkv = Linear(hidden, 3 * local, bias=True)
        self.o = Linear(local, hidden, bias=True)
        self.fc = Linear(hidden, intermediate, bias=True)
        self.proj = Linear(intermediate, hidden, bias=True)
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
        hidden = hidden + self.shard.all_reduce(self.o(attn.reshape(num_tokens, -1)))
        return hidden + self.shard.all_reduce(self.proj(self.act(self.fc(self.ln_2(hidden)))))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard = shard or Shard()
        vocab_start, vocab_end = shard.vocab(config.vocab_size)
        self.lm_head = LogitsHead(config.hidden_size, vocab_end - vocab_start, tied=config.tie_word_embeddings)
        self.wte = self.lm_head.weight if config.tie_word_embeddings else frozen_parameter(*self.lm_head.weight.shape)
        self.wpe = frozen_parameter(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, shard) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.quantized_embedding: QuantizedWeight | PackedWeight | None = None  # a GGUF's, looked up as stored

    @property
    def embedding(self) -> torch.Tensor:
        """The token embedding's float weight (the head's, when tied)."""
        return self.wte

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCache,
        metadata: LayerMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        if self.quantized_embedding is None:
            tokens = self.shard.embed(input_ids, self.wte)
        else:
            tokens = self.quantized_embedding.dequantize(input_ids).to(self.wpe.dtype)
        hidden = tokens + F.embedding(positions, self.wpe)
        for block, kv_cache, layer_metadata in zip(self.h, kv_caches, metadata, strict=True):
            hidden = block(hidden, kv_cache, layer_metadata, backend)
        return self.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [n, hidden] -> float32 logits [n, vocab] (on rank 0; None on the others)."""
        return self.shard.gather_vocab(self.lm_head(hidden), self.config.vocab_size)

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
        """From the checkpoint's tensors, one at a time: a rank keeps only its part of each.
        HF's Conv1D keeps [in, out]; our linear layers want [out, in]."""
        config, shard = self.config, self.shard
        loader = WeightLoader(self)
        vocab = vocab_rows(*shard.vocab(config.vocab_size)) if shard.size > 1 else None
        loader.direct("transformer.wte.weight", "wte", vocab)
        loader.direct("transformer.wpe.weight", "wpe")
        loader.direct("transformer.ln_f.weight", "ln_f.weight")
        loader.direct("transformer.ln_f.bias", "ln_f.bias")
        if not config.tie_word_embeddings:
            loader.direct("lm_head.weight", "lm_head.weight", vocab)
        transforms = _layer_transforms(config, shard)
        for i in range(config.num_layers):
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
                weight, bias = transforms[ours_layer]
                loader.direct(hf + f"{hf_layer}.weight", ours + f"{ours_layer}.weight", weight)
                loader.direct(hf + f"{hf_layer}.bias", ours + f"{ours_layer}.bias", bias)
        loader.load(weights, ignore=(".attn.bias", ".attn.masked_bias"))


def _layer_transforms(config: ModelConfig, shard: Shard) -> dict[str, tuple[Transform, Transform | None]]:
    """(weight, bias) transforms of each projection of a block: Conv1D's transpose, then
    this rank's part (q, k and v rows of its heads; MLP rows; the columns they feed)."""

    def conv1d(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t()

    if shard.size == 1:
        return {name: (conv1d, None) for name in ("qkv", "o", "fc", "proj")}
    hidden = config.hidden_size
    start, end = (config.head_dim * h for h in shard.split(config.num_heads, "n_head"))
    mlp_start, mlp_end = shard.split(config.intermediate_size, "n_inner")

    def qkv_rows(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor[part * hidden + start : part * hidden + end] for part in range(3)])

    def once(tensor: torch.Tensor) -> torch.Tensor:  # a row-parallel bias: added by rank 0 only
        return tensor if shard.rank == 0 else torch.zeros_like(tensor)

    def then(first: Transform, second: Transform) -> Transform:
        return lambda tensor: second(first(tensor))

    return {
        "qkv": (then(conv1d, qkv_rows), qkv_rows),
        "o": (then(conv1d, columns(start, end)), once),
        "fc": (then(conv1d, rows(mlp_start, mlp_end)), rows(mlp_start, mlp_end)),
        "proj": (then(conv1d, columns(mlp_start, mlp_end)), once),
    }
