// One Llama-family decoder layer of a decode-only CPU step in one call: input RMSNorm (with the
// residual add), the QKV projection, rotary on q and k, the KV write into the paged cache, paged
// decode attention, o_proj, the post-attention RMSNorm (residual add), gate/up with SiLU-mul, and
// down. A decode step at batch 1 is ~10 ops a layer of a few microseconds of work each, and from
// Python each costs its dispatch on top (torch.ops, module calls, views): here they are plain C++
// calls of the same functions the unfused path dispatches to (fused_ops.cpp,
// quantized_gemv.cpp, paged_attention.cpp), in the same order on the same tensors, so every row
// gets the unfused path's bits, and so the same bits in any batch.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>

// The other sources of this library (one shared object: these resolve at link time).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor decode_attention(at::Tensor q, at::Tensor kv_layer, at::Tensor block_tables, at::Tensor context_lens, double scale, int64_t window);
at::Tensor q4_gemv(const at::Tensor& x, const at::Tensor& blocks);
at::Tensor q4_gemv_silu_mul(const at::Tensor& x, const at::Tensor& blocks);
at::Tensor q8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);

namespace {

// A quantized weight: q4 blocks (scales empty), or int8 q with per-block float32 scales.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  return scales.numel() == 0 ? q4_gemv(x, weight) : q8_gemv(x, weight, scales);
}

// silu(gate) * up of a fused [gate; up] weight: the q4 kernel's own, else torch's ops as the
// unfused path calls them (F.silu and a multiply over the product's two halves).
at::Tensor gated(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  if (scales.numel() == 0) return q4_gemv_silu_mul(x, weight);
  const auto halves = q8_gemv(x, weight, scales).chunk(2, -1);
  return at::silu(halves[0]) * halves[1];
}

// k, v [T, KVH, D] (heads and elements contiguous) into their slots of kv_layer [2, KVH, blocks, bs, D].
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_layer, const at::Tensor& slots) {
  TORCH_CHECK(kv_layer.is_contiguous() && kv_layer.scalar_type() == at::kFloat, "kv_layer must be contiguous float32");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0), "slot_mapping must be [T] int64");
  const int64_t rows = k.size(0), kv_heads = k.size(1), dim = k.size(2);
  const int64_t head_slots = kv_layer.size(2) * kv_layer.size(3);  // slots of one KV head
  const int64_t* sp = slots.contiguous().data_ptr<int64_t>();
  float* keys = kv_layer.data_ptr<float>();
  float* values = keys + kv_heads * head_slots * dim;
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < head_slots, "slot ", sp[t], " is outside the cache");
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t at = (h * head_slots + sp[t]) * dim;
      std::memcpy(keys + at, k.data_ptr<float>() + t * k.stride(0) + h * k.stride(1), dim * sizeof(float));
      std::memcpy(values + at, v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1), dim * sizeof(float));
    }
  }
}

}  // namespace

// x, residual: [T, hidden] float32 (residual absent at the first layer); norms' scales [hidden];
// weights as above (`*_scales` empty for q4 blocks); cos, sin [T, 1, D]; the decode batch's
// kv_layer, slot_mapping, block_tables, context_lens as decode_attention and KVCache.write take
// them. Returns (the MLP's output, the residual), as LlamaDecoderLayer.forward.
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& input_norm, const at::Tensor& post_norm,
    double eps, const at::Tensor& qkv, const at::Tensor& qkv_scales, const at::Tensor& o, const at::Tensor& o_scales,
    const at::Tensor& gate_up, const at::Tensor& gate_up_scales, const at::Tensor& down, const at::Tensor& down_scales,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_layer, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double scale,
    int64_t window) {
  const int64_t rows = x.size(0);
  const int64_t head_dim = kv_layer.size(4);
  auto [normed, summed] = rms_norm(x, residual, input_norm, eps);
  const at::Tensor heads = project(normed, qkv, qkv_scales).view({rows, num_heads + 2 * num_kv_heads, head_dim});
  const at::Tensor rotated = rotary(heads.narrow(1, 0, num_heads + num_kv_heads), cos, sin);
  write_kv(rotated.narrow(1, num_heads, num_kv_heads), heads.narrow(1, num_heads + num_kv_heads, num_kv_heads), kv_layer, slot_mapping);
  const at::Tensor attended = decode_attention(rotated.narrow(1, 0, num_heads), kv_layer, block_tables, context_lens, scale, window);
  const at::Tensor projected = project(attended.view({rows, num_heads * head_dim}), o, o_scales);
  auto [mlp_in, mlp_residual] = rms_norm(projected, summed, post_norm, eps);
  return {project(gated(mlp_in, gate_up, gate_up_scales), down, down_scales), mlp_residual};
}

TORCH_LIBRARY_FRAGMENT(disagg_cpu, m) {
  m.def(
      "decode_layer(Tensor x, Tensor? residual, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv, Tensor qkv_scales, "
      "Tensor o, Tensor o_scales, Tensor gate_up, Tensor gate_up_scales, Tensor down, Tensor down_scales, Tensor cos, "
      "Tensor sin, Tensor(a!) kv_layer, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int num_heads, "
      "int num_kv_heads, float scale, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(disagg_cpu, CPU, m) { m.impl("decode_layer", &decode_layer); }
