// Paged decode attention for CPUs: one query token per sequence over its whole context,
// read in place from the paged KV cache through the sequence's block table (no gather).
//
// Work is split into items of (sequence, kv head, partition of at most kPartition tokens).
// An item computes all query heads that share its kv head together (grouped-query
// attention: the keys and values are read once for the whole group), and keeps a float32
// softmax that is exact within its partition: its maximum, its sum of exponentials and its
// unnormalised output. A second pass combines the partitions of each (sequence, kv head).
// Items run on torch's intra-op thread pool, so long contexts spread over every thread.
//
//   cache (any strides, head_dim contiguous):   [num_blocks, block_size, num_kv_heads, D]
//   token t of a sequence lives at block table[t / block_size], offset t % block_size
//
// Built at run time by pagefleet/kernels/cpu_ops.py for the best instruction set the
// CPU has (AVX-512 with BF16, AVX2 or none); the loops below are written for the compiler
// to vectorise (`omp simd`) and bf16 is widened to float by a shift, which vectorises too.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_paged.h"
#include "cpu_vec.h"

namespace {

using namespace pagefleet;

constexpr int64_t kPartition = 256;  // tokens per work item

template <typename T>
inline void load_row(const T* source, float* row, int64_t head_dim) {
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) row[d] = widen(source[d]);
}

using Geometry = PagedGeometry;

// scores <- exp(scores - max); writes the max and the sum of the exponentials.
inline void softmax_unnormalised(float* scores, int64_t count, float* max_out, float* sum_out) {
  float maximum = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 maxima = _mm512_set1_ps(maximum);
  for (; i + 16 <= count; i += 16) maxima = _mm512_max_ps(maxima, _mm512_loadu_ps(scores + i));
  maximum = _mm512_reduce_max_ps(maxima);
#endif
  for (; i < count; ++i) maximum = std::max(maximum, scores[i]);
  float sum = 0.f;
  i = 0;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(maximum);
  __m512 total = _mm512_setzero_ps();
  for (; i + 16 <= count; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + i), shift));
    _mm512_storeu_ps(scores + i, e);
    total = _mm512_add_ps(total, e);
  }
  sum = _mm512_reduce_add_ps(total);
#endif
  for (; i < count; ++i) {
    scores[i] = std::exp(scores[i] - maximum);
    sum += scores[i];
  }
  *max_out = maximum;
  *sum_out = sum;
}

#if defined(__AVX512F__)
// v[k] holds 16 partial sums of key k's dot product; returns the 16 totals in key order.
// A tree of shuffles that reduces all 16 at once costs a third of 16 separate horizontal
// reductions, which were most of the work of scoring.
inline __m512 sum_each16(const __m512* v) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) {  // [key 2i: 8 partials, key 2i+1: 8 partials]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane l: key 4i + l, 4 partials
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // lane l: keys 8i + l and 8i + 4 + l, 2 partials each
    const __m512d a = _mm512_castps_pd(quarters[2 * i]), b = _mm512_castps_pd(quarters[2 * i + 1]);
    eighths[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // lane l: keys l, 4 + l, 8 + l, 12 + l
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// The partition's scores and weighted values with head_dim = 16 * C known at compile time,
// so that a row lives in C registers. Each key or value row is loaded (and widened) once
// for all the query heads of the group, `H` heads at a time. rows: `count` rows of C * 16;
// q: [group, C * 16] float32; scores: [group, count]; acc: [group, C * 16].
// Rows are read where they lie in the cache; the blocks are scattered, so the hardware
// prefetcher cannot guess the next one: each row is asked for kAhead rows before its use.
constexpr int64_t kAhead = 16;

template <int C, typename T, int kLocality = 3>
inline void prefetch_row(const T* row) {
  constexpr int kBytes = C * 16 * static_cast<int>(sizeof(T));
  for (int byte = 0; byte < kBytes; byte += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + byte, 0, kLocality);
}

// value_offset (bytes from a key row to its value row), when not 0: the value rows are
// asked for too, into L2, so that both streams are in flight during the scoring.
template <int C, int H, typename T>
void score_heads(const float* q, const T* const* rows, int64_t count, int64_t count_stride, float* scores,
                 std::ptrdiff_t value_offset) {
  __m512 qh[H][C];
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c) qh[h][c] = _mm512_loadu_ps(q + h * C * 16 + c * 16);
  }
  alignas(64) __m512 dots[H][16];
  int64_t t = 0;
  for (; t + 16 <= count; t += 16) {
    for (int k = 0; k < 16; ++k) {
      const T* ahead = rows[std::min(t + k + kAhead, count - 1)];
      prefetch_row<C>(ahead);
      if (value_offset != 0) {
        prefetch_row<C, T, 2>(reinterpret_cast<const T*>(reinterpret_cast<std::intptr_t>(ahead) + value_offset));
      }
      const T* row = rows[t + k];
      __m512 r[C];
      for (int c = 0; c < C; ++c) r[c] = load16(row + c * 16);
      for (int h = 0; h < H; ++h) {
        __m512 dot = _mm512_mul_ps(qh[h][0], r[0]);
        for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(qh[h][c], r[c], dot);
        dots[h][k] = dot;
      }
    }
    for (int h = 0; h < H; ++h) _mm512_storeu_ps(scores + h * count_stride + t, sum_each16(dots[h]));
  }
  for (; t < count; ++t) {
    const T* row = rows[t];
    for (int h = 0; h < H; ++h) {
      __m512 dot = _mm512_mul_ps(qh[h][0], load16(row));
      for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(qh[h][c], load16(row + c * 16), dot);
      scores[h * count_stride + t] = _mm512_reduce_add_ps(dot);
    }
  }
}

