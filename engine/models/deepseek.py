"""DeepSeek-V3 (and Kimi K2, which shares its architecture): multi-head latent attention
over a latent KV cache, and a mixture of experts with grouped sigmoid routing.

Latent attention (MLA). Per token the cache holds one head: the normed latent `c`
(`kv_lora_rank` values) followed by the rotated key dims `k_rot` (`qk_rope_head_dim`), and
no values. transformers expands `c` into every head's keys and values (`kv_b_proj`); here
the expansion is absorbed into the query and the output instead:

    score(h, t) = q_nope[h] . (W_UK[h] c_t) + q_rot[h] . k_rot_t
                = [q_nope[h] W_UK[h], q_rot[h]] . [c_t, k_rot_t]         (one query per head)
    out[h]      = W_UV[h] sum_t p(h, t) c_t

so the attention is multi-query attention over the cache's one head, run by the same
paged-attention backends as every model: the cached head serves as keys and, its first
`kv_lora_rank` dims, as values (the value cache is the key cache's tensor; the operator's
output past those dims is dropped). DeepSeek's checkpoints rotate interleaved pairs; their
rows are permuted once at load so the usual rotate-half RoPE applies (q . k is unchanged).

Experts: a float32 sigmoid router; the choice adds `e_score_correction_bias`, keeps the
`topk_group` best groups of experts (a group's score: its two best) and takes the top k
there; the weights are the unbiased scores, renormalised and scaled by
`routed_scaling_factor`. Shared experts (one MLP) are always added; the first
`first_k_dense_replace` layers are dense. Heads are split across tensor-parallel ranks and
so are the routed experts, each rank holding an equal share (expert parallelism); the
latent cache is replicated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagefleet.engine.distributed.shard import Shard, chain, columns, rows, vocab_rows
from pagefleet.engine.layers.attention import AttentionBackend, AttentionMetadata
from pagefleet.engine.layers.experts import RoutedExperts
from pagefleet.engine.layers.fused import rotary
from pagefleet.engine.layers.latent_prefill import (
    LatentStep,
    PerHeadProjections,
    expanded_context,
    expanded_rows_attention,
    per_head_matmul,
    write_latents,
)
from pagefleet.engine.layers.linear import Linear, frozen_parameter
from pagefleet.engine.layers.norm import RMSNorm
from pagefleet.engine.layers.rotary import interleaved_rope_rows_as_halves
from pagefleet.engine.models.config import MLAOptions, ModelConfig, MoEOptions
from pagefleet.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagefleet.engine.models.moe import declare_expert_tensors
from pagefleet.engine.models.weights import Transform, WeightLoader


def _mla(config: ModelConfig) -> MLAOptions:
    assert config.mla is not None, "a latent-attention config"
    return config.mla


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int = 0) -> None:
        super().__init__()
        mla = self.mla = _mla(config)
        self.shard = shard
        self.num_heads = config.num_heads // shard.size
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank:
            self.q_a_proj = Linear(config.hidden_size, mla.q_lora_rank)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.norm_eps)
            self.q_b_proj = Linear(mla.q_lora_rank, self.num_heads * qk_head_dim)
        else:
            self.q_proj = Linear(config.hidden_size, self.num_heads * qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.norm_eps)
        # Per head: its W_UK rows (the latent to its keys' nope dims), then its W_UV rows (to its values).
        self.kv_b_proj = frozen_parameter(self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        self.o_proj = Linear(self.num_heads * mla.v_head_dim, config.hidden_size)
        self.scale = config.attention_scale
        self._per_head: PerHeadProjections | None = None  # kv_b_proj's views, made on first use

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        mla, num_tokens = self.mla, hidden.shape[0]
        rank = mla.kv_lora_rank
        if mla.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(num_tokens, self.num_heads, -1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden).split([rank, mla.qk_rope_head_dim], dim=-1)
        k_rot = rotary(k_rot.contiguous().view(num_tokens, 1, -1), *rope)
        q_nope, q_rot = q[..., : mla.qk_nope_head_dim], rotary(q[..., mla.qk_nope_head_dim :].contiguous(), *rope)
        key = torch.cat((self.kv_a_layernorm(latent).view(num_tokens, 1, rank), k_rot), dim=-1)
        if isinstance(metadata, LatentStep):
            values = self._expanded(q_nope, q_rot, key, kv_cache, metadata, backend)
        else:
            values = self._absorbed(q_nope, q_rot, key, kv_cache, metadata, backend)
        return self.shard.all_reduce(self.o_proj(values.reshape(num_tokens, -1)))

    def _projections(self) -> PerHeadProjections:
        if self._per_head is None:
            mla = self.mla
            expand = self.kv_b_proj.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
            self._per_head = PerHeadProjections.of(expand.detach(), mla.qk_nope_head_dim)
        return self._per_head

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        key: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """[rows, heads, v]: attention in the latent space, one query per head against the cache's one head."""
        per_head = self._projections()
        # Each head's query in the latent space, then its output out of it.
        query = torch.cat((per_head_matmul(q_nope, per_head.key_up), q_rot), dim=-1)
        out = backend.forward(query, key, key, kv_cache[0], kv_cache[1], metadata, self.scale)
        return per_head_matmul(out[..., : self.mla.kv_lora_rank], per_head.value_up)

    def _expanded(
        self,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        key: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        step: LatentStep,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """[rows, heads, v]: generated tokens' rows absorbed, prompt rows over their context
        expanded per head (engine/layers/latent_prefill.py)."""
        mla, absorbed = self.mla, step.num_absorbed
        values = q_nope.new_empty(q_nope.shape[0], self.num_heads, mla.v_head_dim)
        if step.absorbed is not None:
            values[:absorbed] = self._absorbed(
                q_nope[:absorbed], q_rot[:absorbed], key[:absorbed], kv_cache, step.absorbed, backend
            )
        if absorbed < len(step.slot_mapping):
            write_latents(kv_cache[0], key[absorbed:], step.slot_mapping[absorbed:])
        query = torch.cat((q_nope, q_rot), dim=-1)
        shape = (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim)
        block_size = kv_cache[0].shape[1]
        for chunk in step.chunks:
            rows = slice(chunk.row, chunk.row + chunk.num_expanded)
            scratch = expanded_context(kv_cache[0], chunk.context_slots, self._projections().expand, shape, block_size)
            out = expanded_rows_attention(query[rows], scratch, chunk, backend, self.scale)
            values[rows] = out[..., : mla.v_head_dim]
        return values


def grouped_sigmoid_top_k(
    logits: torch.Tensor, correction: torch.Tensor, options: MoEOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32, experts) [T, k] by DeepSeek-V3's rule, as transformers computes it."""
    scores = _row_sigmoid(logits)
    choice = scores + correction
    num_tokens, per_group = choice.shape[0], choice.shape[1] // options.num_groups
    group_scores = choice.view(num_tokens, options.num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    best_groups = torch.topk(group_scores, k=options.top_groups, dim=-1, sorted=False)[1]
    allowed = torch.zeros_like(group_scores).scatter_(1, best_groups, 1).bool()
    choice = choice.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))
    experts = torch.topk(choice, k=options.experts_per_token, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if options.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * options.routed_scaling, experts


def _row_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    """sigmoid of [T, E] whose bits for a row do not depend on T: torch's vectorised loop
    leaves the elements past its last full vectors to a scalar one that rounds otherwise,
    so rows are padded to a multiple of 64 (none is with DeepSeek-V3's 256 experts)."""
    width = logits.shape[1]
    pad = -width % 64
    return torch.nn.functional.pad(logits, (0, pad)).sigmoid()[:, :width] if pad else logits.sigmoid()


class DeepseekMoE(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        assert config.moe is not None
        options = self.options = config.moe
        self.gate = frozen_parameter(options.num_experts, config.hidden_size)  # routed in float32
        self.e_score_correction_bias = frozen_parameter(options.num_experts)
        self.experts = RoutedExperts(options.num_experts, config.hidden_size, options.width, shard=shard)
        self.shared_experts = (
            LlamaMLP(config, shard, options.shared_expert_width) if options.shared_expert_width else None
        )
        self._router: Linear | None = None  # `gate` as a float32 layer, made on first use

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._float32_router()(hidden.float())
        weights, experts = grouped_sigmoid_top_k(logits, self.e_score_correction_bias.float(), self.options)
        out = self.experts(hidden, weights, experts)
        return out if self.shared_experts is None else out + self.shared_experts(hidden)

    def _float32_router(self) -> Linear:
        """The router as a prepacked float32 layer: one row's logits then do not depend on
        the step's other rows (MKL's `F.linear` takes another kernel for one row)."""
        if self._router is None:
            router = Linear(*reversed(self.gate.shape))
            router.weight.data = self.gate.detach().float()
            router.pack()
            self._router = router
        return self._router


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its forward) around latent attention and a dense or expert MLP."""

    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        nn.Module.__init__(self)  # not Llama's: its attention and MLP would be built, then dropped
        assert config.moe is not None
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LatentAttention(config, shard, layer)  # type: ignore[assignment]
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        sparse = config.moe.sparse_layers[layer]
        self.mlp = DeepseekMoE(config, shard) if sparse else LlamaMLP(config, shard)  # type: ignore[assignment]


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    layer_class = DeepseekDecoderLayer
    compiled_layers_run_this_family = False  # its layers are not Llama's

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        config = self.config
        # Multi-token prediction layers (`num_nextn_predict_layers`) follow the decoder's; unused.
        own = ((name, t) for name, t in weights if _layer_of(name) < config.num_layers)
        loader = WeightLoader(self)
        vocab = vocab_rows(*self.shard.vocab(config.vocab_size)) if self.shard.size > 1 else None
        loader.direct("model.embed_tokens.weight", "embed_tokens", vocab)
        loader.direct("model.norm.weight", "norm.weight")
        if not config.tie_word_embeddings:
            loader.direct("lm_head.weight", "lm_head.weight", vocab)
        for layer in range(config.num_layers):
            hf = f"model.layers.{layer}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                loader.direct(hf + f"{norm}.weight", f"layers.{layer}.{norm}.weight")
            _declare_attention(loader, config, self.shard, layer)
            _declare_mlp(loader, config, self.shard, layer)
        loader.load(own, ignore=("rotary_emb.inv_freq",))


def _layer_of(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to (-1: none)."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() else -1


def _declare_attention(loader: WeightLoader, config: ModelConfig, shard: Shard, layer: int) -> None:
    """The latent attention's tensors: this rank's heads of the per-head projections, the
    interleaved RoPE rows put in rotate-half order."""
    mla = _mla(config)
    hf, ours = f"model.layers.{layer}.self_attn.", f"layers.{layer}.self_attn."
    first, last = shard.split(config.num_heads, "num_attention_heads")
    qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    query_rows = chain(
        rows(first * qk_head_dim, last * qk_head_dim) if shard.size > 1 else None,
        _rope_order(mla, mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim),
    )
    if mla.q_lora_rank:
        loader.direct(hf + "q_a_proj.weight", ours + "q_a_proj.weight")
        loader.direct(hf + "q_a_layernorm.weight", ours + "q_a_layernorm.weight")
        loader.direct(hf + "q_b_proj.weight", ours + "q_b_proj.weight", query_rows)
    else:
        loader.direct(hf + "q_proj.weight", ours + "q_proj.weight", query_rows)
    loader.direct(
        hf + "kv_a_proj_with_mqa.weight",
        ours + "kv_a_proj_with_mqa.weight",
        _rope_order(mla, mla.kv_lora_rank + mla.qk_rope_head_dim, mla.kv_lora_rank),
    )
    loader.direct(hf + "kv_a_layernorm.weight", ours + "kv_a_layernorm.weight")
    per_head = mla.qk_nope_head_dim + mla.v_head_dim
    loader.direct(hf + "kv_b_proj.weight", ours + "kv_b_proj", rows(first * per_head, last * per_head))
    o_columns = columns(first * mla.v_head_dim, last * mla.v_head_dim) if shard.size > 1 else None
    loader.direct(hf + "o_proj.weight", ours + "o_proj.weight", o_columns)


def _declare_mlp(loader: WeightLoader, config: ModelConfig, shard: Shard, layer: int) -> None:
    """A dense layer's MLP, or the router, this rank's routed experts (each expert's gate
    and up rows, then every expert's down rows; the others' tensors skipped) and the shared
    experts split as an MLP."""
    options = config.moe
    assert options is not None
    hf, ours = f"model.layers.{layer}.mlp.", f"layers.{layer}.mlp."
    if not options.sparse_layers[layer]:
        _declare_gated_mlp(loader, shard, hf, ours, config.intermediate_size)
        return
    declare_expert_tensors(loader, hf, ours, ("gate_proj", "up_proj", "down_proj"), shard, options.num_experts)
    loader.direct(hf + "gate.weight", ours + "gate")
    loader.direct(hf + "gate.e_score_correction_bias", ours + "e_score_correction_bias")
    if options.shared_expert_width:
        _declare_gated_mlp(loader, shard, hf + "shared_experts.", ours + "shared_experts.", options.shared_expert_width)


def _declare_gated_mlp(loader: WeightLoader, shard: Shard, hf: str, ours: str, width: int) -> None:
    start, end = shard.split(width, "intermediate_size")
    part = rows(start, end) if shard.size > 1 else None
    loader.fused([hf + "gate_proj.weight", hf + "up_proj.weight"], ours + "gate_up_proj.weight", part)
    loader.direct(hf + "down_proj.weight", ours + "down_proj.weight", columns(start, end) if shard.size > 1 else None)


def _rope_order(mla: MLAOptions, head_size: int, kept: int) -> Transform | None:
    """Rows of `head_size` per head with their RoPE rows (after `kept`) in rotate-half order."""
    return interleaved_rope_rows_as_halves(head_size, kept) if mla.rope_interleave else None
