// Fused element-wise operators for CPUs: one pass over memory where plain torch makes
// several (a decode step spends a fifth of its time in these small ops otherwise).
//
//   rms_norm(x [T, H], weight [H], eps)      weight * (x * rsqrt(mean(x^2) + eps)), in float32
//   add_rms_norm(x, delta, weight, eps)      (x + delta, rms_norm(x + delta)): residual add and norm
//   gemma_rms_norm(x [T, H], weight [H], eps) x * rsqrt(mean(x^2) + eps) * (1 + weight), in float32
//   silu_and_mul(x [T, 2I])                  silu(x[:, :I]) * x[:, I:]
//   gelu_tanh_and_mul(x [T, 2I])             gelu_tanh(x[:, :I]) * x[:, I:]  (Gemma's MLP)
//   rotary(x [T, N, D], cos [T, D], sin)     x * cos + rotate_half(x) * sin  (HF Llama's form)
//   argmax_rows(x [T, V])                    int64 [T]: torch.argmax(x, -1) (a greedy step's tokens)
//
// Each computes in float32 whatever the dtype (as torch's references do for bf16: the
// result is rounded once), rows spread over torch's thread pool. The plain-torch
// references are in pagefleet/engine/layers/fused.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>

#include "cpu_vec.h"

namespace {

using namespace pagefleet;

// Elements below which an op runs on the calling thread: waking the pool's other threads
// (they sleep, with OMP_WAIT_POLICY=PASSIVE) costs more than a small op itself.
constexpr int64_t kSerialElements = 1 << 16;

inline int64_t grain(int64_t elements_per_item) { return std::max<int64_t>(1, kSerialElements / elements_per_item); }

// 1 / sqrt(mean(row^2) + eps), in float32.
template <typename T>
inline float inverse_rms(const T* row, int64_t size, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < size; ++i) squares += widen(row[i]) * widen(row[i]);
  return 1.f / std::sqrt(squares / static_cast<float>(size) + eps);
}

// With `delta` (and `sum`): sum = x + delta (rounded to T, as torch's add), and the norm is
// of the sum: the residual add of a decoder layer and its next norm in one pass.
template <typename T>
void rms_norm_rows(const T* x, const T* delta, T* sum, const T* weight, T* out, int64_t rows, int64_t size,
                   int64_t stride, int64_t delta_stride, float eps) {
  at::parallel_for(0, rows, grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * stride;
      T* target = out + r * size;
      if (delta != nullptr) {
        T* added = sum + r * size;
        const T* d = delta + r * delta_stride;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= size; i += 16) store16(added + i, _mm512_add_ps(load16(row + i), load16(d + i)));
#endif
        for (; i < size; ++i) narrow(widen(row[i]) + widen(d[i]), added + i);
        row = added;
      }
      const float inverse = inverse_rms(row, size, eps);
      // As HF: normalise in float32, round to the dtype, then scale by the weight.
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 scale = _mm512_set1_ps(inverse);
      for (; i + 16 <= size; i += 16) {
        const __m512 normalised = round_as(static_cast<T*>(nullptr), _mm512_mul_ps(load16(row + i), scale));
        store16(target + i, _mm512_mul_ps(load16(weight + i), normalised));
      }
#endif
      for (; i < size; ++i) {
        T normalised;
        narrow(widen(row[i]) * inverse, &normalised);
        narrow(widen(weight[i]) * widen(normalised), target + i);
      }
    }
  });
}

// Gemma's RMSNorm: x normalised, then scaled by (1 + weight), all in float32 and rounded
// once (transformers' Gemma3RMSNorm).
template <typename T>
void gemma_rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t size, int64_t stride, float eps) {
  at::parallel_for(0, rows, grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * stride;
      T* target = out + r * size;
      const float inverse = inverse_rms(row, size, eps);
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 scale = _mm512_set1_ps(inverse), one = _mm512_set1_ps(1.f);
      for (; i + 16 <= size; i += 16) {
        const __m512 normalised = _mm512_mul_ps(load16(row + i), scale);
        store16(target + i, _mm512_mul_ps(normalised, _mm512_add_ps(one, load16(weight + i))));
      }
#endif
      for (; i < size; ++i) narrow(widen(row[i]) * inverse * (1.f + widen(weight[i])), target + i);
    }
  });
}

