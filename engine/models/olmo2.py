"""AllenAI OLMo-2 (`Olmo2ForCausalLM`): Llama's projections and MLP with the norms moved,
as transformers computes them: no norm before attention or the MLP, an RMSNorm of each of
their outputs before its residual add, and q and k normalised over the whole projection
(all heads at once, before the split into heads), not per head as Qwen3's."""

from __future__ import annotations

from torch import nn

from pagefleet.engine.distributed.shard import Shard
from pagefleet.engine.errors import UnsupportedModelError
from pagefleet.engine.layers.fused import rotary
from pagefleet.engine.layers.norm import RMSNorm
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, load_decoder_weights

_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


class Olmo2Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        super().__init__(config, shard, layer)
        if shard.size > 1:  # the norm spans every head: ranks would need each other's sums
            raise UnsupportedModelError("OLMo-2 with tensor_parallel_size > 1 is not supported")
        self.q_norm = RMSNorm(self.q_size, config.norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.norm_eps)

    def forward(self, hidden, rope, kv_cache, metadata, backend):  # type: ignore[no-untyped-def]
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.contiguous()).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(k.contiguous()).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(q, *rope), rotary(k, *rope)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale, self.window, self.softcap)
        return self.o_proj(out.view(num_tokens, self.q_size))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, shard, layer)
        self.mlp = LlamaMLP(config, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, hidden, residual, rope, kv_cache, metadata, backend):  # type: ignore[no-untyped-def]
        """In the shape of Llama's layer, so that Llama's loop runs it: `hidden` is the
        previous layer's normed MLP output, added here to `residual` (the embeddings alone
        for the first layer); returns this layer's and the residual it joins."""
        if residual is not None:
            hidden = residual + hidden
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, rope, kv_cache, metadata, backend))
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_class = Olmo2DecoderLayer
    compiled_layers_run_this_family = False  # its layers are not Llama's

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        load_decoder_weights(self, weights, layer_norms=_NORMS)
