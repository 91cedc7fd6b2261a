// Paged prefill attention for CPUs: each sequence's chunk of new query tokens attends
// causally to its whole context (cached prefix + the chunk itself), read in place from the
// paged KV cache through the sequence's block table, so chunked prefill and prefix-cache
// hits need no gather.
//
//   query: [T, H, D], the chunks of all sequences back to back (cu_seqlens: [S + 1])
//   cache (any strides, head_dim contiguous): [num_blocks, block_size, num_kv_heads, D]
//   query i of a chunk of n sits at position context_len - n + i and sees keys 0..that
//   position (the last `sliding_window` of them, when set)
//
// Work items are (sequence, kv head, tile of query tokens). A tile holds the rows of every
// query head of the kv head's group (about 48 rows), and everything is computed with the
// rows across the vector lanes: queries transposed to [D][rows], scores as [key][rows],
// output as [D][rows]. Keys and values are then scalars broadcast against row vectors, so
// neither needs a transposition, and the online softmax (max, exponentials, sums) is
// elementwise over rows, with no horizontal reduction at all. Torch's flash attention for
// CPUs reaches about 65 GFLOPS on these shapes here; see docs/kernels.md for this one.
//
// AVX-512 only: other builds register the operator but refuse to run it, and the engine
// asks `pagefleet.kernels.cpu_ops.has_prefill()` before it uses it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_paged.h"
#include "cpu_vec.h"

namespace {

using namespace pagefleet;

#if defined(__AVX512F__)

constexpr int64_t kRowsPerTile = 48;  // query rows (token, head) per item: 3 vectors of 16
constexpr int64_t kKeysPerTile = 64;  // keys per inner step
constexpr int kKeysPerKernel = 8;     // score kernel: 8 keys x up to 3 row vectors = 24 accumulators
constexpr int kDimsPerKernel = 8;     // output kernel: 8 dims x up to 3 row vectors

struct Geometry : PagedGeometry {
  int64_t out_stride_token, out_stride_head;
  int64_t tokens_per_tile, rows;  // rows: tokens_per_tile * group padded to 16

