// y = x @ W.T for an int8 W8A8 checkpoint (vLLM's compressed-tensors "int-quantized"):
// int8 weights with a float scale per output channel, activations quantized to int8 per
// token (scale = max |x| / 127, or one static scale from the checkpoint). The products are
// summed in int32 over the whole row, so the only float work is one scale per output:
// with AVX-512 VNNI, oneDNN's int8 GEMM (at::_int_mm) does 64 multiply-adds an instruction
// where bfloat16 does 32; on AVX2 CPUs without VNNI, where oneDNN's int8 GEMM is slower than
// float32, `int8_linear_packed` sums over weights repacked at load with 8 output channels
// interleaved (vpmaddubsw, 32 multiply-adds an instruction). The integer sums are exact
// either way, so both give the same bits. One op for quantize + GEMM + rescale, so a layer
// costs one dispatch from Python. Reference: pagefleet/engine/layers/int8.py
// (`int8_linear_torch`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagefleet {
namespace {

// Work below this many elements stays on one thread: under OMP_WAIT_POLICY=PASSIVE
// waking another costs ~45 us, more than a decode step's quantize or rescale takes.
constexpr int64_t kElementsPerThread = 1 << 18;

inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kElementsPerThread / row_elements); }

template <typename T>
float row_amax(const T* row, int64_t in_features) {
  float amax = 0.f;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 lanes = _mm512_setzero_ps();
  for (; k + 16 <= in_features; k += 16) lanes = _mm512_max_ps(lanes, _mm512_abs_ps(load16(row + k)));
  amax = _mm512_reduce_max_ps(lanes);
#endif
  for (; k < in_features; ++k) amax = std::max(amax, std::fabs(widen(row[k])));
  return amax;
}

// Each row of x to int8 with its scale: q = round(x / scale) (to nearest, ties to even) in
// [-128, 127]. A row of zeros gets scale 1 (q = 0), as it would anywhere a scale divides.
// Rows of `quant_stride` bytes, the pad zero.
template <typename T>
void quantize_tokens(const T* x, int64_t rows, int64_t in_features, const float* static_scale, int8_t* quants,
                     int64_t quant_stride, float* scales) {
  at::parallel_for(0, rows, grain_rows(in_features), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* row = x + m * in_features;
      float scale = static_scale != nullptr ? *static_scale : row_amax(row, in_features) / 127.f;
      if (scale == 0.f) scale = 1.f;
      const float inverse = 1.f / scale;
      int8_t* target = quants + m * quant_stride;
      std::fill(target + in_features, target + quant_stride, int8_t{0});
      int64_t k = 0;
#if defined(__AVX512F__)
      const __m512 lanes_inverse = _mm512_set1_ps(inverse), low = _mm512_set1_ps(-128.f), high = _mm512_set1_ps(127.f);
      for (; k + 16 <= in_features; k += 16) {
        const __m512 q = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(load16(row + k), lanes_inverse), low), high);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(target + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
      }
#endif
      for (; k < in_features; ++k) {
        target[k] = static_cast<int8_t>(std::clamp(std::nearbyint(widen(row[k]) * inverse), -128.f, 127.f));
      }
      scales[m] = scale;
    }
  });
}

// out = float(sum) * token scale * weight scale, in that order (as the reference rounds).
template <typename T>
void rescale(const int32_t* sums, const float* token_scales, const float* weight_scales, int64_t rows,
             int64_t out_features, T* out) {
  at::parallel_for(0, rows, grain_rows(out_features), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int32_t* row = sums + m * out_features;
      T* target = out + m * out_features;
      int64_t n = 0;
#if defined(__AVX512F__)
      const __m512 token_scale = _mm512_set1_ps(token_scales[m]);
      for (; n + 16 <= out_features; n += 16) {
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_loadu_si512(row + n));
        store16(target + n, _mm512_mul_ps(_mm512_mul_ps(sum, token_scale), _mm512_loadu_ps(weight_scales + n)));
      }
#endif
      for (; n < out_features; ++n) {
        narrow(static_cast<float>(row[n]) * token_scales[m] * weight_scales[n], target + n);
      }
    }
  });
}

