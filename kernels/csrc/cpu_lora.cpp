// Multi-LoRA for a CPU step: every run of rows adds its own adapter's low-rank update.
//
//   lora_add(x [T, in], y [T, out] (updated in place), a [S, W, in], b [S, W, out],
//            runs [R, 3] int64 (slot, first row, end row), ranks [S] int64,
//            segments [G, 2] int64 (first output row, end output row))
//
// For each run and each segment g of the projection's output (q, k and v of a fused qkv):
//   y[rows, segment g] += (x[rows] @ a[slot, g*r:(g+1)*r].T) @ b[slot, g*r:(g+1)*r, segment g]
// with r the slot's rank (0: the adapter leaves this projection alone). The engine orders
// a step's rows by adapter, so a run is many rows of one adapter: each item of work is 16
// rows of one run, which share every read of A and B (two rows per read in the shrink and
// in the expand). Sums in float32; y is rounded once. The
// reference is the same sums in torch (engine/lora/layer.py, `add_delta_torch`).
//
// One call per projection replaces two torch matmuls per run and segment: at a decode
// step's sizes those are microseconds of work each, and their dispatch, slicing and
// thread wake-ups cost more than the arithmetic.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace pagefleet;

constexpr int64_t kRowsPerItem = 16;  // rows of one run that share the reads of A and B from cache
// Multiply-adds below which a call runs on the calling thread: waking the pool's other
// threads (they sleep, with OMP_WAIT_POLICY=PASSIVE) costs more than such a step.
constexpr int64_t kSerialMacs = 1 << 23;

// Shrink of one item: shrunk[w][r] = a[w] . x[first + r], for w < used and r < rows. Two
// rows and four rows of A at a time: eight sums in registers, each load serving several.
template <typename T>
void shrink(const T* x, int64_t x_stride, int64_t rows, const T* a, int64_t in, int64_t used, float* shrunk) {
  int64_t w = 0;
#if defined(__AVX512F__)
  const int64_t vector_end = in - in % 16;
  for (; w + 4 <= used; w += 4) {
    const T* a_rows[4] = {a + w * in, a + (w + 1) * in, a + (w + 2) * in, a + (w + 3) * in};
    for (int64_t r = 0; r < rows; r += 2) {
      const bool pair = r + 1 < rows;
      const T* x0 = x + r * x_stride;
      const T* x1 = pair ? x0 + x_stride : x0;
      __m512 first[4], second[4];
      for (int j = 0; j < 4; ++j) first[j] = second[j] = _mm512_setzero_ps();
      for (int64_t i = 0; i < vector_end; i += 16) {
        const __m512 v0 = load16(x0 + i), v1 = load16(x1 + i);
        for (int j = 0; j < 4; ++j) {
          const __m512 weights = load16(a_rows[j] + i);
          first[j] = _mm512_fmadd_ps(weights, v0, first[j]);
          second[j] = _mm512_fmadd_ps(weights, v1, second[j]);
        }
      }
      for (int j = 0; j < 4; ++j) {
        float sum0 = _mm512_reduce_add_ps(first[j]), sum1 = _mm512_reduce_add_ps(second[j]);
        for (int64_t i = vector_end; i < in; ++i) {
          sum0 += widen(a_rows[j][i]) * widen(x0[i]);
          sum1 += widen(a_rows[j][i]) * widen(x1[i]);
        }
        shrunk[(w + j) * kRowsPerItem + r] = sum0;
        if (pair) shrunk[(w + j) * kRowsPerItem + r + 1] = sum1;
      }
    }
  }
#endif
  for (; w < used; ++w)
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < in; ++i) sum += widen(a[w * in + i]) * widen(x[r * x_stride + i]);
      shrunk[w * kRowsPerItem + r] = sum;
    }
}

// Expand of one item onto one segment: y[r][columns] += sum_k shrunk[k][r] * b[k][columns],
// k over the segment's band of `rank`. Two rows at a time share each load of B; the sums of
// 64 columns stay in registers across the band.
template <typename T>
void expand(const float* shrunk, int64_t rows, const T* b, int64_t out, int64_t rank, int64_t column_start,
            int64_t column_end, T* y, int64_t y_stride) {
  int64_t column = column_start;
#if defined(__AVX512F__)
  for (; column + 64 <= column_end; column += 64) {
    for (int64_t r = 0; r < rows; r += 2) {
      const bool pair = r + 1 < rows;
      __m512 first[4], second[4];
      for (int j = 0; j < 4; ++j) first[j] = second[j] = _mm512_setzero_ps();
      for (int64_t k = 0; k < rank; ++k) {
        const T* row_of_b = b + k * out + column;
        const __m512 c0 = _mm512_set1_ps(shrunk[k * kRowsPerItem + r]);
        const __m512 c1 = _mm512_set1_ps(pair ? shrunk[k * kRowsPerItem + r + 1] : 0.f);
        for (int j = 0; j < 4; ++j) {
          const __m512 weights = load16(row_of_b + 16 * j);
          first[j] = _mm512_fmadd_ps(c0, weights, first[j]);
          second[j] = _mm512_fmadd_ps(c1, weights, second[j]);
        }
      }
      T* target = y + r * y_stride + column;
      for (int j = 0; j < 4; ++j) store16(target + 16 * j, _mm512_add_ps(load16(target + 16 * j), first[j]));
      if (pair)
        for (int j = 0; j < 4; ++j)
          store16(target + y_stride + 16 * j, _mm512_add_ps(load16(target + y_stride + 16 * j), second[j]));
    }
  }
#endif
  for (; column < column_end; ++column)
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < rank; ++k) sum += shrunk[k * kRowsPerItem + r] * widen(b[k * out + column]);
      T* target = y + r * y_stride + column;
      narrow(widen(*target) + sum, target);
    }
}