template <int C, int H, typename T>
void accumulate_heads(const float* weights, const T* const* rows, int64_t count, int64_t count_stride, float* acc) {
  __m512 sum[H][C];
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c) sum[h][c] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < count; ++t) {
    prefetch_row<C>(rows[std::min(t + kAhead, count - 1)]);
    const T* row = rows[t];
    __m512 r[C];
    for (int c = 0; c < C; ++c) r[c] = load16(row + c * 16);
    for (int h = 0; h < H; ++h) {
      const __m512 weight = _mm512_set1_ps(weights[h * count_stride + t]);
      for (int c = 0; c < C; ++c) sum[h][c] = _mm512_fmadd_ps(weight, r[c], sum[h][c]);
    }
  }
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + h * C * 16 + c * 16, sum[h][c]);
  }
}

// The group's heads in chunks whose accumulators stay in registers: 4 heads (2 at head
// size 128) a chunk, and the rest as one chunk (a group of 3, as SmolLM2's, is one pass over
// the rows, not three). Only the first chunk asks for the value rows.
template <int C, typename Run>
void by_head_chunks(int64_t group, const Run& run) {
  constexpr int kHeads = C <= 4 ? 4 : 2;
  for (int64_t h = 0; h < group;) {
    const int64_t heads = std::min<int64_t>(kHeads, group - h);
    if (heads == 4) run(h, std::integral_constant<int, 4>{});
    if (heads == 3) run(h, std::integral_constant<int, 3>{});
    if (heads == 2) run(h, std::integral_constant<int, 2>{});
    if (heads == 1) run(h, std::integral_constant<int, 1>{});
    h += heads;
  }
}

template <int C, typename T>
void score_rows(const float* q, const T* const* rows, int64_t count, int64_t group, float* scores,
                std::ptrdiff_t value_offset) {
  by_head_chunks<C>(group, [&](int64_t h, auto heads) {
    score_heads<C, decltype(heads)::value>(q + h * C * 16, rows, count, count, scores + h * count,
                                           h == 0 ? value_offset : 0);
  });
}

template <int C, typename T>
void accumulate_rows(const float* weights, const T* const* rows, int64_t count, int64_t group, float* acc) {
  by_head_chunks<C>(group, [&](int64_t h, auto heads) {
    accumulate_heads<C, decltype(heads)::value>(weights + h * count, rows, count, count, acc + h * C * 16);
  });
}
#endif

// Any head size: scores[j * count + t] = q_j . row_t.
template <typename T>
void score_rows_any(const float* q, const T* const* rows, int64_t count, int64_t group, int64_t head_dim,
                    float* buffer, float* scores) {
  for (int64_t t = 0; t < count; ++t) {
    load_row(rows[t], buffer, head_dim);
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q + j * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qj[d] * buffer[d];
      scores[j * count + t] = dot;
    }
  }
}

// Any head size: acc[j] = sum_t weights[j * count + t] * row_t.
template <typename T>
void accumulate_rows_any(const float* weights, const T* const* rows, int64_t count, int64_t group, int64_t head_dim,
                         float* buffer, float* acc) {
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t t = 0; t < count; ++t) {
    load_row(rows[t], buffer, head_dim);
    for (int64_t j = 0; j < group; ++j) {
      const float weight = weights[j * count + t];
      float* out = acc + j * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) out[d] += weight * buffer[d];
    }
  }
}