#if defined(__AVX2__)
constexpr int64_t kChannels = 8;  // output channels a packed group interleaves

// Exact int32 sums of rows [m0, m0 + kRows) against the 8 channels of one packed group:
// step k holds 4 weights (4k..4k+3) of each channel in its 32-bit lane, so vpmaddubsw against
// 4 activation bytes broadcast to every lane advances 8 channels. vpmaddubsw multiplies
// unsigned by signed bytes: |w| by q carrying w's sign (q is never -128: see
// split_minus_128); its pair sums, at most 2 * 128 * 127, fit int16.
template <int kRows>
void int8_tile(const int8_t* quants, int64_t stride, int64_t m0, const int8_t* group, int64_t steps, int32_t* sums,
               int64_t out_features, int64_t first_channel, int64_t channels) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_si256();
  for (int64_t k = 0; k < steps; ++k) {
    const __m256i weights = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32 * k));
    const __m256i magnitudes = _mm256_sign_epi8(weights, weights);
    for (int r = 0; r < kRows; ++r) {
      int32_t word;
      std::memcpy(&word, quants + (m0 + r) * stride + 4 * k, 4);
      const __m256i values = _mm256_sign_epi8(_mm256_set1_epi32(word), weights);
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, values), ones));
    }
  }
  for (int r = 0; r < kRows; ++r) {
    alignas(32) int32_t lanes[kChannels];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[r]);
    std::memcpy(sums + (m0 + r) * out_features + first_channel, lanes, channels * sizeof(int32_t));
  }
}

// Groups [first, last) for every row: rows in blocks of 64 (kept in cache while the groups
// pass), tiles of 4 sharing each weight load.
void int8_groups(const int8_t* quants, int64_t rows, int64_t stride, const int8_t* packed, int64_t first,
                 int64_t last, int64_t out_features, int32_t* sums) {
  const int64_t steps = stride / 4;
  for (int64_t row_block = 0; row_block < rows; row_block += 64) {
    const int64_t row_end = std::min(rows, row_block + 64);
    for (int64_t j = first; j < last; ++j) {
      const int8_t* group = packed + j * steps * 32;
      const int64_t first_channel = j * kChannels, channels = std::min(kChannels, out_features - first_channel);
      int64_t m = row_block;
      for (; m + 4 <= row_end; m += 4)
        int8_tile<4>(quants, stride, m, group, steps, sums, out_features, first_channel, channels);
      for (; m < row_end; ++m)
        int8_tile<1>(quants, stride, m, group, steps, sums, out_features, first_channel, channels);
    }
  }
}

// -128 has no int8 negation, so a row with codes of -128 (a static scale saturating) is
// summed as two rows: itself with those codes -127, and a row of -1 where they were. Returns
// the rows so split; their second rows are appended after `rows`, `quants` grown to hold them.
std::vector<int64_t> split_minus_128(std::vector<int8_t>& quants, int64_t rows, int64_t stride) {
  std::vector<int64_t> split;
  for (int64_t m = 0; m < rows; ++m) {
    int8_t* row = quants.data() + m * stride;
    if (std::find(row, row + stride, int8_t{-128}) == row + stride) continue;
    split.push_back(m);
    quants.resize(quants.size() + stride, 0);
    row = quants.data() + m * stride;
    int8_t* extra = quants.data() + quants.size() - stride;
    for (int64_t k = 0; k < stride; ++k) {
      if (row[k] == -128) row[k] = -127, extra[k] = -1;
    }
  }
  return split;
}
#endif

// The static input scale as a pointer (null: per token); `holder` keeps it alive.
const float* static_scale_of(const std::optional<at::Tensor>& input_scale, at::Tensor& holder) {
  if (!input_scale.has_value()) return nullptr;
  holder = input_scale->to(at::kFloat).contiguous();
  TORCH_CHECK(holder.numel() == 1, "input_scale: one value");
  return holder.data_ptr<float>();
}

void check_scales(const at::Tensor& weight_scales, int64_t out_features) {
  TORCH_CHECK(weight_scales.scalar_type() == at::kFloat && weight_scales.is_contiguous() &&
                  weight_scales.numel() == out_features,
              "weight_scales: float32 [out]");
}

