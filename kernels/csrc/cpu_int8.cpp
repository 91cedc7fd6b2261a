// y = x @ W.T for an int8 W8A8 checkpoint (vLLM's compressed-tensors "int-quantized"):
// int8 weights with a float scale per output channel, activations quantized to int8 per
// token (scale = max |x| / 127, or one static scale from the checkpoint). The products are
// summed in int32 over the whole row, so the only float work is one scale per output:
// oneDNN's int8 GEMM (at::_int_mm, VNNI where the CPU has it) does 64 multiply-adds an
// instruction where bfloat16 does 32. One op for quantize + GEMM + rescale, so a layer
// costs one dispatch from Python. Reference: pagefleet/engine/layers/int8.py
// (`int8_linear_torch`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "cpu_vec.h"

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
template <typename T>
void quantize_tokens(const T* x, int64_t rows, int64_t in_features, const float* static_scale, int8_t* quants,
                     float* scales) {
  at::parallel_for(0, rows, grain_rows(in_features), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* row = x + m * in_features;
      float scale = static_scale != nullptr ? *static_scale : row_amax(row, in_features) / 127.f;
      if (scale == 0.f) scale = 1.f;
      const float inverse = 1.f / scale;
      int8_t* target = quants + m * in_features;
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

// x: [rows, in] float32 or bfloat16; weight_t: int8 [in, out] (the [out, in] weight
// transposed, as oneDNN reads it); weight_scales: float32 [out]; input_scale: a float32
// scalar for static activation quantization, else per token.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight_t, const at::Tensor& weight_scales,
                       const std::optional<at::Tensor>& input_scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous [rows, in_features] matrix");
  TORCH_CHECK(weight_t.scalar_type() == at::kChar && weight_t.size(0) == x.size(1), "weight_t: int8 [in, out]");
  TORCH_CHECK(weight_scales.scalar_type() == at::kFloat && weight_scales.is_contiguous() &&
                  weight_scales.numel() == weight_t.size(1),
              "weight_scales: float32 [out]");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = weight_t.size(1);
  at::Tensor quants = at::empty({rows, in_features}, x.options().dtype(at::kChar));
  at::Tensor token_scales = at::empty({rows}, x.options().dtype(at::kFloat));
  const float* static_scale = nullptr;
  at::Tensor static_scale_tensor;
  if (input_scale.has_value()) {
    static_scale_tensor = input_scale->to(at::kFloat).contiguous();
    TORCH_CHECK(static_scale_tensor.numel() == 1, "input_scale: one value");
    static_scale = static_scale_tensor.data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, out_features}, x.options());
  dispatch_float(x, [&](auto zero) {
    using T = decltype(zero);
    quantize_tokens(x.data_ptr<T>(), rows, in_features, static_scale, quants.data_ptr<int8_t>(),
                    token_scales.data_ptr<float>());
    const at::Tensor sums = at::_int_mm(quants, weight_t);
    rescale(sums.data_ptr<int32_t>(), token_scales.data_ptr<float>(), weight_scales.data_ptr<float>(), rows,
            out_features, out.data_ptr<T>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagefleet, m) {
  m.def("int8_linear(Tensor x, Tensor weight_t, Tensor weight_scales, Tensor? input_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagefleet, CPU, m) { m.impl("int8_linear", &int8_linear); }

}  // namespace pagefleet