// act(gate) * up with act = silu (kGelu false) or GELU's tanh form (true), both as
// g / (1 + exp(-a)): a = g for silu; for GELU a = 2 sqrt(2/pi) (g + 0.044715 g^3), since
// 0.5 (1 + tanh(u)) = sigmoid(2u).
template <typename T, bool kGelu>
void act_and_mul_rows(const T* x, T* out, int64_t rows, int64_t size, int64_t stride) {
  constexpr float kBeta = 1.5957691216057308f;  // 2 sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  at::parallel_for(0, rows, grain(2 * size), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * stride;
      const T* up = gate + size;
      T* target = out + r * size;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f), beta = _mm512_set1_ps(kBeta), kappa = _mm512_set1_ps(kKappa);
      for (; i + 16 <= size; i += 16) {
        const __m512 g = load16(gate + i);
        __m512 a = g;
        if constexpr (kGelu) a = _mm512_mul_ps(beta, _mm512_fmadd_ps(_mm512_mul_ps(kappa, g), _mm512_mul_ps(g, g), g));
        const __m512 act = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
        // As torch: the activation is rounded to the dtype before the product.
        store16(target + i, _mm512_mul_ps(round_as(static_cast<T*>(nullptr), act), load16(up + i)));
      }
#endif
      for (; i < size; ++i) {
        const float g = widen(gate[i]);
        const float a = kGelu ? kBeta * std::fma(kKappa * g, g * g, g) : g;
        T act;
        narrow(g / (1.f + std::exp(-a)), &act);
        narrow(widen(act) * widen(up[i]), target + i);
      }
    }
  });
}

template <typename T>
void rotary_rows(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads, int64_t dim,
                 int64_t stride_token, int64_t stride_head) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* row = x + t * stride_token + h * stride_head;
        T* target = out + (t * heads + h) * dim;
        // Rounded like torch's three ops: x * cos, rotate_half(x) * sin, then their sum.
        const auto rotate = [&](int64_t from, int64_t to, int64_t partner, float sign) {
          int64_t i = from;
#if defined(__AVX512F__)
          const __m512 signs = _mm512_set1_ps(sign);
          for (; i + 16 <= to; i += 16) {
            const __m512 first = round_as(static_cast<T*>(nullptr), _mm512_mul_ps(load16(row + i), load16(c + i)));
            const __m512 rotated = _mm512_mul_ps(signs, load16(row + i + partner));
            const __m512 second = round_as(static_cast<T*>(nullptr), _mm512_mul_ps(rotated, load16(s + i)));
            store16(target + i, _mm512_add_ps(first, second));
          }
#endif
          for (; i < to; ++i) {
            T first, second;
            narrow(widen(row[i]) * widen(c[i]), &first);
            narrow(sign * widen(row[i + partner]) * widen(s[i]), &second);
            narrow(widen(first) + widen(second), target + i);
          }
        };
        rotate(0, half, half, -1.f);
        rotate(half, dim, -half, 1.f);
      }
    }
  });
}

