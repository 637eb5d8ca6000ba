// Decode attention over the paged, head-major KV cache, for CPU.
//
// One query token per request. K and V are read in place: block `b` of KV head `h` is the
// contiguous [block_size, head_dim] matrix kv[0 or 1][h][b], so nothing is gathered or copied.
// The query heads that share a KV head are computed together (grouped-query attention), so each
// K/V row is loaded once per group. Softmax is online, block by block, in float32 whatever the
// cache holds (float32 or bfloat16). Work items are (request, KV head) pairs, longest first,
// handed out to the threads one by one (contexts differ a lot within a batch).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace {

inline float to_float(float x) { return x; }

inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// exp(x) for x <= 0, vectorizable (no libm call): 2^(x*log2e) split into an integer power of two
// and a degree-6 polynomial on [-0.5, 0.5]; relative error about 2e-7, exact 0 below -87.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  const float f = (t - n) * 0.693147180559945309f;  // f in [-0.35, 0.35]
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
inline void rows_to_float(const T* src, float* dst, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) dst[i] = to_float(src[i]);
}

// One (request, KV head): q [G, D] (already scaled) against `ctx_len` cached tokens.
// kD is the head dim when known at compile time (0: use `head_dim`).
template <typename T, int kD>
void attend_one(const float* q, const T* k_head, const T* v_head, const int32_t* table, int64_t ctx_len, int64_t group, int64_t head_dim_rt,
                int64_t block_size, float* out, std::vector<float>& scratch) {
  const int64_t D = kD > 0 ? kD : head_dim_rt;
  const int64_t block_elems = block_size * D;
  scratch.resize(2 * group * D + 2 * group + group * block_size + (std::is_same<T, float>::value ? 0 : 2 * block_elems));
  float* acc = scratch.data();             // [G, D]
  float* m = acc + group * D;              // [G] running max
  float* l = m + group;                    // [G] running sum of exp
  float* s = l + group;                    // [G, block_size] scores of one block
  float* kbuf = s + group * block_size;    // [block_size, D] block converted to float (bf16 only)
  float* vbuf = kbuf + block_elems;
  std::fill(acc, acc + group * D, 0.0f);
  std::fill(m, m + group, -std::numeric_limits<float>::infinity());
  std::fill(l, l + group, 0.0f);

  const int64_t num_blocks = (ctx_len + block_size - 1) / block_size;
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t n = std::min(block_size, ctx_len - blk * block_size);
    const int64_t offset = static_cast<int64_t>(table[blk]) * block_elems;
    const float* kb;
    const float* vb;
    if constexpr (std::is_same<T, float>::value) {
      kb = k_head + offset;
      vb = v_head + offset;
    } else {
      rows_to_float(k_head + offset, kbuf, n * D);
      rows_to_float(v_head + offset, vbuf, n * D);
      kb = kbuf;
      vb = vbuf;
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* krow = kb + t * D;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * krow[d];
        s[g * block_size + t] = dot;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* sg = s + g * block_size;
      float block_max = sg[0];
      for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, sg[t]);
      const float new_max = std::max(m[g], block_max);
      if (new_max > m[g]) {
        const float alpha = exp_nonpositive(m[g] - new_max);  // 0 on the first block (m = -inf clamps)
        l[g] *= alpha;
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
        m[g] = new_max;
      }
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = exp_nonpositive(sg[t] - new_max);
        sum += sg[t];
      }
      l[g] += sum;
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* vrow = vb + t * D;
      for (int64_t g = 0; g < group; ++g) {
        const float p = s[g * block_size + t];
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * vrow[d];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
  }
}

template <typename T, int kD>
void run(const torch::Tensor& q, const torch::Tensor& kv_layer, const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
         torch::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_layer.size(1), num_blocks = kv_layer.size(2), block_size = kv_layer.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t head_stride = num_blocks * block_size * head_dim;  // elements between KV heads
  const T* k_base = kv_layer.data_ptr<T>();
  const T* v_base = k_base + num_kv_heads * head_stride;
  const float* q_base = q.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  float* out_base = out.data_ptr<float>();

  // Longest requests first, then dynamic hand-out: the threads finish together.
  std::vector<int64_t> order(batch);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  const int64_t num_items = batch * num_kv_heads;
  const float fscale = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    std::vector<float> qbuf(group * head_dim);
    for (int64_t item = next.fetch_add(1); item < num_items; item = next.fetch_add(1)) {
      const int64_t r = order[item / num_kv_heads], h = item % num_kv_heads;
      const float* qsrc = q_base + (r * num_heads + h * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qbuf[i] = qsrc[i] * fscale;
      const int64_t ctx_len = std::min<int64_t>(lens[r], max_blocks * block_size);
      attend_one<T, kD>(qbuf.data(), k_base + h * head_stride, v_base + h * head_stride, tables + r * max_blocks, ctx_len, group, head_dim, block_size,
                        out_base + (r * num_heads + h * group) * head_dim, scratch);
    }
  });
}

template <typename T>
void dispatch_head_dim(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables, const torch::Tensor& lens, double scale, torch::Tensor& out) {
  switch (q.size(2)) {
    case 64: return run<T, 64>(q, kv, tables, lens, scale, out);
    case 128: return run<T, 128>(q, kv, tables, lens, scale, out);
    default: return run<T, 0>(q, kv, tables, lens, scale, out);
  }
}

}  // namespace

// q: [B, H, D] float32; kv_layer: [2, KVH, num_blocks, block_size, D] float32 or bfloat16;
// block_tables: [B, max_blocks] int32; context_lens: [B] int32 (tokens to attend, >= 1).
// Returns [B, H, D] float32.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_layer.device().is_cpu(), "paged decode attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [B, H, D] float32");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(0) == 2 && kv_layer.size(4) == q.size(2), "kv_layer must be [2, KVH, blocks, block_size, D]");
  TORCH_CHECK(kv_layer.is_contiguous(), "kv_layer must be contiguous");
  TORCH_CHECK(q.size(1) % kv_layer.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && block_tables.scalar_type() == torch::kInt32, "block_tables must be [B, max_blocks] int32");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == q.size(0) && context_lens.scalar_type() == torch::kInt32, "context_lens must be [B] int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  if (kv_layer.scalar_type() == torch::kFloat32) {
    dispatch_head_dim<float>(q, kv_layer, block_tables, context_lens, scale, out);
  } else if (kv_layer.scalar_type() == torch::kBFloat16) {
    dispatch_head_dim<at::BFloat16>(q, kv_layer, block_tables, context_lens, scale, out);
  } else {
    TORCH_CHECK(false, "paged decode attention: cache dtype must be float32 or bfloat16, got ", kv_layer.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "Paged decode attention over a head-major KV cache (CPU)");
}