template <typename T>
void lora_add_rows(const T* x, int64_t x_stride, T* y, int64_t y_stride, const T* a, const T* b, int64_t in,
                   int64_t out, int64_t width, const int64_t* runs, int64_t num_runs, const int64_t* ranks,
                   const int64_t* segments, int64_t num_segments) {
  std::vector<std::array<int64_t, 3>> items;  // (slot, first row, end row)
  int64_t macs = 0;
  for (int64_t run = 0; run < num_runs; ++run) {
    const int64_t slot = runs[3 * run], first = runs[3 * run + 1], end = runs[3 * run + 2];
    if (ranks[slot] == 0) continue;
    for (int64_t row = first; row < end; row += kRowsPerItem) items.push_back({slot, row, std::min(end, row + kRowsPerItem)});
    macs += (end - first) * ranks[slot] * (num_segments * in + out);
  }
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t grain = macs < kSerialMacs ? std::max<int64_t>(count, 1) : 1;
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> shrunk(width * kRowsPerItem);
    for (int64_t item = begin; item < end; ++item) {
      const auto [slot, first, last] = items[item];
      const int64_t rank = ranks[slot];
      const T* b_slot = b + slot * width * out;
      shrink(x + first * x_stride, x_stride, last - first, a + slot * width * in, in, num_segments * rank,
             shrunk.data());
      for (int64_t g = 0; g < num_segments; ++g)
        expand(shrunk.data() + g * rank * kRowsPerItem, last - first, b_slot + g * rank * out, out, rank,
               segments[2 * g], segments[2 * g + 1], y + first * y_stride, y_stride);
    }
  });
}

void lora_add(const at::Tensor& x, at::Tensor& y, const at::Tensor& a, const at::Tensor& b, const at::Tensor& runs,
              const at::Tensor& ranks, const at::Tensor& segments) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x [T, in], y [T, out]");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "x, y: last dim contiguous");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
                  a.size(1) == b.size(1) && a.size(2) == x.size(1) && b.size(2) == y.size(1),
              "a [S, W, in], b [S, W, out], contiguous");
  TORCH_CHECK(a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type() &&
                  y.scalar_type() == x.scalar_type(),
              "x, y, a, b: one dtype");
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.is_contiguous() && runs.dim() == 2 && runs.size(1) == 3,
              "runs: [R, 3] int64");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous() && ranks.numel() == a.size(0), "ranks: [S] int64");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.is_contiguous() && segments.dim() == 2 &&
                  segments.size(1) == 2,
              "segments: [G, 2] int64");
  const int64_t* run = runs.data_ptr<int64_t>();
  const int64_t* rank = ranks.data_ptr<int64_t>();
  const int64_t* segment = segments.data_ptr<int64_t>();
  for (int64_t r = 0; r < runs.size(0); ++r)
    TORCH_CHECK(run[3 * r] >= 0 && run[3 * r] < a.size(0) && 0 <= run[3 * r + 1] && run[3 * r + 1] <= run[3 * r + 2] &&
                    run[3 * r + 2] <= x.size(0),
                "runs: a slot or a row out of range");
  for (int64_t s = 0; s < ranks.numel(); ++s)
    TORCH_CHECK(rank[s] >= 0 && segments.size(0) * rank[s] <= a.size(1), "ranks: beyond the stacks' width");
  for (int64_t g = 0; g < segments.size(0); ++g)
    TORCH_CHECK(0 <= segment[2 * g] && segment[2 * g] <= segment[2 * g + 1] && segment[2 * g + 1] <= y.size(1),
                "segments: out of range");
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    lora_add_rows<T>(x.data_ptr<T>(), x.stride(0), y.data_ptr<T>(), y.stride(0), a.data_ptr<T>(), b.data_ptr<T>(),
                     x.size(1), y.size(1), a.size(1), run, runs.size(0), rank, segment, segments.size(0));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagefleet, m) {
  m.def("lora_add(Tensor x, Tensor(a!) y, Tensor a, Tensor b, Tensor runs, Tensor ranks, Tensor segments) -> ()");
}

TORCH_LIBRARY_IMPL(pagefleet, CPU, m) { m.impl("lora_add", &lora_add); }
