// Routed experts over GGML blocks as stored, in one call (Qwen3-MoE, Qwen2-MoE, Mixtral and
// DeepSeek served from GGUF files), included by cpu_quant.cpp inside its namespace:
//
//   quantized_experts(hidden [T, H], weights [T, k] float32, experts [T, k] int64,
//                     gate_up quants, scales, mins, kind   (per expert 2I rows: gate, then up)
//                     down quants, scales, mins, kind      (per expert H rows)
//                     num_experts, activation, alpha, limit) -> [T, H]
//
// The weights are in the layout this CPU's quantized matmul reads (quantized_packed_layout):
// packed groups of 8 columns, `kind` as quantized_linear_packed's (0 4-bit, 1 5-bit, 2 6-bit
// with a scale per 16, 3 signed 8-bit), or GGML's block order on AVX-512 VNNI, `kind` as
// quantized_linear's `format` (0-4). Every expert's rows are consecutive, so expert e's gate/up
// is rows e*2I .. e*2I + 2I of one [E*2I, H] matrix (groups e*2I/8 .. in the packed one).
//
// The work is fused_experts' (cpu_experts.cpp): pairs grouped by expert, items of up to 64
// rows of one expert spread over the threads; per item its rows quantized to int8 per block
// of 32 as quantized_linear quantizes them, the gate/up columns, the activation, the
// activated rows quantized, the down columns, the routing weight; then each token's
// contributions summed in ascending expert order. Per row this is exactly what the loop of
// quantized_linear calls does (QuantizedRoutedExperts.forward_loop,
// engine/layers/quantized_experts.py): the same quantized rows, the same column kernel, each
// step rounded as its torch op rounds; only the Python between the calls is gone (at one
// token on a Qwen3-30B-A3B-scaled layer, 0.5 ms against the loop's 2.7: docs/benchmarks.md).
#pragma once

// cpu_quant.cpp includes cpu_experts_rows.h ahead, outside its namespace.

namespace quant_experts {

using namespace expert_rows;

// One projection of every expert: `rows` output rows an expert, in this CPU's layout.
struct ExpertMatrix {
  const uint8_t* quants;
  const at::Half* scales;
  const at::Half* mins;
  int64_t kind, in_features, rows;
  bool packed;

  // Q6_K's scale per 16 (kind 2 in both layouts, 3 in VNNI's planes).
  int64_t groups_per_block() const { return packed ? (kind == 2 ? 2 : 1) : pagefleet::groups_per_block(kind); }
  // Packed Q6_K and Q8_0 hold no mins, nor VNNI's 6-bit planes (the kernels derive them).
  bool stores_mins() const { return packed ? kind < 2 : kind != kSixBit16; }
  // Bytes of quants and float16s of scales one expert's rows take.
  int64_t expert_bytes() const {
    const int64_t num_blocks = in_features / kBlock;
    if (packed) return rows / kLanes * num_blocks * (kind == 3 ? 256 : 128 + 32 * kind);
    return rows * format_row_bytes(kind, in_features);
  }
  int64_t expert_halves() const { return rows * in_features / kBlock * groups_per_block(); }
};

// Per thread: an item's rows as the matmuls read them, quantized, and their outputs.
template <typename T>
struct Workspace {
  std::vector<T> gathered;
  std::vector<int8_t> quants;
  std::vector<float> scales, sums, half_sums, projected, activated, routed;
  Workspace(int64_t hidden, int64_t width)
      : gathered(kRowsPerItem * hidden), quants(kRowsPerItem * std::max(hidden, width)),
        scales(kRowsPerItem * std::max(hidden, width) / kBlock), sums(scales.size()), half_sums(2 * scales.size()),
        projected(kRowsPerItem * 2 * width), activated(kRowsPerItem * width), routed(kRowsPerItem * hidden) {}

