// The Llama family's decoder layers as one call per step on CPUs (torch.classes.pagefleet.
// LlamaLayers; built and used by pagefleet/engine/models/compiled_layers.py).
//
// A batch-1 decode step of a small quantized model spends about a third of its time in
// Python: 30 layers of module calls, wrapper checks and ~11 torch.ops dispatches each. This
// class runs the same layers from C++ through the same operators (the dispatcher's handles of
// pagefleet::quantized_linear_packed or quantized_linear, add_rms_norm, rotary, reshape_and_cache,
// paged_attention_rows, silu_and_mul), on the same tensors in the same order, so its output
// is bit for bit the Python loop's (tests/kernels/test_compiled_layers.py); it only removes
// the interpreter between them. A mixture of experts' sparse layers (Qwen3-MoE, Mixtral from
// GGUF files) run their router and quantized_experts the same way.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

// The operators, looked up once (they are registered by the other files of this library).
struct Operators {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, bool)>
      linear = handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, bool)>(
          "quantized_linear_packed");
  // The AVX-512 VNNI kernel over GGML's block order (and its planes of 5- and 6-bit codes).
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t)> ggml_linear =
      handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t)>("quantized_linear");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm =
      handle<Tensor(const Tensor&, const Tensor&, double)>("rms_norm");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>
      add_rms_norm =
          handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>("add_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&)> rotary =
      handle<Tensor(const Tensor&, const Tensor&, const Tensor&)>("rotary");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_and_mul = handle<Tensor(const Tensor&)>("silu_and_mul");
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&)> cache_write =
      handle<void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&)>("reshape_and_cache");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, double, int64_t, double, const std::optional<Tensor>&, int64_t)>
      attention = handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, double, int64_t, double, const std::optional<Tensor>&, int64_t)>("paged_attention_rows");

  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, int64_t, const Tensor&, const Tensor&, const Tensor&, int64_t,
                                  int64_t, int64_t, int64_t, double, double)>
      experts = handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, int64_t, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                              int64_t, int64_t, double, double)>("quantized_experts");
  // A float layer packed for oneDNN (engine/layers/linear.py: `Linear._packed`), called boxed.
  c10::OperatorHandle packed_linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");

  template <typename Signature>
  static c10::TypedOperatorHandle<Signature> handle(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow((std::string("pagefleet::") + name).c_str(), "").typed<Signature>();
  }
};

const Operators& operators() {
  static const Operators instance;
  return instance;
}

// One GGUF weight as this CPU's kernel reads it: a PackedWeight's tensors (AVX2, `packed`),
// or a QuantizedWeight's (VNNI: `kind` is its format; out_features and has_min unused).
struct Part {
  Tensor quants, scales, mins;
  int64_t kind, out_features;
  bool has_min, packed;

  Tensor operator()(const Tensor& x) const {
    if (!packed) return operators().ggml_linear.call(x, quants, scales, mins, kind);
    return operators().linear.call(x, quants, scales, mins, kind, out_features, has_min);
  }
};

// A projection: its parts' outputs side by side (a StackedWeight when they differ in
// format), then its bias, as engine/layers/linear.py computes it.
struct Projection {
  std::vector<Part> parts;
  std::optional<Tensor> bias;

  Tensor operator()(const Tensor& x) const {
    const Tensor input = x.contiguous();
    Tensor y;
    if (parts.size() == 1) {
      y = parts[0](input);
    } else {
      std::vector<Tensor> outputs;
      for (const Part& part : parts) outputs.push_back(part(input));
      y = at::cat(outputs, -1);
    }
    return bias ? y + *bias : y;
  }
};

enum ProjectionIndex : int64_t { kQkv = 0, kOut = 1, kGateUp = 2, kDown = 3 };

// oneDNN's rows below which `Linear` pads a packed float layer's input (_MIN_PACKED_ROWS).
constexpr int64_t kMinPackedRows = 3;

// A float router as `Linear.forward` runs it: the oneDNN-packed weight, short inputs padded.
struct Router {
  Tensor packed;
  std::optional<Tensor> bias;

  Tensor operator()(const Tensor& x) const {
    const int64_t rows = x.size(0);
    const Tensor input = rows < kMinPackedRows ? at::constant_pad_nd(x, {0, 0, 0, kMinPackedRows - rows}) : x;
    torch::jit::Stack stack{input, packed, bias ? c10::IValue(*bias) : c10::IValue(), std::string("none"),
                            c10::List<std::optional<c10::Scalar>>(), std::string("")};
    operators().packed_linear.callBoxed(&stack);
    return stack[0].toTensor().narrow(0, 0, rows);
  }
};

// A sparse layer's MLP as SparseMoeBlock runs it with softmax_top_k and QuantizedRoutedExperts
// (engine/models/moe.py, engine/layers/experts.py, quantized_experts.py): the router, a
// float32 softmax, the top k, renormalised where asked, cast to the logits' dtype unless
// kept float, then every expert of the stacked GGUF blocks in one quantized_experts call.
struct Experts {
  Router router;
  int64_t top_k;
  bool normalize, keep_float;
  Tensor gate_up_quants, gate_up_scales, gate_up_mins;
  int64_t gate_up_kind;
  Tensor down_quants, down_scales, down_mins;
  int64_t down_kind, num_experts, width, activation;
  double alpha, limit;