// rms_norm (kGemma false) or gemma_rms_norm (true) over the last dim of x, any leading shape.
template <bool kGemma>
at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.stride(-1) == 1 && weight.is_contiguous(), "CPU, last dim contiguous");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1), "weight: [H], x's dtype");
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    const T *source = rows.data_ptr<T>(), *scale = weight.data_ptr<T>();
    const float epsilon = static_cast<float>(eps);
    if constexpr (kGemma) {
      gemma_rms_norm_rows<T>(source, scale, out.data_ptr<T>(), rows.size(0), rows.size(1), rows.stride(0), epsilon);
    } else {
      rms_norm_rows<T>(source, nullptr, nullptr, scale, out.data_ptr<T>(), rows.size(0), rows.size(1), rows.stride(0),
                       0, epsilon);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.sizes() == delta.sizes() && x.stride(1) == 1 &&
                  delta.stride(1) == 1 && delta.scalar_type() == x.scalar_type(),
              "x, delta: [T, H] alike, last dim contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1),
              "weight: [H], x's dtype");
  at::Tensor sum = at::empty(x.sizes(), x.options()), out = at::empty(x.sizes(), x.options());
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(x.data_ptr<T>(), delta.data_ptr<T>(), sum.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<T>(),
                     x.size(0), x.size(1), x.stride(0), delta.stride(0), static_cast<float>(eps));
  });
  return {sum, out};
}

template <bool kGelu>
at::Tensor act_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x: [T, 2I]");
  const int64_t size = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), size}, x.options());
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    act_and_mul_rows<T, kGelu>(x.data_ptr<T>(), out.data_ptr<T>(), x.size(0), size, x.stride(0));
  });
  return out;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x: [T, N, D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "cos, sin: [T, D] contiguous, x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(x.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1),
                   x.size(2), x.stride(0), x.stride(1));
  });
  return out;
}

// The first index of the row's largest value, or of its first NaN (torch.argmax's answer).
// Each lane keeps the first of its indices with its largest value (strictly greater
// replaces), so among lanes the smallest index with the largest value wins.
template <typename T>
int64_t argmax_row(const T* row, int64_t size) {
  int64_t i = 0, best_index = 0;
  float best = -INFINITY;
  bool has_nan = false;
#if defined(__AVX512F__)
  if (size >= 16) {
    __m512 lane_best = load16(row);
    __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i index = lane_index;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(lane_best, lane_best, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= size; i += 16) {
      const __m512 value = load16(row + i);
      index = _mm512_add_epi32(index, step);
      const __mmask16 greater = _mm512_cmp_ps_mask(value, lane_best, _CMP_GT_OQ);
      lane_best = _mm512_mask_mov_ps(lane_best, greater, value);
      lane_index = _mm512_mask_mov_epi32(lane_index, greater, index);
      nan |= _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    }
    alignas(64) float values[16];
    alignas(64) int32_t indices[16];
    _mm512_store_ps(values, lane_best);
    _mm512_store_si512(reinterpret_cast<__m512i*>(indices), lane_index);
    best = values[0], best_index = indices[0];
    for (int lane = 1; lane < 16; ++lane) {
      if (values[lane] > best || (values[lane] == best && indices[lane] < best_index)) {
        best = values[lane], best_index = indices[lane];
      }
    }
    has_nan = nan != 0;
  }
#endif
  if (has_nan) i = 0;  // find the first NaN
  for (; i < size; ++i) {
    const float value = widen(row[i]);
    if (std::isnan(value)) return i;
    if (value > best) best = value, best_index = i;
  }
  return best_index;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0 && x.size(1) < (1LL << 31),
              "x: [T, V], V in [1, 2^31), last dim contiguous");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* target = out.data_ptr<int64_t>();
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    const T* base = x.data_ptr<T>();
    const int64_t size = x.size(1), stride = x.stride(0);
    at::parallel_for(0, x.size(0), grain(size), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) target[r] = argmax_row<T>(base + r * stride, size);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagefleet, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("gemma_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagefleet, CPU, m) {
  m.impl("rms_norm", &norm<false>);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("gemma_rms_norm", &norm<true>);
  m.impl("silu_and_mul", &act_and_mul<false>);
  m.impl("gelu_tanh_and_mul", &act_and_mul<true>);
  m.impl("rotary", &rotary);
  m.impl("argmax_rows", &argmax_rows);
}