// One item: query heads [kv_head * group, (kv_head + 1) * group) of sequence `seq` over
// tokens [begin, end). Writes the partition's max, sum and unnormalised output (float32).
template <typename T>
void attend_partition(const T* query, const T* key_cache, const T* value_cache, const int32_t* table,
                      const Geometry& g, int64_t seq, int64_t kv_head, int64_t begin, int64_t end, float scale,
                      float* scores, float* row, float* q, float* max_out, float* sum_out, float* acc, int64_t* rows,
                      const T** pointers) {
  const int64_t group = g.group, head_dim = g.head_dim, count = end - begin, block_size = g.block_size;
  for (int64_t j = 0; j < group; ++j) {
    const T* source = query + seq * g.query_stride_token + (kv_head * group + j) * g.query_stride_head;
    load_row(source, q + j * head_dim, head_dim);
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) q[j * head_dim + d] *= scale;
  }
  // Where each of the partition's tokens lies in the key cache (the value cache has the same
  // strides); read in place, no copy.
  for (int64_t b = begin / block_size, t = begin; t < end; ++b) {
    const int64_t block = table[b] * g.cache_stride_block + kv_head * g.cache_stride_head - b * block_size * g.cache_stride_token;
    for (const int64_t stop = std::min(end, (b + 1) * block_size); t < stop; ++t) rows[t - begin] = block + t * g.cache_stride_token;
  }
  const auto row_pointers = [&](const T* cache) {
    for (int64_t t = 0; t < count; ++t) pointers[t] = cache + rows[t];
  };
  row_pointers(key_cache);
#if defined(__AVX512F__)
  // The caches share strides: a token's value row lies this many bytes from its key row.
  const std::ptrdiff_t value_offset = reinterpret_cast<std::intptr_t>(value_cache) - reinterpret_cast<std::intptr_t>(key_cache);
  if (head_dim == 64) {
    score_rows<4>(q, pointers, count, group, scores, value_offset);
  } else if (head_dim == 128) {
    score_rows<8>(q, pointers, count, group, scores, value_offset);
  } else
#endif
    score_rows_any(q, pointers, count, group, head_dim, row, scores);
  for (int64_t j = 0; j < group; ++j) softmax_unnormalised(scores + j * count, count, max_out + j, sum_out + j);
  row_pointers(value_cache);
#if defined(__AVX512F__)
  if (head_dim == 64) {
    accumulate_rows<4>(scores, pointers, count, group, acc);
  } else if (head_dim == 128) {
    accumulate_rows<8>(scores, pointers, count, group, acc);
  } else
#endif
    accumulate_rows_any(scores, pointers, count, group, head_dim, row, acc);
}