  Tensor operator()(const Tensor& hidden) const {
    const Tensor logits = router(hidden);
    auto [weights, experts] = at::topk(at::softmax(logits, -1, at::kFloat), top_k, -1);
    if (normalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
    if (!keep_float) weights = weights.to(logits.scalar_type());
    return operators().experts.call(hidden.contiguous(), weights.to(at::kFloat).contiguous(), experts.contiguous(),
                                    gate_up_quants, gate_up_scales, gate_up_mins, gate_up_kind, down_quants,
                                    down_scales, down_mins, down_kind, num_experts, width, activation, alpha, limit);
  }
};

struct Layer {
  Tensor input_norm, post_norm;
  std::optional<Tensor> q_norm, k_norm;
  std::array<Projection, 4> projections;
  std::optional<Experts> experts;  // a sparse layer's, in place of the gate/up and down projections
};

class LlamaLayers : public torch::CustomClassHolder {
 public:
  LlamaLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              int64_t sliding_window)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale),
        sliding_window_(sliding_window) {}

  void add_layer(Tensor input_norm, Tensor post_norm, std::optional<Tensor> q_norm, std::optional<Tensor> k_norm) {
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm), {}});
  }

  // The last layer's `projection` gains a part (in row order).
  void add_part(int64_t projection, Tensor quants, Tensor scales, Tensor mins, int64_t kind, int64_t out_features,
                bool has_min, bool packed) {
    TORCH_CHECK(!layers_.empty() && projection >= kQkv && projection <= kDown, "add_layer first; projection 0-3");
    layers_.back().projections[projection].parts.push_back(
        Part{std::move(quants), std::move(scales), std::move(mins), kind, out_features, has_min, packed});
  }

  void set_bias(int64_t projection, Tensor bias) {
    TORCH_CHECK(!layers_.empty() && projection >= kQkv && projection <= kDown, "add_layer first; projection 0-3");
    layers_.back().projections[projection].bias = std::move(bias);
  }

  // The last layer's MLP is a sparse one (see Experts).
  void set_experts(Tensor router, std::optional<Tensor> router_bias, int64_t top_k, bool normalize, bool keep_float,
                   Tensor gate_up_quants, Tensor gate_up_scales, Tensor gate_up_mins, int64_t gate_up_kind,
                   Tensor down_quants, Tensor down_scales, Tensor down_mins, int64_t down_kind, int64_t num_experts,
                   int64_t width, int64_t activation, double alpha, double limit) {
    TORCH_CHECK(!layers_.empty(), "add_layer first");
    layers_.back().experts = Experts{Router{std::move(router), std::move(router_bias)},
                                     top_k,
                                     normalize,
                                     keep_float,
                                     std::move(gate_up_quants),
                                     std::move(gate_up_scales),
                                     std::move(gate_up_mins),
                                     gate_up_kind,
                                     std::move(down_quants),
                                     std::move(down_scales),
                                     std::move(down_mins),
                                     down_kind,
                                     num_experts,
                                     width,
                                     activation,
                                     alpha,
                                     limit};
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden: the embeddings [T, H]; cos, sin: [T, 1, D]; the caches of every layer; the
  // step's slots and the attention rows' tables. Returns (the last layer's output, the
  // residual), for the final add-and-norm.
  std::tuple<Tensor, Tensor> forward(const Tensor& embeddings, const Tensor& cos, const Tensor& sin,
                                     std::vector<Tensor> key_caches, std::vector<Tensor> value_caches,
                                     const Tensor& slot_mapping, const Tensor& tables, const Tensor& lengths,
                                     const Tensor& row_groups) {
    TORCH_CHECK(key_caches.size() == layers_.size() && value_caches.size() == layers_.size(), "a cache per layer");
    const Operators& op = operators();
    const int64_t tokens = embeddings.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    Tensor hidden = embeddings, residual, normed;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (i == 0) {
        residual = hidden;
        normed = op.rms_norm.call(hidden, layer.input_norm, eps_);
      } else {
        std::tie(residual, normed) = op.add_rms_norm.call(residual, hidden, layer.input_norm, eps_);
      }
      const Tensor qkv = layer.projections[kQkv](normed);
      std::vector<Tensor> split = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
      Tensor q = split[0].view({tokens, num_heads_, head_dim_});
      Tensor k = split[1].view({tokens, num_kv_heads_, head_dim_});
      const Tensor v = split[2].view({tokens, num_kv_heads_, head_dim_});
      if (layer.q_norm && layer.k_norm) {
        q = op.rms_norm.call(q, *layer.q_norm, eps_);
        k = op.rms_norm.call(k, *layer.k_norm, eps_);
      }
      q = op.rotary.call(q, cos, sin);
      k = op.rotary.call(k, cos, sin);
      Tensor& key_cache = key_caches[i];
      Tensor& value_cache = value_caches[i];
      const auto cache_type = key_cache.scalar_type();
      op.cache_write.call(k.to(cache_type), v.to(cache_type), key_cache, value_cache, slot_mapping);
      const Tensor attended =
          op.attention.call(q, key_cache, value_cache, tables, lengths, row_groups, scale_, sliding_window_,
                            /*softcap=*/0.0, /*sinks=*/std::nullopt, /*chunk=*/0);  // the Llama family has none
      const Tensor projected = layer.projections[kOut](attended.view({tokens, q_size}));
      std::tie(residual, normed) = op.add_rms_norm.call(residual, projected, layer.post_norm, eps_);
      hidden = layer.experts ? (*layer.experts)(normed)
                             : layer.projections[kDown](op.silu_and_mul.call(layer.projections[kGateUp](normed)));
    }
    return {hidden, residual};
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t sliding_window_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagefleet, m) {
  m.class_<LlamaLayers>("LlamaLayers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, int64_t>())
      .def("add_layer", &LlamaLayers::add_layer)
      .def("add_part", &LlamaLayers::add_part)
      .def("set_bias", &LlamaLayers::set_bias)
      .def("set_experts", &LlamaLayers::set_experts)
      .def("num_layers", &LlamaLayers::num_layers)
      .def("forward", &LlamaLayers::forward);
}
