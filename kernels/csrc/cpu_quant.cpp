// y = x @ W.T with W in GGML's block formats, read as stored (4 or 8 bits a weight plus a
// float16 scale and min per 32 weights, or per 16 for Q6_K): a decode step on a CPU is bound by
// reading weights, and these are 5-7x smaller than float32. As llama.cpp does, each
// activation row is quantized to int8 per block of 32 (scale = max |x| / 127), so a block's
// dot product is integer multiply-adds (AVX-512 VNNI's vpdpbusd where the CPU has it,
// AVX2's vpmaddubsw otherwise) and one float scale. Reference: pagefleet/engine/layers/
// quantized.py (`quantized_linear_torch`), which does the same in plain torch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "cpu_vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagefleet {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kBytesPerThread = 1 << 19;  // weights a thread must have to be woken for them

// Formats of the op's `format` argument (the Python side maps GGML's types to them). Every
// weight is stored unsigned, w = scale * u + min: Q4_0's min is -8 * scale, Q8_0's bytes
// are q + 128 with min -128 * scale.
constexpr int64_t kFourBit = 0;     // Q4_0, Q4_1, Q4_K: two weights a byte, a scale per 32
constexpr int64_t kEightBit = 1;    // Q5_0, Q5_1, Q5_K, Q8_0: a byte a weight, a scale per 32
constexpr int64_t kEightBit16 = 2;  // Q6_K: a byte a weight, a scale per 16

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

#if defined(__AVX2__)
#include "cpu_quant_avx2.h"

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl,avx512bw,avx512dq,avx512f")
namespace vnni {
#include "cpu_quant_vnni.h"
}  // namespace vnni
#pragma GCC pop_options
#endif

// PAGEFLEET_CPU_NO_VNNI=1 takes the AVX2 path on a VNNI CPU (its tests, and measuring both).
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
#if !defined(__AVX2__)
  TORCH_CHECK(false, "quantized_linear needs an AVX2 or AVX-512 build");
#else
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: [rows, in_features], contiguous");
  TORCH_CHECK(format == kFourBit || format == kEightBit || format == kEightBit16,
              "format: 0 (4-bit), 1 (8-bit) or 2 (8-bit, a scale per 16)");
  const bool four_bit = format == kFourBit;
  const int64_t groups_per_block = format == kEightBit16 ? 2 : 1;
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = quants.size(0);
  TORCH_CHECK(in_features % (kBlock * groups_per_block) == 0, "in_features must be a multiple of ",
              kBlock * groups_per_block, ", got ", in_features);
  TORCH_CHECK(quants.scalar_type() == at::kByte && quants.is_contiguous() &&
                  quants.size(1) == (four_bit ? in_features / 2 : in_features),
              "quants: uint8 [out_features, in_features / (2 if 4-bit else 1)]");
  const int64_t num_blocks = in_features / kBlock;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == out_features &&
                  scales.size(1) == num_blocks * groups_per_block,
              "scales: float16 [out_features, in_features / (16 if format 2 else 32)]");
  TORCH_CHECK(mins.scalar_type() == at::kHalf && mins.is_contiguous() && mins.sizes() == scales.sizes(),
              "mins: float16, shaped like scales");

  const bool vnni_dot = has_vnni();
  // Each thread gets at least kBytesPerThread of weights: waking a sleeping OpenMP thread
  // (OMP_WAIT_POLICY=PASSIVE) costs about 45 us here, as long as reading 0.4 MiB. A whole
  // SmolLM2 at one row, layer by layer: 15.3 ms with every layer split over 2 threads,
  // 9.5 ms with 0.5 MiB a thread at least, 10.2 ms on one thread.
  const int64_t row_bytes = four_bit ? in_features / 2 : in_features;
  const int64_t min_columns = std::max<int64_t>(16, kBytesPerThread / (row_bytes * std::max<int64_t>(1, rows)));
  std::vector<int8_t> activation_quants(rows * in_features);
  std::vector<float> activation_scales(rows * num_blocks), activation_sums(rows * num_blocks);
  std::vector<float> activation_half_sums(2 * rows * num_blocks);
  dispatch_float(x, [&](auto zero) {
    using T = decltype(zero);
    quantize_rows(x.data_ptr<T>(), rows, in_features, vnni_dot, activation_quants.data(), activation_scales.data(),
                  activation_sums.data(), activation_half_sums.data());
  });
  const QuantizedActivations activations{rows, activation_quants.data(), activation_scales.data(),
                                         activation_sums.data(), activation_half_sums.data()};

  at::Tensor out = at::empty({rows, out_features}, x.options().dtype(at::kFloat));
  float* out_data = out.data_ptr<float>();
  const uint8_t* weight_data = quants.data_ptr<uint8_t>();
  const at::Half* scale_data = scales.data_ptr<at::Half>();
  const at::Half* min_data = mins.data_ptr<at::Half>();