// x: [rows, in] float32 or bfloat16; weight_t: int8 [in, out] (the [out, in] weight
// transposed, as oneDNN reads it); weight_scales: float32 [out]; input_scale: a float32
// scalar for static activation quantization, else per token.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight_t, const at::Tensor& weight_scales,
                       const std::optional<at::Tensor>& input_scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous [rows, in_features] matrix");
  TORCH_CHECK(weight_t.scalar_type() == at::kChar && weight_t.size(0) == x.size(1), "weight_t: int8 [in, out]");
  check_scales(weight_scales, weight_t.size(1));
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = weight_t.size(1);
  at::Tensor quants = at::empty({rows, in_features}, x.options().dtype(at::kChar));
  at::Tensor token_scales = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor holder;
  const float* static_scale = static_scale_of(input_scale, holder);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  dispatch_float(x, [&](auto zero) {
    using T = decltype(zero);
    quantize_tokens(x.data_ptr<T>(), rows, in_features, static_scale, quants.data_ptr<int8_t>(), in_features,
                    token_scales.data_ptr<float>());
    const at::Tensor sums = at::_int_mm(quants, weight_t);
    rescale(sums.data_ptr<int32_t>(), token_scales.data_ptr<float>(), weight_scales.data_ptr<float>(), rows,
            out_features, out.data_ptr<T>());
  });
  return out;
}

// The same on AVX2 over packed: int8 [ceil(out / 8), ceil(in / 4) * 32], group j step k lane
// c holding weights 4k..4k+3 of channel 8j + c (zeros past the ends).
at::Tensor int8_linear_packed(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_scales,
                              const std::optional<at::Tensor>& input_scale) {
#if !defined(__AVX2__)
  TORCH_CHECK(false, "int8_linear_packed needs an AVX2 build");
#else
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous [rows, in_features] matrix");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = weight_scales.numel();
  const int64_t stride = (in_features + 3) / 4 * 4, num_groups = (out_features + kChannels - 1) / kChannels;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == num_groups && packed.size(1) == stride * kChannels,
              "packed: int8 [ceil(out / 8), ceil(in / 4) * 32]");
  check_scales(weight_scales, out_features);
  std::vector<int8_t> quants(rows * stride);
  std::vector<float> token_scales(rows);
  at::Tensor holder;
  const float* static_scale = static_scale_of(input_scale, holder);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  dispatch_float(x, [&](auto zero) {
    using T = decltype(zero);
    quantize_tokens(x.data_ptr<T>(), rows, in_features, static_scale, quants.data(), stride, token_scales.data());
    const std::vector<int64_t> split = static_scale != nullptr ? split_minus_128(quants, rows, stride)
                                                               : std::vector<int64_t>{};
    const int64_t all_rows = rows + static_cast<int64_t>(split.size());
    std::vector<int32_t> sums(all_rows * out_features);
    const int64_t min_groups = std::max<int64_t>(2, (1 << 15) / (stride * kChannels * std::max<int64_t>(1, all_rows)));
    at::parallel_for(0, num_groups, min_groups, [&](int64_t first, int64_t last) {
      int8_groups(quants.data(), all_rows, stride, packed.data_ptr<int8_t>(), first, last, out_features, sums.data());
    });
    for (size_t i = 0; i < split.size(); ++i) {
      int32_t* row = sums.data() + split[i] * out_features;
      const int32_t* extra = sums.data() + (rows + static_cast<int64_t>(i)) * out_features;
      for (int64_t n = 0; n < out_features; ++n) row[n] += extra[n];
    }
    rescale(sums.data(), token_scales.data(), weight_scales.data_ptr<float>(), rows, out_features, out.data_ptr<T>());
  });
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagefleet, m) {
  m.def("int8_linear(Tensor x, Tensor weight_t, Tensor weight_scales, Tensor? input_scale) -> Tensor");
  m.def("int8_linear_packed(Tensor x, Tensor packed, Tensor weight_scales, Tensor? input_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagefleet, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_packed", &int8_linear_packed);
}

}  // namespace pagefleet