template <typename T>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t sliding_window) {
  const int64_t num_seqs = query.size(0);
  const Geometry g(query, key_cache, block_tables);

  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lengths = context_lens.data_ptr<int32_t>();
  // Each sequence's visible range [first, length) and where its partitions start in the
  // flat list of items (one list per kv head: item = (seq, partition)).
  std::vector<int64_t> first(num_seqs), part_offset(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t length = lengths[s];
    first[s] = sliding_window > 0 ? std::max<int64_t>(0, length - sliding_window) : 0;
    const int64_t visible = std::max<int64_t>(length - first[s], 0);
    part_offset[s + 1] = part_offset[s] + std::max<int64_t>(1, (visible + kPartition - 1) / kPartition);
  }
  const int64_t parts_per_head = part_offset[num_seqs];
  const int64_t num_items = parts_per_head * g.num_kv_heads;
  // Partials: [kv head, item, group] max and sum, [kv head, item, group, D] output.
  std::vector<float> maxima(num_items * g.group), sums(num_items * g.group), partial(num_items * g.group * g.head_dim);

  const T* q_data = query.data_ptr<T>();
  const T* k_data = key_cache.data_ptr<T>();
  const T* v_data = value_cache.data_ptr<T>();
  const float scale_f = static_cast<float>(scale);

  struct Item {
    int64_t seq, kv_head, begin, end;
  };
  const auto locate = [&](int64_t item) {
    const int64_t kv_head = item / parts_per_head, index = item % parts_per_head;
    const int64_t seq = std::upper_bound(part_offset.begin(), part_offset.end(), index) - part_offset.begin() - 1;
    const int64_t begin = first[seq] + (index - part_offset[seq]) * kPartition;
    return Item{seq, kv_head, begin, std::min<int64_t>(begin + kPartition, lengths[seq])};
  };

  at::parallel_for(0, num_items, 1, [&](int64_t start, int64_t stop) {
    std::vector<float> scores(g.group * kPartition), row(g.head_dim), q(g.group * g.head_dim);
    std::vector<int64_t> rows(kPartition);
    std::vector<const T*> pointers(kPartition);
    for (int64_t item = start; item < stop; ++item) {
      const Item it = locate(item);
      float* max_out = maxima.data() + item * g.group;
      float* sum_out = sums.data() + item * g.group;
      float* acc = partial.data() + item * g.group * g.head_dim;
      if (it.end <= it.begin) {  // an empty context: attention is all zeros
        std::fill(max_out, max_out + g.group, -std::numeric_limits<float>::infinity());
        std::fill(sum_out, sum_out + g.group, 0.f);
        std::fill(acc, acc + g.group * g.head_dim, 0.f);
        continue;
      }
      attend_partition<T>(q_data, k_data, v_data, tables + it.seq * g.max_blocks, g, it.seq, it.kv_head, it.begin,
                          it.end, scale_f, scores.data(), row.data(), q.data(), max_out, sum_out, acc, rows.data(),
                          pointers.data());
    }
  });

  T* out_data = out.data_ptr<T>();
  const int64_t out_stride_token = out.stride(0), out_stride_head = out.stride(1);
  at::parallel_for(0, num_seqs * g.num_kv_heads, 16, [&](int64_t start, int64_t stop) {
    std::vector<float> combined(g.head_dim);
    for (int64_t pair = start; pair < stop; ++pair) {
      const int64_t seq = pair / g.num_kv_heads, kv_head = pair % g.num_kv_heads;
      const int64_t items_begin = kv_head * parts_per_head + part_offset[seq];
      const int64_t items_end = kv_head * parts_per_head + part_offset[seq + 1];
      for (int64_t j = 0; j < g.group; ++j) {
        float maximum = -std::numeric_limits<float>::infinity();
        for (int64_t item = items_begin; item < items_end; ++item) maximum = std::max(maximum, maxima[item * g.group + j]);
        std::fill(combined.begin(), combined.end(), 0.f);
        float total = 0.f;
        for (int64_t item = items_begin; item < items_end; ++item) {
          const float sum = sums[item * g.group + j];
          if (sum == 0.f) continue;
          const float weight = std::exp(maxima[item * g.group + j] - maximum);
          total += weight * sum;
          const float* acc = partial.data() + (item * g.group + j) * g.head_dim;
#pragma omp simd
          for (int64_t d = 0; d < g.head_dim; ++d) combined[d] += weight * acc[d];
        }
        const float inverse = total > 0.f ? 1.f / total : 0.f;
        T* destination = out_data + seq * out_stride_token + (kv_head * g.group + j) * out_stride_head;
        for (int64_t d = 0; d < g.head_dim; ++d) narrow(combined[d] * inverse, destination + d);
      }
    }
  });
}

at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t sliding_window) {
  check_paged_args(query, key_cache, value_cache, {block_tables, context_lens});
  const at::Tensor tables = block_tables.contiguous(), lengths = context_lens.contiguous();
  at::Tensor out = at::empty_like(query, query.options().memory_format(at::MemoryFormat::Contiguous));
  if (query.size(0) == 0) return out;
  switch (query.scalar_type()) {
    case at::kFloat:
      decode<float>(out, query, key_cache, value_cache, tables, lengths, scale, sliding_window);
      break;
    case at::kBFloat16:
      decode<c10::BFloat16>(out, query, key_cache, value_cache, tables, lengths, scale, sliding_window);
      break;
    default:
      TORCH_CHECK(false, "float32 or bfloat16 only, got ", query.scalar_type());
  }
  return out;
}

// Writes each new token's keys and values into its cache slot (block * block_size + offset;
// a negative slot skips the token): one call for both caches, where the torch path needs a
// mask, a sync and an index_copy_ per cache on every layer of every step.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  check_paged_args(key, key_cache, value_cache, {});
  TORCH_CHECK(value.sizes() == key.sizes() && value.stride(2) == 1 && value.scalar_type() == key.scalar_type(),
              "value must have the key's shape and dtype, head_dim contiguous");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3), "key [T, KVH, D] must fit the cache");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), "slot_mapping [T]");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), block_size = key_cache.size(1);
  const int64_t num_slots = key_cache.size(0) * block_size;
  for (int64_t t = 0; t < num_tokens; ++t) TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " is past the cache");
  const int64_t row_bytes = key.size(2) * key.element_size();
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t e = key.element_size();
  at::parallel_for(0, num_tokens, 256, [&](int64_t start, int64_t stop) {
    for (int64_t t = start; t < stop; ++t) {
      if (slot[t] < 0) continue;
      const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
      const int64_t target = block * key_cache.stride(0) + offset * key_cache.stride(1);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t to = (target + h * key_cache.stride(2)) * e;
        std::memcpy(kc + to, k + (t * key.stride(0) + h * key.stride(1)) * e, row_bytes);
        std::memcpy(vc + to, v + (t * value.stride(0) + h * value.stride(1)) * e, row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(pagefleet, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int sliding_window) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagefleet, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