  Geometry(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& block_tables, const at::Tensor& out)
      : PagedGeometry(query, key_cache, block_tables),
        out_stride_token(out.stride(0)),
        out_stride_head(out.stride(1)),
        tokens_per_tile(std::max<int64_t>(1, kRowsPerTile / group)),
        rows((tokens_per_tile * group + 15) / 16 * 16) {}
};

struct Item {
  int64_t seq, kv_head, first_token, num_tokens;  // tokens: indices into the sequence's chunk
};

// scores[k][rows] = keys[k] . queries[:, rows] for the keys of one kernel call.
// queries: [D][rows_stride] float32 (scaled); keys: kKeysPerKernel rows of D float32.
template <int NR>
inline void score_kernel(const float* queries, int64_t rows_stride, const float* keys, int64_t head_dim, float* scores) {
  __m512 acc[kKeysPerKernel][NR];
  for (int k = 0; k < kKeysPerKernel; ++k) {
    for (int v = 0; v < NR; ++v) acc[k][v] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < head_dim; ++d) {
    __m512 q[NR];
    for (int v = 0; v < NR; ++v) q[v] = _mm512_loadu_ps(queries + d * rows_stride + v * 16);
    for (int k = 0; k < kKeysPerKernel; ++k) {
      const __m512 key = _mm512_set1_ps(keys[k * head_dim + d]);
      for (int v = 0; v < NR; ++v) acc[k][v] = _mm512_fmadd_ps(key, q[v], acc[k][v]);
    }
  }
  for (int k = 0; k < kKeysPerKernel; ++k) {
    for (int v = 0; v < NR; ++v) _mm512_storeu_ps(scores + k * rows_stride + v * 16, acc[k][v]);
  }
}

// out[dims][rows] += sum_k values[k][dims] * probs[k][rows] for kDimsPerKernel dims.
template <int NR>
inline void value_kernel(const float* probs, int64_t rows_stride, const float* values, int64_t head_dim,
                         int64_t num_keys, float* out) {
  __m512 acc[kDimsPerKernel][NR];
  for (int d = 0; d < kDimsPerKernel; ++d) {
    for (int v = 0; v < NR; ++v) acc[d][v] = _mm512_loadu_ps(out + d * rows_stride + v * 16);
  }
  for (int64_t k = 0; k < num_keys; ++k) {
    __m512 p[NR];
    for (int v = 0; v < NR; ++v) p[v] = _mm512_loadu_ps(probs + k * rows_stride + v * 16);
    for (int d = 0; d < kDimsPerKernel; ++d) {
      const __m512 value = _mm512_set1_ps(values[k * head_dim + d]);
      for (int v = 0; v < NR; ++v) acc[d][v] = _mm512_fmadd_ps(value, p[v], acc[d][v]);
    }
  }
  for (int d = 0; d < kDimsPerKernel; ++d) {
    for (int v = 0; v < NR; ++v) _mm512_storeu_ps(out + d * rows_stride + v * 16, acc[d][v]);
  }
}

// Row vectors [from, from + NR) of every kernel call; the rest in chunks of up to three.
template <typename F>
inline void over_row_chunks(int64_t row_vectors, F&& body) {
  for (int64_t v = 0; v < row_vectors; v += 3) {
    switch (std::min<int64_t>(3, row_vectors - v)) {
      case 3:
        body(v, std::integral_constant<int, 3>{});
        break;
      case 2:
        body(v, std::integral_constant<int, 2>{});
        break;
      default:
        body(v, std::integral_constant<int, 1>{});
    }
  }
}

struct Workspace {
  std::vector<float> queries, scores, out, keys, values, maxima, sums, positions;
  explicit Workspace(const Geometry& g)
      : queries(g.head_dim * g.rows),
        scores(kKeysPerTile * g.rows),
        out(g.head_dim * g.rows),
        keys(kKeysPerTile * g.head_dim),
        values(kKeysPerTile * g.head_dim),
        maxima(g.rows),
        sums(g.rows),
        positions(g.rows) {}
};

// Copies keys [first, first + count) of one kv head out of the paged cache as float32 rows.
template <typename T>
void load_keys(const T* cache, const int32_t* table, const Geometry& g, int64_t kv_head, int64_t first, int64_t count,
               float* target) {
  const int64_t end = first + count;
  for (int64_t b = first / g.block_size, t = first; t < end; ++b) {
    const T* block = cache + table[b] * g.cache_stride_block + kv_head * g.cache_stride_head;
    for (const int64_t stop = std::min(end, (b + 1) * g.block_size); t < stop; ++t) {
      const T* row = block + (t - b * g.block_size) * g.cache_stride_token;
      float* out = target + (t - first) * g.head_dim;
      int64_t d = 0;
      for (; d + 16 <= g.head_dim; d += 16) _mm512_storeu_ps(out + d, load16(row + d));
      for (; d < g.head_dim; ++d) out[d] = widen(row[d]);
    }
  }
  std::fill(target + count * g.head_dim, target + kKeysPerTile * g.head_dim, 0.f);
}

template <typename T>
void attend_item(const T* query, const T* key_cache, const T* value_cache, const int32_t* table, const Geometry& g,
                 const Item& item, int64_t query_start, int64_t chunk_len, int64_t context_len, int64_t window,
                 float scale, Workspace& w, T* out_data) {
  const int64_t rows = g.rows, head_dim = g.head_dim, group = g.group;
  const int64_t real_rows = item.num_tokens * group;
  // Only the row vectors holding real rows are computed: a short chunk (a decoding
  // sequence's drafts, the last tokens of a prompt) costs one vector, not a whole tile.
  const int64_t row_vectors = (real_rows + 15) / 16;
  const int64_t prefix = context_len - chunk_len;
  // Row r is query head kv_head * group + r % group of token first_token + r / group.
  float* queries = w.queries.data();
  std::fill(w.queries.begin(), w.queries.end(), 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = item.first_token + std::min(r, real_rows - 1) / group;
    w.positions[r] = static_cast<float>(prefix + token);
    if (r >= real_rows) continue;
    const T* source = query + (query_start + token) * g.query_stride_token +
                      (item.kv_head * group + r % group) * g.query_stride_head;
    for (int64_t d = 0; d < head_dim; ++d) queries[d * rows + r] = widen(source[d]) * scale;
  }
  std::fill(w.out.begin(), w.out.end(), 0.f);
  std::fill(w.maxima.begin(), w.maxima.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.sums.begin(), w.sums.end(), 0.f);

  const int64_t first_position = prefix + item.first_token;
  const int64_t last_position = first_position + item.num_tokens - 1;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_position - window + 1) : 0;
  const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t tile = first_key; tile <= last_position; tile += kKeysPerTile) {
    const int64_t num_keys = std::min(kKeysPerTile, last_position + 1 - tile);
    load_keys(key_cache, table, g, item.kv_head, tile, num_keys, w.keys.data());
    for (int64_t k = 0; k < num_keys; k += kKeysPerKernel) {
      over_row_chunks(row_vectors, [&](int64_t v, auto nr) {
        score_kernel<decltype(nr)::value>(queries + v * 16, rows, w.keys.data() + k * head_dim, head_dim,
                                          w.scores.data() + k * rows + v * 16);
      });
    }
    // Masks: keys after a row's position (the causal edge) or before its window.
    const bool causal_edge = tile + num_keys - 1 > first_position;
    const bool window_edge = window > 0 && tile <= last_position - window;
    for (int64_t v = 0; v < row_vectors; ++v) {
      const __m512 position = _mm512_loadu_ps(w.positions.data() + v * 16);
      __m512 maximum = _mm512_loadu_ps(w.maxima.data() + v * 16);
      const __m512 previous = maximum;
      for (int64_t k = 0; k < num_keys; ++k) {
        float* s = w.scores.data() + k * rows + v * 16;
        __m512 score = _mm512_loadu_ps(s);
        const __m512 key_position = _mm512_set1_ps(static_cast<float>(tile + k));
        if (causal_edge) {
          score = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(key_position, position, _CMP_GT_OQ), score, minus_infinity);
        }
        if (window_edge) {
          const __m512 oldest = _mm512_sub_ps(position, _mm512_set1_ps(static_cast<float>(window - 1)));
          score = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(key_position, oldest, _CMP_LT_OQ), score, minus_infinity);
        }
        _mm512_storeu_ps(s, score);
        maximum = _mm512_max_ps(maximum, score);
      }
      // A row that has seen no key yet keeps -inf; shift by 0 then, so exp gives 0, not NaN.
      const __mmask16 seen = _mm512_cmp_ps_mask(maximum, minus_infinity, _CMP_NEQ_OQ);
      const __m512 shift = _mm512_maskz_mov_ps(seen, maximum);
      const __m512 rescale = exp16(_mm512_sub_ps(previous, shift));
      __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(w.sums.data() + v * 16), rescale);
      for (int64_t k = 0; k < num_keys; ++k) {
        float* s = w.scores.data() + k * rows + v * 16;
        const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s), shift));
        _mm512_storeu_ps(s, p);
        sum = _mm512_add_ps(sum, p);
      }
      _mm512_storeu_ps(w.sums.data() + v * 16, sum);
      _mm512_storeu_ps(w.maxima.data() + v * 16, maximum);
      for (int64_t d = 0; d < head_dim; ++d) {
        float* o = w.out.data() + d * rows + v * 16;
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), rescale));
      }
    }
    load_keys(value_cache, table, g, item.kv_head, tile, num_keys, w.values.data());
    for (int64_t d = 0; d < head_dim; d += kDimsPerKernel) {
      over_row_chunks(row_vectors, [&](int64_t v, auto nr) {
        value_kernel<decltype(nr)::value>(w.scores.data() + v * 16, rows, w.values.data() + d, head_dim, num_keys,
                                          w.out.data() + d * rows + v * 16);
      });
    }
  }
  for (int64_t r = 0; r < real_rows; ++r) {
    const int64_t token = item.first_token + r / group;
    T* target = out_data + (query_start + token) * g.out_stride_token + (item.kv_head * group + r % group) * g.out_stride_head;
    const float inverse = w.sums[r] > 0.f ? 1.f / w.sums[r] : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) narrow(w.out[d * rows + r] * inverse, target + d);
  }
}

