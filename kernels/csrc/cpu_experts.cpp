// Routed experts in one call: every token through its top-k experts' gated MLPs, weighted
// and summed back in token order (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss, Gemma 4).
//
//   fused_experts(hidden [T, H], weights [T, k] float32, experts [T, k] int64,
//                 gate_up [E*2I, H], down [E*H, I], gate_up_bias [E*2I]?, down_bias [E*H]?,
//                 activation (0 silu, 1 gelu_tanh, 2 swiglu_oai), alpha, limit) -> [T, H]
//
//   1. group: (token, slot) pairs counted per expert, prefix-summed, and listed by expert,
//      in token order within an expert; a negative expert id means "held by another
//      tensor-parallel rank": its pair is never computed and adds nothing;
//   2. per item (up to 64 rows of one expert; items spread over torch's threads, so a
//      decode step's 8 experts of one row run side by side): gate/up rows, bias and
//      activation in one pass over them, down rows, bias, the routing weight: one
//      contribution row per pair;
//   3. per token: its k contributions summed in ascending expert order, in the output dtype.
//
// Rounding follows the torch reference (RoutedExperts.forward_torch, engine/layers/experts.py)
// op by op: each matmul accumulates in float32 and is rounded to the dtype as F.linear's
// output; each bias add, activation step and product is rounded as its torch op is; the
// sum adds in the dtype as index_add_ does. Each matmul is cpu_experts_gemm.h's, whose bits
// for a row never depend on the other rows: a token's output is the same alone or in any
// batch. bfloat16 results equal the reference's within a rounding step or two (its matmul
// sums in another order); float32 ones within summation order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_experts_amx.h"
#include "cpu_experts_gemm.h"
#include "cpu_experts_packed.h"
#include "cpu_experts_rows.h"
#include "cpu_vec.h"

namespace {

using namespace pagefleet;
using experts::linear_rows;
using namespace expert_rows;

template <typename T>
struct Problem {
  const T* hidden;
  int64_t hidden_stride;
  const float* weights;  // [T, k]
  const T* gate_up;      // [E, 2I, H]
  const T* down;         // [E, H, I]
  const T* gate_up_bias;  // [E, 2I] or null
  const T* down_bias;     // [E, H] or null
  int64_t top_k, hidden_size, width;
  Activation activation;
  T* contributions;  // [T * k, H]: pair p = token * k + slot
  bool amx = false;  // bfloat16 matmuls on AMX tiles (cpu_experts_amx.h), for every batch
};

// Per thread, kRowsPerItem rows each. X: the type of the rows the matmuls read (float32,
// or bfloat16 for the bfloat16 dot): `inputs` and `activated_rows` point at them.
template <typename X>
struct Workspace {
  std::vector<X> gathered, activated_x;
  std::vector<float> projected, activated, routed;
  std::vector<const X*> inputs, activated_rows;
  std::vector<uint32_t> tokens;  // the AMX kernel's packed rows
  Workspace(int64_t hidden, int64_t width, bool amx)
      : gathered(kRowsPerItem * hidden), activated_x(kRowsPerItem * width), projected(kRowsPerItem * 2 * width),
        activated(kRowsPerItem * width), routed(kRowsPerItem * hidden), inputs(kRowsPerItem),
        activated_rows(kRowsPerItem), tokens(amx ? kRowsPerItem * std::max(hidden, width) / 2 : 0) {}
};

// x @ w.T for one item's rows: the AMX tiles where the problem takes them, else the chains
// of cpu_experts_gemm.h.
template <typename T, typename X>
void multiply(const Problem<T>& problem, const X* const* x, int64_t rows, const T* w, int64_t size, int64_t outputs,
              float* out, Workspace<X>& space) {
  if constexpr (std::is_same_v<X, c10::BFloat16> && std::is_same_v<T, c10::BFloat16>) {
    if (problem.amx) return experts_amx::linear_rows(x, rows, w, size, outputs, out, outputs, space.tokens.data());
  }
  linear_rows(x, rows, w, size, outputs, out, outputs);
}

// The row a matmul reads for a token: the hidden row in place where it is of type X, else
// widened into `buffer`.
template <typename X, typename T>
const X* input_row(const Problem<T>& problem, int64_t token, X* buffer) {
  const T* row = problem.hidden + token * problem.hidden_stride;
  if constexpr (std::is_same_v<T, X>) {
    return row;
  } else {
    for (int64_t h = 0; h < problem.hidden_size; ++h) buffer[h] = widen(row[h]);
    return buffer;
  }
}

// Activated row r as X reads it: in place for float32; narrowed for bfloat16 (exact: the
// activation already rounded every value to the dtype).
template <typename X>
void expose_activated(Workspace<X>& space, int64_t r, int64_t width) {
  float* row = space.activated.data() + r * width;
  if constexpr (std::is_same_v<X, float>) {
    space.activated_rows[r] = row;
  } else {
    X* narrowed = space.activated_x.data() + r * width;
    for (int64_t i = 0; i < width; ++i) narrow(row[i], narrowed + i);
    space.activated_rows[r] = narrowed;
  }
}

template <typename T, typename X>
void run_item(const Problem<T>& problem, const Groups& groups, const Item& item, Workspace<X>& space) {
  const int64_t hidden = problem.hidden_size, width = problem.width, rows = item.end - item.first;
  const int64_t* pairs = groups.pairs.data() + item.first;
  for (int64_t r = 0; r < rows; ++r)
    space.inputs[r] = input_row(problem, pairs[r] / problem.top_k, space.gathered.data() + r * hidden);
  const T* gate_up = problem.gate_up + item.expert * 2 * width * hidden;
  multiply(problem, space.inputs.data(), rows, gate_up, hidden, 2 * width, space.projected.data(), space);
  const T* gate_up_bias = problem.gate_up_bias ? problem.gate_up_bias + item.expert * 2 * width : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    activate_row(space.projected.data() + r * 2 * width, gate_up_bias, width, problem.activation,
                 space.activated.data() + r * width);
    expose_activated(space, r, width);
  }
  const T* down = problem.down + item.expert * hidden * width;
  multiply(problem, space.activated_rows.data(), rows, down, width, hidden, space.routed.data(), space);
  const T* down_bias = problem.down_bias ? problem.down_bias + item.expert * hidden : nullptr;
  for (int64_t r = 0; r < rows; ++r)
    finish_row(space.routed.data() + r * hidden, down_bias, problem.weights[pairs[r]], hidden,
               problem.contributions + pairs[r] * hidden);
}

