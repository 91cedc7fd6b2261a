// The quantized matmul on AVX2 (CPUs without AVX-512 VNNI), included by cpu_quant.cpp
// inside its namespace: a block at a time, 256 bits wide, activations in natural order.
#pragma once

// 8 int32 lanes, each the sum of four adjacent u8 * s8 products (vpmaddubsw's int16 sums
// cannot saturate: |u| <= 128 and |s| <= 127 here).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// 32 weights of one block as unsigned bytes, in element order: 4-bit blocks hold elements
// 0-15 in the low nibbles of their 16 bytes and 16-31 in the high ones (GGML's layout).
inline __m256i unpack_nibbles(const uint8_t* packed) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(bytes, low_mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
  return _mm256_set_m128i(high, low);
}

inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

constexpr int kTileRows = 4;  // activation rows sharing each unpacked weight block

// out[m, n] for columns [first, last) and every row m: y = sum over blocks of
// d_w * d_x * (integer dot) + sum over groups of min'_w * d_x * sum(q_x). 8-bit weights are
// made signed (u - 128: vpmaddubsw's unsigned operand must stay below 128), so their min'
// is min + 128 d_w (zero for Q8_0, whose min is -128 d_w). With a scale per 16
// (groups_per_block 2), the dot's lanes 0-3 are a block's elements 0-15 and 4-7 its 16-31.
template <bool kFourBit>
void columns(const QuantizedActivations& x, const uint8_t* quants, const at::Half* scales, const at::Half* mins,
             int64_t in_features, int64_t groups_per_block, int64_t first, int64_t last, float* out,
             int64_t out_stride) {
  const int64_t num_blocks = in_features / kBlock, num_groups = num_blocks * groups_per_block;
  const int64_t row_bytes = kFourBit ? in_features / 2 : in_features;
  const float* group_sums = groups_per_block == 2 ? x.half_sums : x.scaled_sums;
  std::vector<float> weight_scale(num_groups), weight_min(num_groups);
  std::vector<__m256> block_scales(num_blocks);
  for (int64_t n = first; n < last; ++n) {
    const uint8_t* row = quants + n * row_bytes;
    bool has_min = false;
    for (int64_t g = 0; g < num_groups; ++g) {
      weight_scale[g] = static_cast<float>(scales[n * num_groups + g]);
      weight_min[g] = static_cast<float>(mins[n * num_groups + g]) + (kFourBit ? 0.f : 128.f * weight_scale[g]);
      has_min = has_min || weight_min[g] != 0.f;
    }
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float low = weight_scale[b * groups_per_block], high = weight_scale[(b + 1) * groups_per_block - 1];
      block_scales[b] = _mm256_set_m128(_mm_set1_ps(high), _mm_set1_ps(low));
    }
    for (int64_t m0 = 0; m0 < x.rows; m0 += kTileRows) {
      const int tile = static_cast<int>(std::min<int64_t>(kTileRows, x.rows - m0));
      __m256 acc[kTileRows];
      for (int r = 0; r < kTileRows; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < num_blocks; ++b) {
        __m256i weights;
        if constexpr (kFourBit) {
          weights = unpack_nibbles(row + b * (kBlock / 2));
        } else {
          weights = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock)),
                                     _mm256_set1_epi8(static_cast<char>(0x80)));
        }
        // 8-bit blocks are signed: |w| as the unsigned operand, x carrying w's sign.
        const __m256i unsigned_weights = kFourBit ? weights : _mm256_sign_epi8(weights, weights);
        for (int r = 0; r < tile; ++r) {
          const int64_t m = m0 + r;
          __m256i values = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.quants + m * in_features + b * kBlock));
          if constexpr (!kFourBit) values = _mm256_sign_epi8(values, weights);
          const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(unsigned_weights, values));
          const __m256 scale = _mm256_mul_ps(block_scales[b], _mm256_set1_ps(x.scales[m * num_blocks + b]));
          acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
        }
      }
      for (int r = 0; r < tile; ++r) {
        const int64_t m = m0 + r;
        float total = horizontal_sum(acc[r]);
        if (has_min) {
          const float* sums = group_sums + m * num_groups;
          for (int64_t g = 0; g < num_groups; ++g) total += weight_min[g] * sums[g];
        }
        out[m * out_stride + n] = total;
      }
    }
  }
}
