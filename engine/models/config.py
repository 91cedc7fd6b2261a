"""One normalised view of a Hugging Face config.json for every supported architecture."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pagefleet.engine.errors import UnsupportedModelError
from pagefleet.engine.models.linear_attention_config import LINEAR, LinearAttentionOptions, Mamba2Options
from pagefleet.engine.models.registry import LANGUAGE_MODEL_OF, SUPPORTED_ARCHITECTURES

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "proportional", "yarn")
SLIDING = "sliding_attention"  # a `layer_types` entry: the layer sees the last `sliding_window` keys
CHUNKED = "chunked_attention"  # the layer sees the keys of its query's chunk of `attention_chunk` positions


@dataclass(slots=True, frozen=True)
class Gemma4Options:
    """What only Gemma 4 has (engine/models/gemma4.py)."""

    per_layer_input_size: int  # the per-layer embeddings' width per layer (0: none)
    per_layer_vocab_size: int  # their vocabulary
    attention_k_eq_v: bool  # global layers take their values from the key projection
    double_wide_mlp: bool  # the KV-shared layers' MLPs are twice intermediate_size wide
    num_experts: int = 0  # a routed mixture of experts beside each layer's MLP (0: none)
    top_k_experts: int = 0
    moe_intermediate_size: int = 0


@dataclass(slots=True, frozen=True)
class MoEOptions:
    """A mixture of experts in place of the MLP (engine/models/moe.py)."""

    num_experts: int
    experts_per_token: int
    width: int  # each expert's intermediate size
    normalize: bool  # the top k's probabilities renormalised to sum to 1 (`norm_topk_prob`)
    keep_float: bool  # the routing weights stay float32 (Mixtral), else take the logits' dtype
    sparse_layers: tuple[bool, ...]  # per layer, experts (True) or a dense MLP
    shared_expert_width: int = 0  # Qwen2-MoE's always-on expert, gated by a sigmoid (0: none)
    # How tokens choose experts: "softmax_top_k" (Qwen, Mixtral), gpt-oss's "top_k_softmax"
    # (a softmax over the top k logits), DeepSeek-V3's "grouped_sigmoid" (engine/models/deepseek.py).
    router: str = "softmax_top_k"
    # gpt-oss: the router and experts have biases; experts gate with a clamped SwiGLU.
    biases: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # DeepSeek-V3: experts in `num_groups` groups, tokens choose among the best `top_groups`;
    # the routing weights are scaled by `routed_scaling`.
    num_groups: int = 1
    top_groups: int = 1
    routed_scaling: float = 1.0


@dataclass(slots=True, frozen=True)
class Llama4Options:
    """What only Llama 4 has (engine/models/llama4.py)."""

    qk_l2_norm: bool  # RoPE layers L2-normalise q and k per head (`use_qk_norm`)
    temperature_tuning: bool  # NoPE layers scale queries by log1p(floor((p + 1) / floor_scale)) * scale + 1
    temperature_scale: float  # `attn_scale`
    floor_scale: float


@dataclass(slots=True, frozen=True)
class MLAOptions:
    """Multi-head latent attention (DeepSeek-V2/V3, engine/models/deepseek.py): queries
    through a low-rank `q_lora_rank` (0: one projection), keys and values from one latent of
    `kv_lora_rank` per token (cached with the `qk_rope_head_dim` rotated key dims, and no
    values: the cache's head is that latent), expanded per head by `kv_b_proj`."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint rotates pairs (x0, x1), (x2, x3), ...


# The mixtures of experts on Llama's attention (engine/models/moe.py).
MOE_ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM",
)
# Gated DeltaNet layers between full-attention ones (engine/models/qwen3_next.py).
LINEAR_ATTENTION_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
# Every architecture with state layers (engine/models/hybrid_config.py reads their configs).
STATE_ARCHITECTURES = (*LINEAR_ATTENTION_ARCHITECTURES, "GraniteMoeHybridForCausalLM")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    hidden_act: str
    qkv_bias: bool = False
    o_bias: bool = False  # the output projection's bias (Llama's and gpt-oss's `attention_bias`)
    attention_sinks: bool = False  # a learned logit per head in each softmax's denominator (gpt-oss)
    qk_norm: bool = False
    sliding_window: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Per layer, HF's names ("full_attention", "sliding_attention"); empty: every layer alike
    # (windowed if `sliding_window` is set, as Mistral's).
    layer_types: tuple[str, ...] = ()
    rotary_dim: int | None = None  # RoPE on the first rotary_dim of each head's dims only (Phi-4-mini); None: all
    layer_rope: tuple[bool, ...] = ()  # per layer, whether it rotates q and k; empty: all do (SmolLM3's NoPE)
    attn_scale: float | None = None  # the attention scale, where not head_dim**-0.5 (Gemma, Granite)
    embedding_multiplier: float = 1.0  # Granite's multipliers: of the embeddings,
    residual_multiplier: float = 1.0  # of each attention and MLP output before its residual add,
    logits_scaling: float = 1.0  # and the divisor of the logits
    attn_softcap: float | None = None  # scores capped as cap * tanh(score / cap) (Gemma 2)
    final_softcap: float | None = None  # logits capped the same way (Gemma 2)
    local_rope_theta: float | None = None  # the RoPE base of sliding layers, where it differs (Gemma 3)
    # Per layer (KV heads, head dim), where global layers differ from sliding ones (Gemma 4);
    # empty: (num_kv_heads, head_dim) everywhere.
    layer_kv_shapes: tuple[tuple[int, int], ...] = ()
    # Per layer, the layer whose keys and values it attends over: itself, or for Gemma 4's
    # KV-shared layers an earlier layer of its type, whose cache it reads; empty: itself.
    kv_sources: tuple[int, ...] = ()
    gemma4: Gemma4Options | None = None
    moe: MoEOptions | None = None
    attention_chunk: int | None = None  # "chunked_attention" layers see their own chunk of this many positions
    llama4: Llama4Options | None = None
    mla: MLAOptions | None = None  # latent attention: the cache holds keys only (values are their first dims)
    language_model_of: str | None = None  # the image checkpoint's architecture whose text model this is
    linear_attention: LinearAttentionOptions | Mamba2Options | None = None  # the "linear_attention" layers' sizes

    def is_state_layer(self, layer: int) -> bool:
        """Whether layer `layer` keeps a fixed-size state per request instead of a KV cache."""
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR

    @property
    def state_layers(self) -> list[int]:
        """The layers whose per-request state lives in the state cache, in order."""
        return [layer for layer in range(self.num_layers) if self.is_state_layer(layer)]

    def layer_window(self, layer: int) -> int | None:
        """The keys layer `layer` sees: the last `sliding_window` of them, or all (None)."""
        if self.layer_types and self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    @property
    def layer_windows(self) -> list[int | None]:
        """`layer_window` of every layer, in order (how the KV cache groups its layers)."""
        return [self.layer_window(i) for i in range(self.num_layers)]

    @property
    def long_rope_after(self) -> int | None:
        """LongRoPE's pretraining length (Phi-3-128k, Phi-4-mini): a sequence longer than
        this rotates by the long factors (engine/layers/rotary.py); None without LongRoPE."""
        if self.rope_scaling.get("rope_type") != "longrope":
            return None
        return int(self.rope_scaling["original_max_position_embeddings"])

    def layer_kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head dim) of layer `layer`'s keys and values."""
        return self.layer_kv_shapes[layer] if self.layer_kv_shapes else (self.num_kv_heads, self.head_dim)

    def kv_source(self, layer: int) -> int:
        """The layer whose cache layer `layer` reads (itself unless it shares another's)."""
        return self.kv_sources[layer] if self.kv_sources else layer

    @property
    def cache_layers(self) -> list[int]:
        """The layers that hold a KV cache (all but those reading another's), in order: the
        layers the KV cache groups and the KV connectors count."""
        return [
            layer
            for layer in range(self.num_layers)
            if self.kv_source(layer) == layer and not self.is_state_layer(layer)
        ]

    def layer_chunk(self, layer: int) -> int | None:
        """The chunk of positions layer `layer` attends within (Llama 4's RoPE layers), or None."""
        chunked = self.layer_types and self.layer_types[layer] == CHUNKED
        return self.attention_chunk if chunked else None

    @property
    def cache_layer_windows(self) -> list[int | None]:
        """Per cache layer, the most recent keys it can still read (None: all): its window,
        or its chunk (a query never sees further back than its chunk's size): how the KV
        cache groups layers and frees the blocks they no longer need."""
        return [self.layer_window(layer) or self.layer_chunk(layer) for layer in self.cache_layers]

    def layer_uses_rope(self, layer: int) -> bool:
        return not self.layer_rope or self.layer_rope[layer]

    @property
    def attention_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        raw = json.loads((model_dir / "config.json").read_text())
        generation = model_dir / "generation_config.json"
        extra_eos = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
        return cls.from_hf(raw, extra_eos)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], extra_eos: int | list[int] | None = None) -> ModelConfig:
        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise UnsupportedModelError(
                f"unsupported architecture {architectures or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if architecture in LANGUAGE_MODEL_OF:
            return replace(cls._language_model(raw, architecture, extra_eos), language_model_of=architecture)
        eos = _as_ids(raw.get("eos_token_id")) + _as_ids(extra_eos)
        common = dict(
            architecture=architecture,
            family=SUPPORTED_ARCHITECTURES[architecture],
            vocab_size=raw["vocab_size"],
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=raw.get("bos_token_id"),
        )
        if architecture == "GPT2LMHeadModel":
            return cls._gpt2(raw, common)
        if SUPPORTED_ARCHITECTURES[architecture] in ("gemma", "gemma4"):
            return cls._gemma(raw, architecture, common)
        if architecture == "DeepseekV3ForCausalLM":
            return cls._deepseek(raw, cls._llama(raw | {"attention_bias": False}, architecture, common))
        if architecture == "Llama4ForCausalLM":
            return cls._llama4(raw, cls._llama(raw, architecture, common))
        if architecture in STATE_ARCHITECTURES:  # imported here: that module builds on this one
            from pagefleet.engine.models.hybrid_config import hybrid_config

            return hybrid_config(raw, architecture, lambda fields: cls._llama(raw | fields, architecture, common))
        return cls._llama(raw, architecture, common)

    @classmethod
    def _llama4(cls, raw: dict[str, Any], llama: ModelConfig) -> ModelConfig:
        """Llama 4's text model: Llama's fields, its chunked and global layers, dense layers
        `intermediate_size_mlp` wide, experts and a shared expert `intermediate_size` wide."""
        if raw.get("num_experts_per_tok", 1) != 1:
            raise UnsupportedModelError("Llama 4 with more than one routed expert per token is not supported")
        num_layers, moe_layers = llama.num_layers, set(raw.get("moe_layers") or ())
        experts = MoEOptions(
            num_experts=raw["num_local_experts"],
            experts_per_token=1,
            width=raw["intermediate_size"],
            normalize=False,
            keep_float=False,
            sparse_layers=tuple(i in moe_layers for i in range(num_layers)),
            shared_expert_width=raw["intermediate_size"],
            router="sigmoid_top_1",
        )
        options = Llama4Options(
            qk_l2_norm=bool(raw.get("use_qk_norm", True)),
            temperature_tuning=bool(raw.get("attn_temperature_tuning", True)),
            temperature_scale=float(raw.get("attn_scale", 0.1)),
            floor_scale=float(raw.get("floor_scale", 8192)),
        )
        layer_types = tuple(raw.get("layer_types") or ())
        return replace(
            llama,
            intermediate_size=raw.get("intermediate_size_mlp") or raw["intermediate_size"],
            layer_types=layer_types,
            attention_chunk=raw.get("attention_chunk_size") if CHUNKED in layer_types else None,
            qkv_bias=bool(raw.get("attention_bias")),
            o_bias=bool(raw.get("attention_bias")),
            moe=experts,
            llama4=options,
        )

    @classmethod
    def _deepseek(cls, raw: dict[str, Any], llama: ModelConfig) -> ModelConfig:
        """DeepSeek-V3: Llama's fields, then one cached head per token (the latent and the
        rotated key dims), the query-key scale with YaRN's `mscale_all_dim` as transformers
        applies it, and the latent attention's sizes."""
        if raw.get("attention_bias"):
            raise UnsupportedModelError("DeepSeek attention_bias=true is not supported")
        mla = MLAOptions(
            q_lora_rank=raw.get("q_lora_rank") or 0,
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            rope_interleave=bool(raw.get("rope_interleave", True)),
        )
        moe = llama.moe
        if moe is None or moe.num_experts % moe.num_groups or moe.top_groups > moe.num_groups:
            raise UnsupportedModelError("DeepSeek-V3: n_routed_experts must split into n_group >= topk_group groups")
        scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
        rope = llama.rope_scaling
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            factor = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0 if rope["factor"] > 1 else 1.0
            scale *= factor * factor
        return replace(
            llama,
            num_kv_heads=1,
            head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
            rotary_dim=mla.qk_rope_head_dim,
            attn_scale=scale,
            mla=mla,
        )

    @classmethod
    def _language_model(cls, raw: dict[str, Any], architecture: str, extra_eos: int | list[int] | None) -> ModelConfig:
        """The text model of an image checkpoint, its `text_config` completed with
        transformers' defaults (released configs leave out what equals them); whether the
        head is tied is the whole model's setting."""
        from transformers import CONFIG_MAPPING  # heavy: only for these checkpoints

        whole = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
        text = whole.text_config.to_dict() | {"architectures": [LANGUAGE_MODEL_OF[architecture]]}
        text["tie_word_embeddings"] = raw.get("tie_word_embeddings", True)
        if text.get("eos_token_id") is None:
            text["eos_token_id"] = raw.get("eos_token_id")
        return cls.from_hf(text, extra_eos)

    @classmethod
    def _gpt2(cls, raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
        hidden, heads = raw["n_embd"], raw["n_head"]
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if raw.get(flag):
                raise UnsupportedModelError(f"GPT-2 option {flag}=true is not supported")
        return cls(
            **common,
            hidden_size=hidden,
            num_layers=raw["n_layer"],
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=raw.get("n_inner") or 4 * hidden,
            max_position_embeddings=raw["n_positions"],
            norm_eps=raw.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=raw.get("tie_word_embeddings", True),
            hidden_act=raw.get("activation_function", "gelu_new"),
            qkv_bias=True,
        )

    @classmethod
    def _llama(cls, raw: dict[str, Any], architecture: str, common: dict[str, Any]) -> ModelConfig:
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        # transformers 5 writes rope settings as `rope_parameters`; 4.x as rope_theta/rope_scaling.
        theta, rope = _rope(raw.get("rope_parameters") or raw.get("rope_scaling") or {}, raw.get("rope_theta", 10000.0))
        if rope["rope_type"] == "longrope":  # transformers 4 keeps the pretraining length beside the factors
            original = rope.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
            rope["original_max_position_embeddings"] = original or raw.get("max_position_embeddings", 2048)
        if rope["rope_type"] == "yarn" and not rope.get("factor"):  # transformers' default factor
            rope["factor"] = raw["max_position_embeddings"] / rope["original_max_position_embeddings"]
        head_dim = raw.get("head_dim") or hidden // heads
        partial = rope.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor") or 1.0
        window, layer_types = raw.get("sliding_window"), ()
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            # Qwen's window applies to only some layers; we support the common full-attention setup.
            if raw.get("use_sliding_window"):
                raise UnsupportedModelError("Qwen use_sliding_window=true is not supported")
            window = None
        elif architecture == "SmolLM3ForCausalLM":  # windows only where use_sliding_window says
            layer_types = tuple(raw.get("layer_types") or ()) if raw.get("use_sliding_window") else ()
            window = window if layer_types else None
        elif architecture == "GptOssForCausalLM":  # alternating sliding and full layers
            layer_types = tuple(raw.get("layer_types") or (SLIDING, "full_attention") * (raw["num_hidden_layers"] // 2))
        layers = raw["num_hidden_layers"]
        granite_scale = float(raw.get("attention_multiplier", 1.0)) if architecture == "GraniteForCausalLM" else None
        if raw.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        return cls(
            **common,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
            norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            hidden_act=raw.get("hidden_act", "silu"),
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias") or raw.get("qkv_bias")),
            o_bias=bool(raw.get("attention_bias")) and architecture in ("LlamaForCausalLM", "GptOssForCausalLM"),
            attention_sinks=architecture == "GptOssForCausalLM",
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Olmo2ForCausalLM")
            or architecture in LINEAR_ATTENTION_ARCHITECTURES,
            sliding_window=window,
            rope_theta=theta,
            rope_scaling=rope,
            layer_types=layer_types,
            layer_rope=tuple(bool(r) for r in raw.get("no_rope_layers") or ()),  # SmolLM3: 0 = no RoPE
            attn_scale=granite_scale,
            embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
            logits_scaling=float(raw.get("logits_scaling", 1.0)),
            moe=_moe_options(raw, architecture, layers) if architecture in MOE_ARCHITECTURES else None,
        )

    @classmethod
    def _gemma(cls, raw: dict[str, Any], architecture: str, common: dict[str, Any]) -> ModelConfig:
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        if raw.get("use_bidirectional_attention") not in (None, False, "vision"):  # "vision": images only
            raise UnsupportedModelError("Gemma use_bidirectional_attention=true (an encoder) is not supported")
        layers = raw["num_hidden_layers"]
        layer_types = tuple(raw.get("layer_types") or ())
        if not layer_types:  # transformers 4: Gemma 2 alternates, Gemma 3 has a pattern
            pattern = raw.get("sliding_window_pattern", 2 if architecture == "Gemma2ForCausalLM" else 6)
            layer_types = tuple(SLIDING if (i + 1) % pattern else "full_attention" for i in range(layers))
        rope = raw.get("rope_parameters") or {}
        local_theta = None
        if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5, per layer type
            theta, scaling = _rope(rope.get("full_attention") or {}, 10000.0)
            local_theta, local_scaling = _rope(rope.get("sliding_attention") or {}, 10000.0)
            if local_scaling["rope_type"] != "default":
                raise UnsupportedModelError("scaled RoPE on sliding layers is not supported")
        else:
            theta, scaling = _rope(rope or raw.get("rope_scaling") or {}, raw.get("rope_theta", 10000.0))
            local_theta = raw.get("rope_local_base_freq")
        gemma4 = _gemma4_parts(raw, layer_types) if architecture == "Gemma4ForCausalLM" else {}
        scalar = raw.get("query_pre_attn_scalar")
        return cls(
            **common,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 8192),
            norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=raw.get("tie_word_embeddings", True),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
            qkv_bias=bool(raw.get("attention_bias", False)),
            qk_norm=architecture in ("Gemma3ForCausalLM", "Gemma4ForCausalLM"),
            sliding_window=raw.get("sliding_window"),
            rope_theta=theta,
            rope_scaling=scaling,
            layer_types=layer_types,
            attn_scale=1.0 if gemma4 else scalar**-0.5 if scalar else None,  # Gemma 4: q and k are normed
            attn_softcap=raw.get("attn_logit_softcapping"),
            final_softcap=raw.get("final_logit_softcapping"),
            local_rope_theta=float(local_theta) if local_theta is not None else None,
            **gemma4,
        )


def _moe_options(raw: dict[str, Any], architecture: str, num_layers: int) -> MoEOptions:
    """Where the experts are and how tokens are routed, as transformers reads each config:
    Mixtral's experts on every layer, as wide as `intermediate_size`, always renormalised;
    Qwen's every `decoder_sparse_step`-th layer but `mlp_only_layers`."""
    num_experts = raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts") or 0
    every_layer = architecture in ("MixtralForCausalLM", "GptOssForCausalLM")  # experts as wide as the MLP
    step, dense = raw.get("decoder_sparse_step") or 1, set(raw.get("mlp_only_layers") or ())
    if architecture == "DeepseekV3ForCausalLM":  # the first layers dense
        dense = set(range(raw.get("first_k_dense_replace") or 0))
    sparse = tuple(
        every_layer or (i not in dense and num_experts > 0 and (i + 1) % step == 0) for i in range(num_layers)
    )
    gpt_oss = architecture == "GptOssForCausalLM"
    return MoEOptions(
        num_experts=num_experts,
        experts_per_token=raw["num_experts_per_tok"],
        width=raw["intermediate_size"] if every_layer else raw["moe_intermediate_size"],
        # Qwen3.5-MoE's router always renormalises (its config has no norm_topk_prob).
        normalize=architecture in ("MixtralForCausalLM", "Qwen3_5MoeForCausalLM") or bool(raw.get("norm_topk_prob")),
        keep_float=architecture == "MixtralForCausalLM",
        sparse_layers=sparse,
        shared_expert_width=raw.get("shared_expert_intermediate_size")
        or raw.get("moe_intermediate_size", 0) * (raw.get("n_shared_experts") or 0),
        router=ROUTERS.get(architecture, "softmax_top_k"),
        biases=gpt_oss,
        activation="swiglu_oai" if gpt_oss else "silu",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        num_groups=raw.get("n_group") or 1,
        top_groups=raw.get("topk_group") or 1,
        routed_scaling=float(raw.get("routed_scaling_factor") or 1.0),
    )


ROUTERS = {"GptOssForCausalLM": "top_k_softmax", "DeepseekV3ForCausalLM": "grouped_sigmoid"}


def _gemma4_parts(raw: dict[str, Any], layer_types: tuple[str, ...]) -> dict[str, Any]:
    """Gemma 4's fields, as transformers' Gemma4TextConfig resolves them: global layers'
    head size and KV heads (`per_layer_config`, or `global_head_dim`, default 512, and
    `num_global_key_value_heads` where keys are values), the KV-shared last layers, each
    reading the last unshared layer of its type."""
    num_layers = len(layer_types)
    kv_heads, head_dim = raw.get("num_key_value_heads") or raw["num_attention_heads"], raw.get("head_dim") or 256
    overrides = {int(k): v for k, v in (raw.get("per_layer_config") or {}).items() if str(k).isdigit()}
    if not overrides:
        global_shape = {"head_dim": raw.get("global_head_dim", 512)}
        if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads"):
            global_shape["num_key_value_heads"] = raw["num_global_key_value_heads"]
        overrides = {i: global_shape for i, kind in enumerate(layer_types) if kind != SLIDING}
    shapes = tuple(
        (overrides.get(i, {}).get("num_key_value_heads", kv_heads), overrides.get(i, {}).get("head_dim", head_dim))
        for i in range(num_layers)
    )
    num_shared = raw.get("num_kv_shared_layers") or 0
    first_shared = num_layers - num_shared
    if num_shared and first_shared < 1:
        raise UnsupportedModelError("Gemma 4 with num_kv_shared_layers = num_hidden_layers is not supported")
    sources = list(range(num_layers))
    for layer in range(first_shared, num_layers):
        producers = [i for i in range(first_shared) if layer_types[i] == layer_types[layer]]
        if not producers:
            raise UnsupportedModelError(f"Gemma 4 layer {layer} shares the KV of a {layer_types[layer]} layer it lacks")
        sources[layer] = producers[-1]
    experts = raw.get("num_experts") or 0 if raw.get("enable_moe_block") else 0
    options = Gemma4Options(
        per_layer_input_size=raw.get("hidden_size_per_layer_input") or 0,
        per_layer_vocab_size=raw.get("vocab_size_per_layer_input") or raw["vocab_size"],
        attention_k_eq_v=bool(raw.get("attention_k_eq_v")),
        double_wide_mlp=bool(raw.get("use_double_wide_mlp")),
        num_experts=experts,
        top_k_experts=raw.get("top_k_experts") or 0 if experts else 0,
        moe_intermediate_size=raw.get("moe_intermediate_size") or 0 if experts else 0,
    )
    return dict(layer_kv_shapes=shapes, kv_sources=tuple(sources), gemma4=options)


def _rope(parameters: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any]]:
    """(base, scaling) of one RoPE setting, in transformers 4's or 5's spelling."""
    rope = dict(parameters)
    theta = rope.pop("rope_theta", None) or default_theta
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    return float(theta), {**rope, "rope_type": rope_type}


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