#if defined(__AVX512F__)
  if (vnni_dot) {
    // Each row's block-pair scales spread over vpdpbusd's lanes, once for all columns.
    const int64_t num_pairs = num_blocks / 2;
    std::vector<__m512> pair_scales(rows * num_pairs);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t p = 0; p < num_pairs; ++p)
        pair_scales[m * num_pairs + p] =
            vnni::pair_lanes(activation_scales[m * num_blocks + 2 * p], activation_scales[m * num_blocks + 2 * p + 1]);
    // Columns split over threads, in pairs: each reads only its own weight rows.
    at::parallel_for(0, (out_features + 1) / 2, min_columns / 2, [&](int64_t first, int64_t last) {
      const int64_t begin = 2 * first, end = std::min(out_features, 2 * last);
      if (four_bit) {
        vnni::columns<true>(activations, pair_scales.data(), weight_data, scale_data, min_data, in_features, 1,
                            begin, end, out_data, out_features);
      } else {
        vnni::columns<false>(activations, pair_scales.data(), weight_data, scale_data, min_data, in_features,
                             groups_per_block, begin, end, out_data, out_features);
      }
    });
    return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
  }
#endif
  at::parallel_for(0, out_features, min_columns, [&](int64_t first, int64_t last) {
    if (four_bit) {
      columns<true>(activations, weight_data, scale_data, min_data, in_features, 1, first, last, out_data,
                    out_features);
    } else {
      columns<false>(activations, weight_data, scale_data, min_data, in_features, groups_per_block, first, last,
                     out_data, out_features);
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
#endif
}

// The weight dequantized to float32 or bfloat16, [out_features, in_features]: for large
// batches, where a float matmul (bfloat16's dot product instructions) beats int8 dots that
// need a float scale per block.
template <typename T>
void dequantize_rows(const uint8_t* quants, const at::Half* scales, const at::Half* mins, bool four_bit,
                     int64_t groups_per_block, int64_t out_features, int64_t in_features, T* out) {
  const int64_t num_blocks = in_features / kBlock, row_bytes = four_bit ? in_features / 2 : in_features;
  const int64_t num_groups = num_blocks * groups_per_block;
  at::parallel_for(0, out_features, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t* block = quants + n * row_bytes + b * (four_bit ? kBlock / 2 : kBlock);
        // The scale and min of elements 0-15 and of 16-31.
        const int64_t group = n * num_groups + b * groups_per_block, second = group + groups_per_block - 1;
        const float scale[2] = {static_cast<float>(scales[group]), static_cast<float>(scales[second])};
        const float min[2] = {static_cast<float>(mins[group]), static_cast<float>(mins[second])};
        T* target = out + n * in_features + b * kBlock;
#if defined(__AVX512F__)
        __m128i halves[2];  // elements 0-15 and 16-31 as bytes
        if (four_bit) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
          halves[0] = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
          halves[1] = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
        } else {
          halves[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
          halves[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16));
        }
        for (int half = 0; half < 2; ++half) {
          const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(halves[half]));
          store16(target + 16 * half, _mm512_fmadd_ps(values, _mm512_set1_ps(scale[half]), _mm512_set1_ps(min[half])));
        }
#else
        for (int i = 0; i < kBlock; ++i) {
          const int value = four_bit ? (i < 16 ? block[i] & 0x0F : block[i - 16] >> 4) : block[i];
          narrow(static_cast<float>(value) * scale[i / 16] + min[i / 16], target + i);
        }
#endif
      }
    }
  });
}

at::Tensor quantized_dequantize(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins,
                                int64_t format, at::ScalarType dtype) {
  TORCH_CHECK(format == kFourBit || format == kEightBit || format == kEightBit16,
              "format: 0 (4-bit), 1 (8-bit) or 2 (8-bit, a scale per 16)");
  TORCH_CHECK(quants.is_contiguous() && scales.is_contiguous() && mins.is_contiguous(), "contiguous inputs");
  const bool four_bit = format == kFourBit;
  const int64_t groups_per_block = format == kEightBit16 ? 2 : 1;
  const int64_t out_features = quants.size(0), in_features = scales.size(1) / groups_per_block * kBlock;
  at::Tensor out = at::empty({out_features, in_features}, scales.options().dtype(dtype));
  dispatch_float(out, [&](auto zero) {
    using T = decltype(zero);
    dequantize_rows(quants.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), four_bit,
                    groups_per_block, out_features, in_features, out.data_ptr<T>());
  });
  return out;
}

bool has_quantized_linear() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagefleet, m) {
  m.def("quantized_linear(Tensor x, Tensor quants, Tensor scales, Tensor mins, int format) -> Tensor");
  m.def("quantized_dequantize(Tensor quants, Tensor scales, Tensor mins, int format, ScalarType dtype) -> Tensor");
  m.def("has_quantized_linear() -> bool", &has_quantized_linear);
}

TORCH_LIBRARY_IMPL(pagefleet, CPU, m) {
  m.impl("quantized_linear", &quantized_linear);
  m.impl("quantized_dequantize", &quantized_dequantize);
}

}  // namespace pagefleet
