// Copy KV blocks from one cache (slice) to another by block id, one memcpy per (layer, K/V, head,
// block): the KV transfer's import from a sender's shared cache on the same host. In torch this
// is a gather then a scatter (two copies) or one strided copy per block (a Python loop); here it
// is one pass over the bytes.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

// src, dst: [n, 2, heads, blocks, block_size, head_dim] slices whose last two dims are
// contiguous (any cache's layer and head slice is). src_ids, dst_ids: int64 [k]: dst's block
// dst_ids[i] = src's block src_ids[i].
void copy_blocks(const at::Tensor& src, const at::Tensor& src_ids, const at::Tensor& dst, const at::Tensor& dst_ids) {
  TORCH_CHECK(src.device().is_cpu() && dst.device().is_cpu(), "copy_blocks: CPU tensors only");
  TORCH_CHECK(src.dim() == 6 && dst.dim() == 6, "copy_blocks: expected 6-D [n, 2, heads, blocks, block_size, head_dim] tensors");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "copy_blocks: dtypes differ");
  for (int d : {0, 1, 2, 4, 5}) TORCH_CHECK(src.size(d) == dst.size(d), "copy_blocks: shapes differ in dim ", d);
  const int64_t bs = src.size(4), hd = src.size(5);
  for (const at::Tensor* t : {&src, &dst}) {
    TORCH_CHECK(t->stride(5) == 1 && t->stride(4) == hd, "copy_blocks: a block's [block_size, head_dim] must be contiguous");
  }
  TORCH_CHECK(src_ids.scalar_type() == at::kLong && dst_ids.scalar_type() == at::kLong && src_ids.is_contiguous() && dst_ids.is_contiguous(), "copy_blocks: block ids must be contiguous int64");
  const int64_t k = src_ids.numel();
  TORCH_CHECK(dst_ids.numel() == k, "copy_blocks: ", k, " source blocks for ", dst_ids.numel(), " destination blocks");
  const int64_t* si = src_ids.data_ptr<int64_t>();
  const int64_t* di = dst_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(si[i] >= 0 && si[i] < src.size(3) && di[i] >= 0 && di[i] < dst.size(3), "copy_blocks: block id out of range");
  }
  const int64_t item = src.element_size();
  const size_t block_bytes = static_cast<size_t>(bs * hd * item);
  const char* s0 = static_cast<const char*>(src.data_ptr());
  char* d0 = static_cast<char*>(dst.data_ptr());
  for (int64_t a = 0; a < src.size(0); ++a) {
    for (int64_t b = 0; b < src.size(1); ++b) {
      for (int64_t h = 0; h < src.size(2); ++h) {
        const char* s = s0 + (a * src.stride(0) + b * src.stride(1) + h * src.stride(2)) * item;
        char* d = d0 + (a * dst.stride(0) + b * dst.stride(1) + h * dst.stride(2)) * item;
        for (int64_t i = 0; i < k; ++i) {
          std::memcpy(d + di[i] * dst.stride(3) * item, s + si[i] * src.stride(3) * item, block_bytes);
        }
      }
    }
  }
}

TORCH_LIBRARY_FRAGMENT(disagg_cpu, m) { m.def("copy_blocks(Tensor src, Tensor src_ids, Tensor(a!) dst, Tensor dst_ids) -> ()"); }

TORCH_LIBRARY_IMPL(disagg_cpu, CPU, m) { m.impl("copy_blocks", &copy_blocks); }