  // `rows` rows of `in_features` values quantized as quantized_linear quantizes its input.
  template <typename X>
  QuantizedActivations quantize(const X* x, int64_t rows, int64_t in_features, bool pair_layout) {
    quantize_rows(x, rows, in_features, pair_layout, quants.data(), scales.data(), sums.data(), half_sums.data());
    return {rows, quants.data(), scales.data(), sums.data(), half_sums.data()};
  }
};

// out [x.rows, matrix.rows] = x @ W_e.T, float32, by the kernel quantized_linear(_packed) runs.
inline void multiply(const QuantizedActivations& x, const ExpertMatrix& matrix, int64_t expert, float* out) {
  const uint8_t* quants = matrix.quants + expert * matrix.expert_bytes();
  const at::Half* scales = matrix.scales + expert * matrix.expert_halves();
  const at::Half* mins = matrix.stores_mins() ? matrix.mins + expert * matrix.expert_halves() : nullptr;
  const int64_t in_features = matrix.in_features, num_groups = matrix.rows / kLanes;
  if (matrix.packed) {
    const bool has_min = matrix.kind != 3;
    auto run = [&](auto kind_tag) {
      column_groups<decltype(kind_tag)>(x, quants, scales, mins, has_min, in_features, matrix.rows, 0, num_groups,
                                        out);
    };
    switch (matrix.kind) {
      case 0: return run(KindFourBit{});
      case 1: return run(KindFiveBit{});
      case 2: return run(KindSixBit16{});
      default: return run(KindSigned{});
    }
  }
#if defined(__AVX512F__)
  const std::vector<__m512> pair_scales = activation_pair_scales(x, in_features / kBlock);
  vnni_columns(matrix.kind, x, pair_scales.data(), quants, scales, mins, in_features, 0, matrix.rows, out,
               matrix.rows);
#endif
}

template <typename T>
struct Problem {
  const T* hidden;
  const float* weights;  // [T, k]
  int64_t top_k, hidden_size, width;
  ExpertMatrix gate_up, down;
  Activation activation;
  T* contributions;  // [T * k, H]: pair p = token * k + slot
};

template <typename T>
void run_item(const Problem<T>& problem, const Groups& groups, const Item& item, Workspace<T>& space) {
  const int64_t hidden = problem.hidden_size, width = problem.width, rows = item.end - item.first;
  const int64_t* pairs = groups.pairs.data() + item.first;
  const bool pair_layout = !problem.gate_up.packed;
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(problem.hidden + pairs[r] / problem.top_k * hidden, hidden, space.gathered.data() + r * hidden);
  multiply(space.quantize(space.gathered.data(), rows, hidden, pair_layout), problem.gate_up, item.expert,
           space.projected.data());
  for (int64_t r = 0; r < rows; ++r)
    activate_row<T>(space.projected.data() + r * 2 * width, nullptr, width, problem.activation,
                    space.activated.data() + r * width);
  // The activated values are already rounded to T: quantizing them as float32 reads what the
  // reference's T tensor holds.
  multiply(space.quantize(space.activated.data(), rows, width, pair_layout), problem.down, item.expert,
           space.routed.data());
  for (int64_t r = 0; r < rows; ++r)
    finish_row<T>(space.routed.data() + r * hidden, nullptr, problem.weights[pairs[r]], hidden,
                  problem.contributions + pairs[r] * hidden);
}

inline ExpertMatrix expert_matrix(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins,
                                  int64_t kind, int64_t num_experts, int64_t rows, int64_t in_features,
                                  const char* name) {
  const bool packed = quantized_packed_layout();
  const ExpertMatrix matrix{quants.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(),
                            kind, in_features, rows, packed};
  TORCH_CHECK(kind >= 0 && kind <= (packed ? 3 : kLastFormat), name, ": kind ", kind, " is not one of this CPU's layout");
  TORCH_CHECK(in_features % (kBlock * matrix.groups_per_block()) == 0 && (!packed || rows % kLanes == 0), name,
              ": ", rows, " rows of ", in_features, " inputs an expert do not fit the layout");
  TORCH_CHECK(quants.scalar_type() == at::kByte && quants.is_contiguous() &&
                  quants.numel() == num_experts * matrix.expert_bytes(),
              name, ": quants, uint8, contiguous, ", matrix.expert_bytes(), " bytes an expert");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == num_experts * matrix.expert_halves(),
              name, ": scales, float16, contiguous, ", matrix.expert_halves(), " an expert");
  TORCH_CHECK(mins.scalar_type() == at::kHalf && mins.is_contiguous() &&
                  (matrix.stores_mins() ? mins.sizes() == scales.sizes() : mins.numel() == 0),
              name, ": mins, float16, shaped like scales (empty for packed Q6_K and Q8_0 and VNNI's 6-bit planes)");
  return matrix;
}

}  // namespace quant_experts

at::Tensor quantized_experts(const at::Tensor& hidden, const at::Tensor& weights, const at::Tensor& experts,
                             const at::Tensor& gate_up_quants, const at::Tensor& gate_up_scales,
                             const at::Tensor& gate_up_mins, int64_t gate_up_kind, const at::Tensor& down_quants,
                             const at::Tensor& down_scales, const at::Tensor& down_mins, int64_t down_kind,
                             int64_t num_experts, int64_t width, int64_t activation, double alpha, double limit) {
  using namespace quant_experts;
  TORCH_CHECK(has_quantized_linear(), "quantized_experts needs an AVX2 build");
  TORCH_CHECK(hidden.device().is_cpu() && hidden.dim() == 2 && hidden.is_contiguous(), "hidden: [T, H], contiguous");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2 &&
                  weights.size(0) == hidden.size(0),
              "weights: [T, k] float32, contiguous");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.is_contiguous() && experts.sizes() == weights.sizes(),
              "experts: [T, k] int64, contiguous, the shape of weights");
  TORCH_CHECK(activation >= kSilu && activation <= kSwigluOai, "activation: 0 silu, 1 gelu_tanh, 2 swiglu_oai");
  const int64_t num_tokens = hidden.size(0), top_k = weights.size(1), size = hidden.size(1);
  const ExpertMatrix gate_up = expert_matrix(gate_up_quants, gate_up_scales, gate_up_mins, gate_up_kind, num_experts,
                                             2 * width, size, "gate_up");
  const ExpertMatrix down =
      expert_matrix(down_quants, down_scales, down_mins, down_kind, num_experts, size, width, "down");
  const Groups groups = group_by_expert(experts.data_ptr<int64_t>(), num_tokens * top_k, num_experts);
  at::Tensor out = at::empty({num_tokens, size}, hidden.options());
  at::Tensor contributions = contributions_buffer(num_tokens * top_k, size, hidden.options());
  dispatch_float(hidden, [&](auto tag) {
    using T = decltype(tag);
    const Problem<T> problem{hidden.data_ptr<T>(),
                             weights.data_ptr<float>(),
                             top_k,
                             size,
                             width,
                             gate_up,
                             down,
                             {activation, static_cast<float>(alpha), static_cast<float>(limit)},
                             contributions.data_ptr<T>()};
    for_each_item(
        groups, 3 * size * width, [&] { return Workspace<T>(size, width); },
        [&](const Item& item, Workspace<T>& space) { run_item(problem, groups, item, space); });
    sum_in_expert_order(contributions.data_ptr<T>(), experts.data_ptr<int64_t>(), num_tokens, top_k, size,
                        out.data_ptr<T>());
  });
  return out;
}
