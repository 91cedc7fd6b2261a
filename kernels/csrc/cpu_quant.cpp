// y = x @ W.T with W in GGML's block formats, read as stored (4 or 8 bits a weight plus a
// float16 scale and min per 32 weights, or per 16 for Q6_K): a decode step on a CPU is bound by
// reading weights, and these are 5-7x smaller than float32. As llama.cpp does, each
// activation row is quantized to int8 per block of 32 (scale = max |x| / 127), so a block's
// dot product is integer multiply-adds and one float scale. One kernel serves every number
// of rows, so a row's output never depends on what else is in the step (batch invariance):
// on AVX2 the weights repacked with 8 columns interleaved (cpu_quant_columns.h), on AVX-512
// VNNI the blocks in GGML's order (cpu_quant_vnni.h). Reference: pagefleet/engine/layers/
// quantized.py (`quantized_linear_torch`), which dequantizes and multiplies in float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_experts_rows.h"
#include "cpu_vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagefleet {
namespace {

constexpr int64_t kBlock = 32;
// Weights a thread must have to share a loop. OpenMP's threads spin between the loops of a
// step (the engine sets GOMP_SPINCOUNT, libgomp's own default does too), so a second thread
// starts in about a microsecond: at 32 KiB every SmolLM2 projection is split, which took
// batch 1 from 31-34 to 45-48 tok/s on 2 threads (0.5 MiB before, when only gate/up and the
// head were).
constexpr int64_t kBytesPerThread = 1 << 15;

// Formats of the op's `format` argument (the Python side maps GGML's types to them). Every
// weight is stored unsigned, w = scale * u + min: Q4_0's min is -8 * scale, Q8_0's bytes
// are q + 128 with min -128 * scale.
constexpr int64_t kFourBit = 0;     // Q4_0, Q4_1, Q4_K: two weights a byte, a scale per 32
constexpr int64_t kEightBit = 1;    // Q5_0, Q5_1, Q5_K, Q8_0: a byte a weight, a scale per 32
constexpr int64_t kEightBit16 = 2;  // Q6_K: a byte a weight, a scale per 16
// The VNNI kernel's own layouts of 5- and 6-bit codes (cpu_quant_vnni.h): nibbles and planes
// of high bits, 0.63 and 0.75 bytes a weight. Q6_K's mins are not stored (-32 times the scales).
constexpr int64_t kSixBit16 = 3;  // Q6_K, a scale per 16
constexpr int64_t kFiveBit = 4;   // Q5_0, Q5_1, Q5_K with an even number of blocks a row
constexpr int64_t kLastFormat = kFiveBit;

inline int64_t groups_per_block(int64_t format) { return format == kEightBit16 || format == kSixBit16 ? 2 : 1; }

// Bytes of quants a row of `in_features` weights takes in `format`.
inline int64_t format_row_bytes(int64_t format, int64_t in_features) {
  switch (format) {
    case kFourBit: return in_features / 2;
    case kSixBit16: return in_features / 2 + in_features / 4;
    case kFiveBit: return in_features / 2 + in_features / 8;
    default: return in_features;
  }
}

// Activation rows quantized per block of 32: q = round(x / scale), scale = max |x| / 127.
// In the pair layout (the VNNI kernel's) blocks 2p and 2p + 1 are stored interleaved by
// halves: 2p's elements 0-15, 2p+1's 0-15, 2p's 16-31, 2p+1's 16-31; an odd last block as is.
struct QuantizedActivations {
  int64_t rows = 0;
  const int8_t* quants = nullptr;      // [rows, in_features]
  const float* scales = nullptr;       // [rows, in_features / 32]
  const float* scaled_sums = nullptr;  // [rows, in_features / 32]: scale * sum(q)
  const float* half_sums = nullptr;    // [rows, in_features / 16]: the same per 16 elements
};

inline int64_t pair_position(int64_t block, int element, int64_t num_blocks, bool pair_layout) {
  if (!pair_layout || (block == num_blocks - 1 && num_blocks % 2)) return block * kBlock + element;
  return (block / 2) * 2 * kBlock + (element / 16) * kBlock + (block % 2) * 16 + element % 16;
}

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t in_features, bool pair_layout, int8_t* quants, float* scales,
                   float* sums, float* half_sums) {
  const int64_t num_blocks = in_features / kBlock;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < num_blocks; ++b) {
        const T* block = x + m * in_features + b * kBlock;
        float amax = 0.f;
        for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(widen(block[i])));
        const float scale = amax / 127.f;
        const float inverse = scale > 0.f ? 1.f / scale : 0.f;
        int half[2] = {0, 0};
        int8_t* row = quants + m * in_features;
        for (int i = 0; i < kBlock; ++i) {
          const int8_t q = static_cast<int8_t>(std::nearbyint(widen(block[i]) * inverse));
          row[pair_position(b, i, num_blocks, pair_layout)] = q;
          half[i / 16] += q;
        }
        scales[m * num_blocks + b] = scale;
        sums[m * num_blocks + b] = scale * static_cast<float>(half[0] + half[1]);
        half_sums[2 * (m * num_blocks + b)] = scale * static_cast<float>(half[0]);
        half_sums[2 * (m * num_blocks + b) + 1] = scale * static_cast<float>(half[1]);
      }
    }
  });
}