template <typename T>
void prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
             const at::Tensor& block_tables, const at::Tensor& cu_seqlens, const at::Tensor& context_lens, double scale,
             int64_t sliding_window) {
  const Geometry g(query, key_cache, block_tables, out);

  const int32_t* starts = cu_seqlens.data_ptr<int32_t>();
  const int32_t* lengths = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_seqs = cu_seqlens.numel() - 1;
  // Items, and their cost (keys read) to split the work evenly over the threads: with a
  // causal mask the last tiles of a chunk cost more than its first.
  std::vector<Item> items;
  std::vector<int64_t> cost_before{0};
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t chunk = starts[s + 1] - starts[s], prefix = lengths[s] - chunk;
    for (int64_t h = 0; h < g.num_kv_heads; ++h) {
      for (int64_t t = 0; t < chunk; t += g.tokens_per_tile) {
        const Item item{s, h, t, std::min(g.tokens_per_tile, chunk - t)};
        const int64_t last = prefix + t + item.num_tokens;
        const int64_t keys = sliding_window > 0 ? std::min(last, sliding_window + item.num_tokens) : last;
        items.push_back(item);
        cost_before.push_back(cost_before.back() + keys + 64);
      }
    }
  }
  const T* q_data = query.data_ptr<T>();
  const T* k_data = key_cache.data_ptr<T>();
  const T* v_data = value_cache.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  const int64_t total = cost_before.back();
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    Workspace workspace(g);
    // Part p takes the items whose cost starts in [total * p / parts, total * (p + 1) / parts).
    const auto first_item = [&](int64_t part) {
      return std::lower_bound(cost_before.begin(), cost_before.end() - 1, total * part / parts) - cost_before.begin();
    };
    for (int64_t i = first_item(begin), stop = first_item(end); i < stop; ++i) {
      const Item& item = items[i];
      const int64_t start = starts[item.seq], chunk = starts[item.seq + 1] - start;
      attend_item(q_data, k_data, v_data, tables + item.seq * g.max_blocks, g, item, start, chunk, lengths[item.seq],
                  sliding_window, static_cast<float>(scale), workspace, out_data);
    }
  });
}

