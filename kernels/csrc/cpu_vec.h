// Helpers shared by the CPU operators: float32 <-> bfloat16, dispatch on the two, and
// 16-lane AVX-512 pieces.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagefleet {

inline float widen(float value) { return value; }
inline float widen(c10::BFloat16 value) {
  uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}
inline void narrow(float value, float* out) { *out = value; }
inline void narrow(float value, c10::BFloat16* out) { *out = c10::BFloat16(value); }

// Calls body(T{}) with T the element type of x: float or c10::BFloat16.
template <typename F>
void dispatch_float(const at::Tensor& x, F&& body) {
  switch (x.scalar_type()) {
    case at::kFloat:
      body(float{});
      break;
    case at::kBFloat16:
      body(c10::BFloat16{});
      break;
    default:
      TORCH_CHECK(false, "float32 or bfloat16 only, got ", x.scalar_type());
  }
}

#if defined(__AVX512F__)
// exp for 16 floats (Cephes' expf: range reduction by ln 2, a degree-5 polynomial), within
// 2 ulp of std::exp over the float range; inputs below -87 give 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365447505531f), _CMP_LT_OQ);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), y, _mm512_castsi512_ps(exponent));
}

inline __m512 load16(const float* source) { return _mm512_loadu_ps(source); }
inline __m512 load16(const c10::BFloat16* source) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(source));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* target, __m512 value) { _mm512_storeu_ps(target, value); }
// Rounds to the nearest bfloat16, ties to even (as c10::BFloat16 does; inputs are finite).
inline __m512i bf16_bits(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
}
inline void store16(c10::BFloat16* target, __m512 value) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(target), _mm512_cvtepi32_epi16(bf16_bits(value)));
}
// The value as type T would hold it (float: itself; bfloat16: rounded), as float32.
inline __m512 round_as(float*, __m512 value) { return value; }
inline __m512 round_as(c10::BFloat16*, __m512 value) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(value), 16));
}
#endif

}  // namespace pagefleet
