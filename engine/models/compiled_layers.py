"""A Llama-family model's decoder layers as one compiled call per step
(kernels/csrc/cpu_decoder.cpp), where every projection is a GGUF weight in the layout this
CPU's quantized kernel reads (AVX2's packed columns or VNNI's GGML order).

At batch 1 a small quantized model spends about a third of a step in the interpreter
between its operators. The compiled layers call the same operators on the same tensors in
the same order, so a row's output is bit for bit the Python loop's: only the interpreter is
gone. Anything the C++ loop does not carry (LoRA, tensor parallelism, float or W8A8 layers,
another attention backend) keeps the Python loop. A mixture of experts' sparse layers
(`SparseMoeBlock` with the softmax router, no shared expert, and its experts served stacked
from a GGUF file's blocks: Qwen3-MoE, Mixtral) run their router and the quantized-experts
operator in the same loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagefleet.engine.layers.cpu_attention import CpuMetadata
from pagefleet.engine.layers.linear import Linear
from pagefleet.engine.layers.quantized import PackedWeight, QuantizedWeight, StackedWeight
from pagefleet.engine.layers.quantized_experts import QuantizedRoutedExperts, kernel_kind
from pagefleet.kernels import cpu_ops
from pagefleet.kernels.fused_experts import ACTIVATIONS

if TYPE_CHECKING:
    from pagefleet.engine.layers.attention import KVCache
    from pagefleet.engine.models.llama import LlamaForCausalLM

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")  # the C++ order
ATTENTION_PROJECTIONS = PROJECTIONS[:2]  # a sparse layer's: its MLP is its experts


def _kernel_parts(linear: Linear) -> list[PackedWeight | QuantizedWeight] | None:
    """The projection's GGUF parts as this CPU's kernel reads them, or None (a float part, an
    adapter, a weight in another device's layout)."""
    weight = linear.quantized
    parts = weight.parts if isinstance(weight, StackedWeight) else (weight,)
    kernel_layout = PackedWeight if cpu_ops.quantized_packed_layout() else QuantizedWeight
    if linear.lora is not None or not all(isinstance(part, kernel_layout) for part in parts):
        return None
    return list(parts)  # type: ignore[arg-type]


def _add_part(compiled: Any, index: int, part: PackedWeight | QuantizedWeight) -> None:
    if isinstance(part, PackedWeight):
        compiled.add_part(index, part.quants, part.scales, part.mins, part.kind, part.out_features, part.has_min, True)
    else:
        compiled.add_part(index, part.quants, part.scales, part.mins, part.format, part.shape[0], True, False)


def compile_layers(model: LlamaForCausalLM, sliding_window: int) -> Any | None:
    """`torch.classes.pagefleet.LlamaLayers` holding `model`'s layers, or None where a layer
    has anything the compiled loop does not run."""
    config = model.config
    # has_quantized_linear asked again (has_compiled_layers is cached): where the operator is
    # off, the projections run their float32 reference, which the compiled loop does not call.
    if not cpu_ops.has_compiled_layers() or not cpu_ops.has_quantized_linear() or model.shard.size != 1:
        return None
    if config.layer_rope or config.rotary_dim or config.layer_types or config.attn_softcap:
        return None  # the compiled loop rotates every dim and gives every layer one window, no cap
    dtype = model.norm.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16) or model.norm.weight.device.type != "cpu":
        return None
    first = model.layers[0].self_attn
    compiled = torch.classes.pagefleet.LlamaLayers(
        first.num_heads, first.num_kv_heads, first.head_dim, config.norm_eps, first.scale, sliding_window
    )
    for layer in model.layers:
        attention = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm, attention.q_norm, attention.k_norm]
        if any(norm is not None and norm.weight.dtype != dtype for norm in norms):
            return None
        compiled.add_layer(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            None if attention.q_norm is None else attention.q_norm.weight,
            None if attention.k_norm is None else attention.k_norm.weight,
        )
        sparse = hasattr(layer.mlp, "experts")
        if sparse and not _add_experts(compiled, layer.mlp):
            return None
        for index, name in enumerate(ATTENTION_PROJECTIONS if sparse else PROJECTIONS):
            linear = layer.get_submodule(name)
            parts = _kernel_parts(linear)
            if parts is None:
                return None
            for part in parts:
                _add_part(compiled, index, part)
            if linear.bias is not None:
                compiled.set_bias(index, linear.bias)
    return compiled


def _add_experts(compiled: Any, block: Any) -> bool:
    """The last layer's sparse MLP into `compiled`; False where the compiled loop cannot run
    it as SparseMoeBlock does (another router, a shared expert, float or unstacked experts,
    a router that is not a packed float layer)."""
    options, router, experts = block.options, block.gate, block.experts
    if options.router != "softmax_top_k" or block.shared_expert is not None:
        return False
    if not isinstance(experts, QuantizedRoutedExperts):
        return False
    gate_up, down = experts.stacked
    if gate_up is None or down is None or gate_up.quants.device.type != "cpu":
        return False
    if router.quantized is not None or router._packed is None or router.lora is not None:
        return False
    activation = experts.activation
    compiled.set_experts(
        router._packed,
        router.bias,
        options.experts_per_token,
        options.normalize,
        options.keep_float,
        gate_up.quants,
        gate_up.scales,
        gate_up.mins,
        kernel_kind(gate_up),
        down.quants,
        down.scales,
        down.mins,
        kernel_kind(down),
        experts.num_experts,
        experts.width,
        ACTIVATIONS.index(activation.kind),
        activation.alpha,
        activation.limit,
    )
    return True


def run_compiled(
    compiled: Any,
    hidden: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_caches: KVCache,
    metadata: CpuMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the last layer's output, the residual), as the Python loop returns them."""
    rows = metadata.rows
    return compiled.forward(  # type: ignore[no-any-return]
        hidden,
        *rope,
        [pair[0] for pair in kv_caches],
        [pair[1] for pair in kv_caches],
        metadata.slot_mapping,
        rows.tables,
        rows.lengths,
        rows.row_groups,
    )
