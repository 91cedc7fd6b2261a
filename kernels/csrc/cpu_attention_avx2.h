// The paged attention operator's arithmetic on AVX2 for head sizes that are a multiple of 8,
// included by cpu_attention.cpp inside its namespace. Every (row, head, key) score and every
// output element is computed by the same instructions in the same order whatever the row's
// block, its neighbours or the number of keys the others see: keys are scored 8 at a time
// (a key past the end repeats the last one and its score is never read), each key's dot
// product summed by one fixed tree.
#pragma once

namespace avx2 {

// exp for 8 floats: exp16's Cephes polynomial (cpu_vec.h), inputs below -87 give 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365447505531f), _CMP_LT_OQ);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(exponent)));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// a[i] holds 8 partial sums of key i's dot product: the 8 totals, in key order.
inline __m256 sum_each8(const __m256* a) {
  const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}

// scores[(r * group + j) * kPartition + t] = q_rj . key_t for t < counts[r] (and a few past it).
inline void score(const float* q, const float* const* keys, const int64_t* counts, int64_t num_rows, int64_t group,
                  int64_t head_dim, int64_t longest, float* scores) {
  for (int64_t t0 = 0; t0 < longest; t0 += 8) {
    const float* k[8];
    for (int i = 0; i < 8; ++i) k[i] = keys[std::min<int64_t>(t0 + i, longest - 1)];
    for (int64_t r = 0; r < num_rows; ++r) {
      if (t0 >= counts[r]) continue;
      for (int64_t j = 0; j < group; ++j) {
        const float* qv = q + (r * group + j) * head_dim;
        __m256 a[8];
        const __m256 q0 = _mm256_loadu_ps(qv);
        for (int i = 0; i < 8; ++i) a[i] = _mm256_mul_ps(q0, _mm256_loadu_ps(k[i]));
        for (int64_t c = 8; c < head_dim; c += 8) {
          const __m256 qc = _mm256_loadu_ps(qv + c);
          for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[i] + c), a[i]);
        }
        _mm256_storeu_ps(scores + (r * group + j) * kPartition + t0, sum_each8(a));
      }
    }
  }
}

// scores <- exp(scores - max) over `count`; writes the max and the sum of the exponentials.
inline void softmax_unnormalised(float* scores, int64_t count, float* max_out, float* sum_out) {
  int64_t i = 0;
  __m256 maxima = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; i + 8 <= count; i += 8) maxima = _mm256_max_ps(maxima, _mm256_loadu_ps(scores + i));
  float maximum = max8(maxima);
  for (; i < count; ++i) maximum = std::max(maximum, scores[i]);
  const __m256 shift = _mm256_set1_ps(maximum);
  __m256 total = _mm256_setzero_ps();
  for (i = 0; i + 8 <= count; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), shift));
    _mm256_storeu_ps(scores + i, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = sum8(total);
  for (; i < count; ++i) {
    scores[i] = std::exp(scores[i] - maximum);
    sum += scores[i];
  }
  *max_out = maximum;
  *sum_out = sum;
}

// out[c0 + d] for d < 8 * V: the weighted sum of the first `count` value rows, in key order.
template <int V>
inline void accumulate_columns(const float* w, const float* const* values, int64_t count, int64_t c0, float* out) {
  __m256 s[V];
  for (int u = 0; u < V; ++u) s[u] = _mm256_setzero_ps();
  for (int64_t t = 0; t < count; ++t) {
    const __m256 weight = _mm256_set1_ps(w[t]);
    const float* v = values[t] + c0;
    for (int u = 0; u < V; ++u) s[u] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * u), s[u]);
  }
  for (int u = 0; u < V; ++u) _mm256_storeu_ps(out + c0 + 8 * u, s[u]);
}

// acc[(r * group + j) * D + d] = sum over t < counts[r] of weights[(r * group + j) *
// kPartition + t] * value_t[d], in key order, 64 dimensions at a time in registers.
inline void accumulate(const float* weights, const float* const* values, const int64_t* counts, int64_t num_rows,
                       int64_t group, int64_t head_dim, float* acc) {
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t j = 0; j < group; ++j) {
      const float* w = weights + (r * group + j) * kPartition;
      float* out = acc + (r * group + j) * head_dim;
      int64_t c0 = 0;
      for (; c0 + 64 <= head_dim; c0 += 64) accumulate_columns<8>(w, values, counts[r], c0, out);
      for (; c0 < head_dim; c0 += 8) accumulate_columns<1>(w, values, counts[r], c0, out);
    }
  }
}

}  // namespace avx2