#endif  // __AVX512F__

at::Tensor paged_attention_prefill(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& block_tables, const at::Tensor& cu_seqlens,
                                   const at::Tensor& context_lens, double scale, int64_t sliding_window) {
#if defined(__AVX512F__)
  check_paged_args(query, key_cache, value_cache, {block_tables, cu_seqlens, context_lens});
  TORCH_CHECK(query.size(2) % 8 == 0, "head_dim must be a multiple of 8");
  const at::Tensor tables = block_tables.contiguous(), starts = cu_seqlens.contiguous(), lengths = context_lens.contiguous();
  at::Tensor out = at::empty_like(query, query.options().memory_format(at::MemoryFormat::Contiguous));
  if (query.size(0) == 0 || starts.numel() < 2) return out;
  switch (query.scalar_type()) {
    case at::kFloat:
      prefill<float>(out, query, key_cache, value_cache, tables, starts, lengths, scale, sliding_window);
      break;
    case at::kBFloat16:
      prefill<c10::BFloat16>(out, query, key_cache, value_cache, tables, starts, lengths, scale, sliding_window);
      break;
    default:
      TORCH_CHECK(false, "float32 or bfloat16 only, got ", query.scalar_type());
  }
  return out;
#else
  TORCH_CHECK(false, "paged_attention_prefill is built for AVX-512 CPUs only");
#endif
}

bool has_prefill() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagefleet, m) {
  m.def(
      "paged_attention_prefill(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor cu_seqlens, Tensor context_lens, float scale, int sliding_window) -> Tensor");
  m.def("has_prefill() -> bool", &has_prefill);
}

TORCH_LIBRARY_IMPL(pagefleet, CPU, m) { m.impl("paged_attention_prefill", &paged_attention_prefill); }
