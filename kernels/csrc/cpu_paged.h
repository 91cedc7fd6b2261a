// What the paged attention operators share: the checks of their arguments and the shape
// of the query and the caches, read once from the tensors.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>

namespace pagefleet {

// query [T, H, D] and caches [N, B, KVH, D] (any strides, head_dim contiguous) of one
// dtype on the CPU; index tensors int32.
inline void check_paged_args(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             std::initializer_list<at::Tensor> indices) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "query [T, H, D], caches [N, B, KVH, D]");
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(key_cache.strides() == value_cache.strides() && key_cache.sizes() == value_cache.sizes(),
              "key and value caches must share shape and strides");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "query and caches must share a dtype");
  for (const at::Tensor& index : indices) {
    TORCH_CHECK(index.scalar_type() == at::kInt, "block tables, lengths and offsets are int32");
  }
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of kv heads");
}

struct PagedGeometry {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t query_stride_token, query_stride_head;
  int64_t cache_stride_block, cache_stride_token, cache_stride_head;

  PagedGeometry(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& block_tables)
      : num_heads(query.size(1)),
        num_kv_heads(key_cache.size(2)),
        group(query.size(1) / key_cache.size(2)),
        head_dim(query.size(2)),
        block_size(key_cache.size(1)),
        max_blocks(block_tables.size(1)),
        query_stride_token(query.stride(0)),
        query_stride_head(query.stride(1)),
        cache_stride_block(key_cache.stride(0)),
        cache_stride_token(key_cache.stride(1)),
        cache_stride_head(key_cache.stride(2)) {}
};

}  // namespace pagefleet