// x [rows, in_features] (float32 or bfloat16) quantized per block of 32, owning its arrays.
struct ActivationRows {
  int64_t rows;
  std::vector<int8_t> quants;
  std::vector<float> scales, sums, half_sums;
  ActivationRows(const at::Tensor& x, bool pair_layout)
      : rows(x.size(0)),
        quants(x.numel()),
        scales(x.numel() / kBlock),
        sums(x.numel() / kBlock),
        half_sums(2 * x.numel() / kBlock) {
    dispatch_float(x, [&](auto zero) {
      using T = decltype(zero);
      quantize_rows(x.data_ptr<T>(), rows, x.size(1), pair_layout, quants.data(), scales.data(), sums.data(),
                    half_sums.data());
    });
  }
  QuantizedActivations view() const { return {rows, quants.data(), scales.data(), sums.data(), half_sums.data()}; }
};

#if defined(__AVX2__)
#include "cpu_quant_columns.h"

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl,avx512bw,avx512dq,avx512f")
namespace vnni {
#include "cpu_quant_vnni.h"
}  // namespace vnni
#pragma GCC pop_options

// Each row's block-pair scales spread over vpdpbusd's lanes, once for all columns.
std::vector<__m512> activation_pair_scales(const QuantizedActivations& x, int64_t num_blocks) {
  const int64_t num_pairs = num_blocks / 2;
  std::vector<__m512> pair_scales(x.rows * num_pairs);
  for (int64_t m = 0; m < x.rows; ++m)
    for (int64_t p = 0; p < num_pairs; ++p)
      pair_scales[m * num_pairs + p] =
          vnni::pair_lanes(x.scales[m * num_blocks + 2 * p], x.scales[m * num_blocks + 2 * p + 1]);
  return pair_scales;
}

// Columns [begin, end) of every row by the VNNI kernel for `format`'s layout; mins null for
// kSixBit16 (derived).
void vnni_columns(int64_t format, const QuantizedActivations& x, const __m512* pair_scales, const uint8_t* quants,
                  const at::Half* scales, const at::Half* mins, int64_t in_features, int64_t begin, int64_t end,
                  float* out, int64_t out_stride) {
  const int64_t groups = groups_per_block(format);
  switch (format) {
    case kFourBit: return vnni::columns<4>(x, pair_scales, quants, scales, mins, in_features, groups, begin, end, out, out_stride);
    case kFiveBit: return vnni::columns<5>(x, pair_scales, quants, scales, mins, in_features, groups, begin, end, out, out_stride);
    case kSixBit16: return vnni::columns<6>(x, pair_scales, quants, scales, nullptr, in_features, groups, begin, end, out, out_stride);
    default: return vnni::columns<8>(x, pair_scales, quants, scales, mins, in_features, groups, begin, end, out, out_stride);
  }
}
#endif

