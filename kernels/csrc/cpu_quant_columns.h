// The quantized matmul on AVX2, over weights repacked at load with 8 output columns
// interleaved (pagefleet/engine/layers/quantized.py, `PackedWeight`), included by
// cpu_quant.cpp inside its namespace.
//
// Why columns across the lanes: each 32-bit lane holds 4 consecutive weights of its own
// column, so one vpmaddubsw against 4 activation bytes broadcast to every lane advances 8
// columns at once and a block's integer dot ends in its own lane, with no horizontal sum.
// The same code serves 1 row and 1000: a tile of up to 4 rows shares each unpacked weight
// vector, and every output's arithmetic is the same whatever the tile (batch invariance):
//
//   for each group g of 32 (16 for Q6_K) weights, in order along in_features:
//     acc = fma(float(integer dot of g), d_w[g] * d_x[g], acc)
//     acc = fma(min_w[g], d_x[g] * sum(q_x over g), acc)     (formats with a min)
//
// Layout of a group of 8 columns (j) and a block of 32 weights (b), k = 0..7 the steps of 4
// weights (elements 4k..4k+3 of the block):
//   4-bit:  uint8 [j, b, 4, 32]: byte (t, 4c + i): low nibble = column c's element 4t + i,
//           high nibble = its element 16 + 4t + i (step t low, step t + 4 high)
//   5-bit, 6-bit: the 4-bit layout of the codes' low nibbles, then 1 (5-bit) or 2 (6-bit)
//           planes of 32 bytes: plane h's byte 4c + i holds, in its bit k, bit 4 + h of
//           column c's element 4k + i (0.75 and 0.94 bytes a weight where a byte each took 1)
//   8-bit:  uint8 [j, b, 8, 32]: byte (k, 4c + i) = column c's element 4k + i; Q8_0 signed
//   scales, mins: float16 [j, groups, 8]; no mins for Q6_K (-32 times the scale, derived)
//           nor for Q8_0 (signed: zero)
#pragma once

// How a format's codes are multiplied: vpmaddubsw sums two u8 * s8 products into int16,
// which saturates past 32767, so each kind adds as many steps in int16 as its largest code
// allows before widening (4-bit: 8 * 2 * 15 * 127; 5-bit: 4 * 2 * 31 * 127; 6-bit: 2 * 2 *
// 63 * 127), and Q8_0's signed bytes take vpsignb's trick (|w| unsigned, x carrying w's sign).
struct KindFourBit {
  static constexpr bool kNibbles = true, kSigned = false;
  static constexpr int kHighBits = 0, kStepsPerSum = 8, kStepsPerGroup = 8;
};
struct KindFiveBit {
  static constexpr bool kNibbles = true, kSigned = false;
  static constexpr int kHighBits = 1, kStepsPerSum = 4, kStepsPerGroup = 8;
};
struct KindSixBit16 {
  static constexpr bool kNibbles = true, kSigned = false;
  static constexpr int kHighBits = 2, kStepsPerSum = 2, kStepsPerGroup = 4;
};
struct KindSigned {
  static constexpr bool kNibbles = false, kSigned = true;
  static constexpr int kHighBits = 0, kStepsPerSum = 1, kStepsPerGroup = 8;
};

// Packed bytes of one block of 32 weights of 8 columns.
template <typename Kind>
constexpr int64_t block_bytes() {
  return Kind::kNibbles ? 128 + 32 * Kind::kHighBits : 256;
}

constexpr int kLanes = 8;  // columns per group

// Step k of block `block` (its packed bytes) as 32 bytes: 4 weights of each of 8 columns.
template <typename Kind>
inline __m256i weight_step(const uint8_t* block, int k) {
  if constexpr (Kind::kNibbles) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * (k & 3)));
    const __m256i shifted = k < 4 ? bytes : _mm256_srli_epi16(bytes, 4);
    __m256i codes = _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
    for (int h = 0; h < Kind::kHighBits; ++h) {
      // Bit k of each plane byte to bit 4 + h of the code: a 16-bit shift moves each byte's
      // bit within its own byte at the positions the mask keeps.
      const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
      const int target = 4 + h;
      const __m256i moved = k < target   ? _mm256_slli_epi16(plane, target - k)
                            : k > target ? _mm256_srli_epi16(plane, k - target)
                                         : plane;
      codes = _mm256_or_si256(codes, _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(1 << target))));
    }
    return codes;
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * k));
  }
}

// Activation bytes 4k..4k+3 of a row's block, in every lane.
inline __m256i activation_step(const int8_t* block, int k) {
  int32_t word;
  std::memcpy(&word, block + 4 * k, 4);
  return _mm256_set1_epi32(word);
}