template <typename T, typename X>
void run_items(const Problem<T>& problem, const Groups& groups) {
  for_each_item(
      groups, 3 * problem.hidden_size * problem.width,
      [&] { return Workspace<X>(problem.hidden_size, problem.width, problem.amx); },
      [&](const Item& item, Workspace<X>& space) { run_item(problem, groups, item, space); });
}

// bfloat16 rows through the bfloat16 dot where the CPU has one, else everything in float32.
template <typename T>
void run_experts(const Problem<T>& problem, const Groups& groups) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (experts::has_bf16_dot()) return run_items<T, c10::BFloat16>(problem, groups);
  }
#endif
  run_items<T, float>(problem, groups);
}

void check_arguments(const at::Tensor& hidden, const at::Tensor& weights, const at::Tensor& experts,
                     const at::Tensor& gate_up, const at::Tensor& down, const c10::optional<at::Tensor>& gate_up_bias,
                     const c10::optional<at::Tensor>& down_bias) {
  TORCH_CHECK(hidden.device().is_cpu() && hidden.dim() == 2 && hidden.stride(1) == 1,
              "hidden: [T, H] on the CPU, rows contiguous");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2 &&
                  weights.size(0) == hidden.size(0),
              "weights: [T, k] float32, contiguous");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.is_contiguous() && experts.sizes() == weights.sizes(),
              "experts: [T, k] int64, contiguous, the shape of weights");
  const int64_t size = hidden.size(1), width = down.size(1);
  TORCH_CHECK(down.dim() == 2 && down.is_contiguous() && down.size(0) % size == 0, "down: [E*H, I], contiguous");
  const int64_t num_experts = down.size(0) / size;
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(0) == num_experts * 2 * width &&
                  gate_up.size(1) == size,
              "gate_up: [E*2I, H], contiguous");
  TORCH_CHECK(gate_up.scalar_type() == hidden.scalar_type() && down.scalar_type() == hidden.scalar_type(),
              "gate_up, down: the dtype of hidden");
  TORCH_CHECK(gate_up_bias.has_value() == down_bias.has_value(), "gate_up_bias and down_bias: both or neither");
  if (gate_up_bias.has_value()) {
    TORCH_CHECK(gate_up_bias->is_contiguous() && gate_up_bias->numel() == gate_up.size(0) &&
                    gate_up_bias->scalar_type() == hidden.scalar_type(),
                "gate_up_bias: [E*2I] contiguous, the dtype of hidden");
    TORCH_CHECK(down_bias->is_contiguous() && down_bias->numel() == down.size(0) &&
                    down_bias->scalar_type() == hidden.scalar_type(),
                "down_bias: [E*H] contiguous, the dtype of hidden");
  }
}