// PAGEFLEET_CPU_NO_VNNI=1 takes the AVX2 kernel (and its packed layout) on a VNNI CPU.
bool has_vnni() {
#if defined(__AVX512F__)
  static const bool supported = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                                std::getenv("PAGEFLEET_CPU_NO_VNNI") == nullptr;
  return supported;
#else
  return false;
#endif
}
#endif

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales,
                            const at::Tensor& mins, int64_t format) {
#if !defined(__AVX512F__)
  TORCH_CHECK(false, "quantized_linear (GGML's order) needs AVX-512 VNNI: elsewhere the weight is packed");
#else
  TORCH_CHECK(has_vnni(), "quantized_linear (GGML's order) needs AVX-512 VNNI: elsewhere the weight is packed");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: [rows, in_features], contiguous");
  TORCH_CHECK(format >= kFourBit && format <= kLastFormat,
              "format: 0 (4-bit), 1 (8-bit), 2 (8-bit, a scale per 16), 3 (6-bit planes, a scale per 16) or 4 "
              "(5-bit planes)");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = quants.size(0);
  const int64_t whole = format == kFourBit || format == kEightBit ? kBlock : 2 * kBlock;
  TORCH_CHECK(in_features % whole == 0, "in_features must be a multiple of ", whole, ", got ", in_features);
  const int64_t row_bytes = format_row_bytes(format, in_features);
  TORCH_CHECK(quants.scalar_type() == at::kByte && quants.is_contiguous() && quants.size(1) == row_bytes,
              "quants: uint8 [out_features, ", row_bytes, "] for format ", format, " and ", in_features, " inputs");
  const int64_t num_blocks = in_features / kBlock;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == out_features &&
                  scales.size(1) == num_blocks * groups_per_block(format),
              "scales: float16 [out_features, in_features / (16 if format 2 or 3 else 32)]");
  TORCH_CHECK(mins.scalar_type() == at::kHalf && mins.is_contiguous() &&
                  (format == kSixBit16 ? mins.numel() == 0 : mins.sizes() == scales.sizes()),
              "mins: float16, shaped like scales (empty for format 3, whose mins the kernel derives)");

  const int64_t min_columns = std::max<int64_t>(16, kBytesPerThread / (row_bytes * std::max<int64_t>(1, rows)));
  const ActivationRows quantized(x, true);
  const QuantizedActivations activations = quantized.view();

  at::Tensor out = at::empty({rows, out_features}, x.options().dtype(at::kFloat));
  float* out_data = out.data_ptr<float>();
  const uint8_t* weight_data = quants.data_ptr<uint8_t>();
  const at::Half* scale_data = scales.data_ptr<at::Half>();
  const at::Half* min_data = mins.data_ptr<at::Half>();
  {
    const std::vector<__m512> pair_scales = activation_pair_scales(activations, num_blocks);
    // Columns split over threads, in pairs: each reads only its own weight rows.
    at::parallel_for(0, (out_features + 1) / 2, min_columns / 2, [&](int64_t first, int64_t last) {
      vnni_columns(format, activations, pair_scales.data(), weight_data, scale_data, min_data, in_features, 2 * first,
                   std::min(out_features, 2 * last), out_data, out_features);
    });
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
#endif
}