// Rows [m0, m0 + kRows) by the 8 columns of group j: every block, then the outputs stored.
template <typename Kind, int kRows>
void column_tile(const QuantizedActivations& x, const uint8_t* group_quants, const at::Half* group_scales,
                 const at::Half* group_mins, bool has_min, int64_t in_features, int64_t m0, int64_t first_column,
                 int64_t columns, float* out, int64_t out_stride) {
  constexpr int kGroupsPerBlock = 8 / Kind::kStepsPerGroup;
  constexpr int64_t kBlockBytes = block_bytes<Kind>();
  const int64_t num_blocks = in_features / kBlock;
  const float* group_sums = kGroupsPerBlock == 2 ? x.half_sums : x.scaled_sums;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = group_quants + b * kBlockBytes;
    for (int g = 0; g < kGroupsPerBlock; ++g) {
      __m256i dots[kRows];
      for (int r = 0; r < kRows; ++r) dots[r] = _mm256_setzero_si256();
      for (int s = 0; s < Kind::kStepsPerGroup; s += Kind::kStepsPerSum) {
        __m256i sums[kRows];
        for (int r = 0; r < kRows; ++r) sums[r] = _mm256_setzero_si256();
        for (int step = 0; step < Kind::kStepsPerSum; ++step) {
          const int k = g * Kind::kStepsPerGroup + s + step;
          const __m256i weights = weight_step<Kind>(block, k);
          const __m256i unsigned_weights = Kind::kSigned ? _mm256_sign_epi8(weights, weights) : weights;
          for (int r = 0; r < kRows; ++r) {
            __m256i values = activation_step(x.quants + (m0 + r) * in_features + b * kBlock, k);
            if constexpr (Kind::kSigned) values = _mm256_sign_epi8(values, weights);
            sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(unsigned_weights, values));
          }
        }
        for (int r = 0; r < kRows; ++r) dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(sums[r], ones));
      }
      const int64_t group = b * kGroupsPerBlock + g;
      const __m256 weight_scales =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group_scales + group * kLanes)));
      for (int r = 0; r < kRows; ++r) {
        const int64_t m = m0 + r;
        const __m256 scale = _mm256_mul_ps(weight_scales, _mm256_set1_ps(x.scales[m * num_blocks + b]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), scale, acc[r]);
      }
      if (has_min) {
        // Q6_K's min is -32 times its scale (exact in float16 and here): derived, not read.
        const __m256 weight_mins =
            Kind::kHighBits == 2
                ? _mm256_mul_ps(weight_scales, _mm256_set1_ps(-32.f))
                : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group_mins + group * kLanes)));
        for (int r = 0; r < kRows; ++r) {
          const float sum = group_sums[(m0 + r) * num_blocks * kGroupsPerBlock + group];
          acc[r] = _mm256_fmadd_ps(weight_mins, _mm256_set1_ps(sum), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    float* target = out + (m0 + r) * out_stride + first_column;
    if (columns == kLanes) {
      _mm256_storeu_ps(target, acc[r]);
    } else {
      alignas(32) float lanes[kLanes];
      _mm256_store_ps(lanes, acc[r]);
      std::memcpy(target, lanes, columns * sizeof(float));
    }
  }
}

constexpr int64_t kColumnRowBlock = 64;  // activation rows kept in L1/L2 while a thread's groups pass

// Groups of 8 columns [first, last) for every row, rows in blocks of 64 and tiles of 4.
template <typename Kind>
void column_groups(const QuantizedActivations& x, const uint8_t* quants, const at::Half* scales,
                   const at::Half* mins, bool has_min, int64_t in_features, int64_t out_features, int64_t first,
                   int64_t last, float* out) {
  const int64_t num_blocks = in_features / kBlock;
  const int64_t group_bytes = num_blocks * block_bytes<Kind>();
  const int64_t group_halves = num_blocks * (8 / Kind::kStepsPerGroup) * kLanes;
  for (int64_t row_block = 0; row_block < x.rows; row_block += kColumnRowBlock) {
    const int64_t row_end = std::min(x.rows, row_block + kColumnRowBlock);
    for (int64_t j = first; j < last; ++j) {
      const uint8_t* group_quants = quants + j * group_bytes;
      const at::Half* group_scales = scales + j * group_halves;
      const at::Half* group_mins = mins + j * group_halves;
      const int64_t first_column = j * kLanes, columns = std::min<int64_t>(kLanes, out_features - first_column);
      if (j + 1 < last) _mm_prefetch(reinterpret_cast<const char*>(group_quants + group_bytes), _MM_HINT_T0);
      int64_t m = row_block;
      for (; m + 4 <= row_end; m += 4)
        column_tile<Kind, 4>(x, group_quants, group_scales, group_mins, has_min, in_features, m, first_column,
                             columns, out, out_features);
      switch (row_end - m) {
        case 3:
          column_tile<Kind, 3>(x, group_quants, group_scales, group_mins, has_min, in_features, m, first_column,
                               columns, out, out_features);
          break;
        case 2:
          column_tile<Kind, 2>(x, group_quants, group_scales, group_mins, has_min, in_features, m, first_column,
                               columns, out, out_features);
          break;
        case 1:
          column_tile<Kind, 1>(x, group_quants, group_scales, group_mins, has_min, in_features, m, first_column,
                               columns, out, out_features);
          break;
        default:
          break;
      }
    }
  }
}