at::Tensor run_fused_experts(const at::Tensor& hidden, const at::Tensor& weights, const at::Tensor& experts,
                             const at::Tensor& gate_up, const at::Tensor& down,
                             const c10::optional<at::Tensor>& gate_up_bias,
                             const c10::optional<at::Tensor>& down_bias, int64_t activation, double alpha, double limit,
                             bool packed) {
  check_arguments(hidden, weights, experts, gate_up, down, gate_up_bias, down_bias);
  const int64_t size = hidden.size(1), width = down.size(1);
  TORCH_CHECK(!packed || (hidden.scalar_type() == at::kBFloat16 && experts_amx::packed_fits(size, 2 * width) &&
                          experts_amx::packed_fits(width, size)),
              "packed experts: bfloat16, an AMX CPU, and a shape the tiles take (amx_tiles_fit)");
  TORCH_CHECK(activation >= kSilu && activation <= kSwigluOai, "activation: 0 silu, 1 gelu_tanh, 2 swiglu_oai");
  const int64_t num_tokens = hidden.size(0), top_k = weights.size(1), num_experts = down.size(0) / size;
  const Groups groups = group_by_expert(experts.data_ptr<int64_t>(), num_tokens * top_k, num_experts);
#if defined(__AVX512F__)
  if (packed) {
    using BFloat16 = c10::BFloat16;
    at::Tensor out = at::zeros({num_tokens, size}, hidden.options());
    const experts_packed::PackedExperts problem{
        hidden.data_ptr<BFloat16>(),
        hidden.stride(0),
        weights.data_ptr<float>(),
        gate_up.data_ptr<BFloat16>(),
        down.data_ptr<BFloat16>(),
        gate_up_bias.has_value() ? gate_up_bias->data_ptr<BFloat16>() : nullptr,
        down_bias.has_value() ? down_bias->data_ptr<BFloat16>() : nullptr,
        top_k,
        size,
        width,
        {activation, static_cast<float>(alpha), static_cast<float>(limit)}};
    experts_packed::run_packed_experts(problem, groups, out.data_ptr<BFloat16>());
    return out;
  }
#endif
  at::Tensor out = at::empty({num_tokens, size}, hidden.options());
  at::Tensor contributions = contributions_buffer(num_tokens * top_k, size, hidden.options());
  dispatch_float(hidden, [&](auto tag) {
    using T = decltype(tag);
    Problem<T> problem{hidden.data_ptr<T>(),
                       hidden.stride(0),
                       weights.data_ptr<float>(),
                       gate_up.data_ptr<T>(),
                       down.data_ptr<T>(),
                       gate_up_bias.has_value() ? gate_up_bias->data_ptr<T>() : nullptr,
                       down_bias.has_value() ? down_bias->data_ptr<T>() : nullptr,
                       top_k,
                       size,
                       width,
                       {activation, static_cast<float>(alpha), static_cast<float>(limit)},
                       contributions.data_ptr<T>()};
    if constexpr (std::is_same_v<T, c10::BFloat16>)  // by the layer's shape, never by the batch
      problem.amx = experts_amx::has_amx_bf16() && experts_amx::fits(size, 2 * width) && experts_amx::fits(width, size);
    run_experts(problem, groups);
    sum_in_expert_order(contributions.data_ptr<T>(), experts.data_ptr<int64_t>(), num_tokens, top_k, size,
                        out.data_ptr<T>());
  });
  return out;
}

at::Tensor fused_experts(const at::Tensor& hidden, const at::Tensor& weights, const at::Tensor& experts,
                         const at::Tensor& gate_up, const at::Tensor& down,
                         const c10::optional<at::Tensor>& gate_up_bias, const c10::optional<at::Tensor>& down_bias,
                         int64_t activation, double alpha, double limit) {
  return run_fused_experts(hidden, weights, experts, gate_up, down, gate_up_bias, down_bias, activation, alpha, limit,
                           false);
}

// fused_experts with gate_up and down packed by kernels/amx_tiles.py `pack_for_tiles`.
at::Tensor fused_experts_packed(const at::Tensor& hidden, const at::Tensor& weights, const at::Tensor& experts,
                                const at::Tensor& gate_up, const at::Tensor& down,
                                const c10::optional<at::Tensor>& gate_up_bias,
                                const c10::optional<at::Tensor>& down_bias, int64_t activation, double alpha,
                                double limit) {
  return run_fused_experts(hidden, weights, experts, gate_up, down, gate_up_bias, down_bias, activation, alpha, limit,
                           true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagefleet, m) {
  m.def(
      "fused_experts(Tensor hidden, Tensor weights, Tensor experts, Tensor gate_up, Tensor down, "
      "Tensor? gate_up_bias, Tensor? down_bias, int activation, float alpha, float limit) -> Tensor");
  m.def(
      "fused_experts_packed(Tensor hidden, Tensor weights, Tensor experts, Tensor gate_up, Tensor down, "
      "Tensor? gate_up_bias, Tensor? down_bias, int activation, float alpha, float limit) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagefleet, CPU, m) {
  m.impl("fused_experts", &fused_experts);
  m.impl("fused_experts_packed", &fused_experts_packed);
}