// The AVX2 kernel over the packed layout. kind: 0 4-bit (Q4_0, Q4_1, Q4_K), 1 5-bit bytes
// (Q5_0, Q5_1, Q5_K), 2 6-bit bytes with a scale per 16 (Q6_K), 3 signed bytes (Q8_0).
at::Tensor quantized_linear_packed(const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales,
                                   const at::Tensor& mins, int64_t kind, int64_t out_features, bool has_min) {
#if !defined(__AVX2__)
  TORCH_CHECK(false, "quantized_linear_packed needs an AVX2 build");
#else
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: [rows, in_features], contiguous");
  TORCH_CHECK(kind >= 0 && kind <= 3, "kind: 0 (4-bit), 1 (5-bit), 2 (6-bit, a scale per 16) or 3 (signed 8-bit)");
  const int64_t rows = x.size(0), in_features = x.size(1);
  TORCH_CHECK(in_features % (2 * kBlock) == 0 || (kind != 2 && in_features % kBlock == 0),
              "in_features must be a multiple of 32 (64 for Q6_K), got ", in_features);
  const int64_t num_blocks = in_features / kBlock, num_column_groups = (out_features + kLanes - 1) / kLanes;
  const int64_t groups_per_block = kind == 2 ? 2 : 1;
  const int64_t block_bytes = kind == 3 ? 256 : 128 + 32 * kind;  // the nibbles and 0-2 planes of high bits
  TORCH_CHECK(quants.scalar_type() == at::kByte && quants.is_contiguous() && quants.dim() == 2 &&
                  quants.size(0) == num_column_groups && quants.size(1) == num_blocks * block_bytes,
              "quants: uint8 [out_features / 8, in_features / 32 * (128, 160, 192 or 256 by kind)]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == num_column_groups && scales.size(1) == num_blocks * groups_per_block &&
                  scales.size(2) == kLanes,
              "scales: float16 [out_features / 8, in_features / (16 if Q6_K else 32), 8]");
  TORCH_CHECK(mins.scalar_type() == at::kHalf && mins.is_contiguous() &&
                  (kind >= 2 ? mins.numel() == 0 : mins.sizes() == scales.sizes()),
              "mins: float16, shaped like scales (empty for Q6_K and Q8_0, whose mins the kernel derives)");

  const ActivationRows quantized(x, false);
  const QuantizedActivations activations = quantized.view();
  at::Tensor out = at::empty({rows, out_features}, x.options().dtype(at::kFloat));
  float* out_data = out.data_ptr<float>();
  const uint8_t* weight_data = quants.data_ptr<uint8_t>();
  const at::Half* scale_data = scales.data_ptr<at::Half>();
  const at::Half* min_data = mins.data_ptr<at::Half>();
  const int64_t group_bytes = num_blocks * block_bytes;
  const int64_t min_groups = std::max<int64_t>(2, kBytesPerThread / (group_bytes * std::max<int64_t>(1, rows)));
  at::parallel_for(0, num_column_groups, min_groups, [&](int64_t first, int64_t last) {
    auto run = [&](auto kind_tag) {
      column_groups<decltype(kind_tag)>(activations, weight_data, scale_data, min_data, has_min, in_features,
                                        out_features, first, last, out_data);
    };
    switch (kind) {
      case 0: return run(KindFourBit{});
      case 1: return run(KindFiveBit{});
      case 2: return run(KindSixBit16{});
      default: return run(KindSigned{});
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
#endif
}

// Whether quantized_linear_packed is the kernel this CPU runs (else quantized_linear).
bool quantized_packed_layout() {
#if defined(__AVX2__)
  return !has_vnni();
#else
  return false;
#endif
}

bool has_quantized_linear() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX2__)
#include "cpu_quant_experts.h"
#else
at::Tensor quantized_experts(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, int64_t, int64_t, int64_t, int64_t, double, double) {
  TORCH_CHECK(false, "quantized_experts needs an AVX2 build");
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagefleet, m) {
  m.def("quantized_linear(Tensor x, Tensor quants, Tensor scales, Tensor mins, int format) -> Tensor");
  m.def(
      "quantized_linear_packed(Tensor x, Tensor quants, Tensor scales, Tensor mins, int kind, int out_features, "
      "bool has_min) -> Tensor");
  m.def(
      "quantized_experts(Tensor hidden, Tensor weights, Tensor experts, Tensor gate_up_quants, "
      "Tensor gate_up_scales, Tensor gate_up_mins, int gate_up_kind, Tensor down_quants, Tensor down_scales, "
      "Tensor down_mins, int down_kind, int num_experts, int width, int activation, float alpha, float limit) -> "
      "Tensor");
  m.def("has_quantized_linear() -> bool", &has_quantized_linear);
  m.def("quantized_packed_layout() -> bool", &quantized_packed_layout);
}

TORCH_LIBRARY_IMPL(pagefleet, CPU, m) {
  m.impl("quantized_linear", &quantized_linear);
  m.impl("quantized_linear_packed", &quantized_linear_packed);
  m.impl("quantized_experts", &quantized_experts);
}

}  // namespace pagefleet
