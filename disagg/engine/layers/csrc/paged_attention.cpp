// Decode attention over the paged, head-major KV cache, for CPU.
//
// One query token per request. K and V are read in place: block `b` of KV head `h` is the
// contiguous [block_size, head_dim] matrix kv[0 or 1][h][b], so nothing is gathered or copied.
// The query heads that share a KV head are computed together (grouped-query attention), so each
// K/V row is loaded once per group. Softmax is online, 16 tokens at a time, in float32 whatever
// the cache holds (float32 or bfloat16). Work items are (request, KV head) pairs, longest first,
// handed out to the threads one by one (contexts differ a lot within a batch).
//
// A sliding-window layer passes `window` W > 0: a request of context c then attends to its last
// W positions only, [c - W, c). Blocks wholly before the window are never read (a later block
// manager may have freed them), and the positions before it in its first block are masked out.
//
// The fast path (head_dim 64 or 128, up to 8 query heads per KV head, block_size a multiple of
// 16) uses GCC/Clang vector extensions, which compile to AVX-512, AVX2 or whatever the CPU has;
// other shapes take a plain loop version of the same algorithm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }

inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// exp(x) for x <= 0, no libm call: 2^(x*log2e) split into an integer power of two and a degree-6
// polynomial; relative error about 2e-7, and about 1e-38 (not 0) at the -87 clamp.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  const float f = (t - n) * 0.693147180559945309f;
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
inline void prefetch_block(const T* k, const T* v, int64_t elems) {
  const char* kc = reinterpret_cast<const char*>(k);
  const char* vc = reinterpret_cast<const char*>(v);
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(kc + off, 0, 3);
    __builtin_prefetch(vc + off, 0, 3);
  }
}

// ---- fast path: 16 floats per vector -------------------------------------------------------
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define DISAGG_FAST_PATH 1

typedef float vfloat __attribute__((vector_size(64)));
typedef float vfloat_u __attribute__((vector_size(64), aligned(4)));
typedef int32_t vint __attribute__((vector_size(64)));
typedef uint32_t vuint __attribute__((vector_size(64)));
typedef uint16_t vhalf_u __attribute__((vector_size(32), aligned(2)));

inline vfloat load16(const float* p) { return *reinterpret_cast<const vfloat_u*>(p); }

inline vfloat load16(const at::BFloat16* p) {
  const vuint wide = __builtin_convertvector(*reinterpret_cast<const vhalf_u*>(p), vuint) << 16;
  return reinterpret_cast<const vfloat&>(wide);
}

inline vfloat splat(float x) { return vfloat{} + x; }

inline float hsum(vfloat v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

inline float hmax(vfloat v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}

inline vfloat vexp_nonpositive(vfloat x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const vfloat t = x * 1.44269504088896341f;
  const vfloat n = (t + 12582912.0f) - 12582912.0f;
  const vfloat f = (t - n) * 0.693147180559945309f;
  vfloat p = splat(1.0f / 720.0f);
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  return p * reinterpret_cast<const vfloat&>(bits);
}

// 16 vectors -> one vector of their 16 sums (lane i = sum of v[i]), with 15 shuffle pairs
// instead of 16 separate horizontal sums.
inline vfloat reduce16(const vfloat* v) {
  vfloat w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const vfloat z = __builtin_shufflevector(y[0], y[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                   __builtin_shufflevector(y[0], y[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // The tree leaves the sums in bit-reversed lane order.
  return __builtin_shufflevector(z, z, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// One (request, KV head), G query heads of dimension 16 * NV, 16 tokens at a time.
template <typename T, int G, int NV>
void attend_fast(const float* q, const T* k_head, const T* v_head, const int32_t* table, int64_t start, int64_t ctx_len, int64_t block_size, float* out) {
  constexpr int D = 16 * NV;
  const int64_t block_elems = block_size * D;
  vfloat qv[G][NV], acc[G][NV];
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < NV; ++j) {
      qv[g][j] = load16(q + g * D + 16 * j);
      acc[g][j] = vfloat{};
    }
    m[g] = kNegInf;
    l[g] = 0.0f;
  }
  const vint lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t num_blocks = (ctx_len + block_size - 1) / block_size;
  const int64_t first_block = start / block_size;
  if (first_block < num_blocks)
    prefetch_block(k_head + table[first_block] * block_elems, v_head + table[first_block] * block_elems, block_elems);
  for (int64_t blk = first_block; blk < num_blocks; ++blk) {
    const int64_t offset = static_cast<int64_t>(table[blk]) * block_elems;
    if (blk + 1 < num_blocks) {
      const int64_t next = static_cast<int64_t>(table[blk + 1]) * block_elems;
      prefetch_block(k_head + next, v_head + next, block_elems);
    }
    const int64_t block_tokens = std::min(block_size, ctx_len - blk * block_size);
    for (int64_t c0 = 0; c0 < block_tokens; c0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, block_tokens - c0));
      // Lanes before the window's first position (only in the window's first block).
      const int64_t skip = start - (blk * block_size + c0);
      if (skip >= 16) continue;
      const int lo = static_cast<int>(std::max<int64_t>(0, skip));
      const T* kb = k_head + offset + c0 * D;
      const T* vb = v_head + offset + c0 * D;
      vfloat part[G][16];
      for (int g = 0; g < G; ++g)
        for (int t = 0; t < lo; ++t) part[g][t] = vfloat{};
      for (int t = lo; t < n; ++t) {
        vfloat k[NV];
        for (int j = 0; j < NV; ++j) k[j] = load16(kb + t * D + 16 * j);
        for (int g = 0; g < G; ++g) {
          vfloat p = qv[g][0] * k[0];
          for (int j = 1; j < NV; ++j) p += qv[g][j] * k[j];
          part[g][t] = p;
        }
      }
      for (int g = 0; g < G; ++g)
        for (int t = n; t < 16; ++t) part[g][t] = vfloat{};
      float probs[G][16];
      for (int g = 0; g < G; ++g) {
        vfloat s = reduce16(part[g]);
        s = (lane < n) & (lane >= lo) ? s : splat(kNegInf);
        const float new_max = std::max(m[g], hmax(s));
        if (new_max > m[g]) {
          const float alpha = exp_nonpositive(m[g] - new_max);
          l[g] *= alpha;
          for (int j = 0; j < NV; ++j) acc[g][j] *= alpha;
          m[g] = new_max;
        }
        vfloat p = vexp_nonpositive(s - new_max);
        p = (lane < n) & (lane >= lo) ? p : vfloat{};
        l[g] += hsum(p);
        std::memcpy(probs[g], &p, sizeof(p));
      }
      for (int t = lo; t < n; ++t) {
        vfloat v[NV];
        for (int j = 0; j < NV; ++j) v[j] = load16(vb + t * D + 16 * j);
        for (int g = 0; g < G; ++g) {
          const vfloat p = splat(probs[g][t]);
          for (int j = 0; j < NV; ++j) acc[g][j] += p * v[j];
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int j = 0; j < NV; ++j) {
      const vfloat o = acc[g][j] * inv;
      std::memcpy(out + g * D + 16 * j, &o, sizeof(o));
    }
  }
}
#endif  // fast path

// ---- any shape: plain loops ------------------------------------------------------------------
template <typename T>
void attend_generic(const float* q, const T* k_head, const T* v_head, const int32_t* table, int64_t start, int64_t ctx_len, int64_t group,
                    int64_t D, int64_t block_size, float* out, std::vector<float>& scratch) {
  scratch.assign(group * D + 2 * group + group * block_size, 0.0f);
  float* acc = scratch.data();           // [G, D]
  float* m = acc + group * D;            // [G] running max
  float* l = m + group;                  // [G] running sum of exp
  float* s = l + group;                  // [G, block_size] scores of one block
  std::fill(m, m + group, kNegInf);
  const int64_t num_blocks = (ctx_len + block_size - 1) / block_size;
  for (int64_t blk = start / block_size; blk < num_blocks; ++blk) {
    const int64_t n = std::min(block_size, ctx_len - blk * block_size);
    const int64_t t0 = std::max<int64_t>(0, start - blk * block_size);  // the window's first position
    const T* kb = k_head + static_cast<int64_t>(table[blk]) * block_size * D;
    const T* vb = v_head + static_cast<int64_t>(table[blk]) * block_size * D;
    for (int64_t t = t0; t < n; ++t)
      for (int64_t g = 0; g < group; ++g) {
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += q[g * D + d] * to_float(kb[t * D + d]);
        s[g * block_size + t] = dot;
      }
    for (int64_t g = 0; g < group; ++g) {
      float* sg = s + g * block_size;
      const float new_max = std::max(m[g], *std::max_element(sg + t0, sg + n));
      if (new_max > m[g]) {
        const float alpha = exp_nonpositive(m[g] - new_max);
        l[g] *= alpha;
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= alpha;
        m[g] = new_max;
      }
      for (int64_t t = t0; t < n; ++t) {
        sg[t] = exp_nonpositive(sg[t] - new_max);
        l[g] += sg[t];
      }
    }
    for (int64_t t = t0; t < n; ++t)
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] += s[g * block_size + t] * to_float(vb[t * D + d]);
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
  }
}

// ---- driver ----------------------------------------------------------------------------------
template <typename T>
using AttendFn = void (*)(const float*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, float*);

template <typename T, int NV>
AttendFn<T> pick_group(int64_t group) {
#ifdef DISAGG_FAST_PATH
  switch (group) {
    case 1: return &attend_fast<T, 1, NV>;
    case 2: return &attend_fast<T, 2, NV>;
    case 3: return &attend_fast<T, 3, NV>;
    case 4: return &attend_fast<T, 4, NV>;
    case 5: return &attend_fast<T, 5, NV>;
    case 6: return &attend_fast<T, 6, NV>;
    case 7: return &attend_fast<T, 7, NV>;
    case 8: return &attend_fast<T, 8, NV>;
  }
#endif
  return nullptr;
}

template <typename T>
AttendFn<T> pick_fast(int64_t group, int64_t head_dim, int64_t block_size) {
  if (block_size % 16 != 0) return nullptr;
  if (head_dim == 64) return pick_group<T, 4>(group);
  if (head_dim == 128) return pick_group<T, 8>(group);
  return nullptr;
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
         int64_t window, at::Tensor& out) {
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
  const AttendFn<T> fast = pick_fast<T>(group, head_dim, block_size);

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
      const int64_t start = window > 0 ? std::max<int64_t>(0, ctx_len - window) : 0;
      const T* k_head = k_base + h * head_stride;
      const T* v_head = v_base + h * head_stride;
      float* dst = out_base + (r * num_heads + h * group) * head_dim;
      if (fast != nullptr) {
        fast(qbuf.data(), k_head, v_head, tables + r * max_blocks, start, ctx_len, block_size, dst);
      } else {
        attend_generic<T>(qbuf.data(), k_head, v_head, tables + r * max_blocks, start, ctx_len, group, head_dim, block_size, dst, scratch);
      }
    }
  });
}

}  // namespace

// q: [B, H, D] float32; kv_layer: [2, KVH, num_blocks, block_size, D] float32 or bfloat16;
// block_tables: [B, max_blocks] int32; context_lens: [B] int32 (tokens to attend, >= 1);
// window: attend to the last `window` positions only (0: to all of them). Returns [B, H, D] float32.
at::Tensor decode_attention(at::Tensor q, at::Tensor kv_layer, at::Tensor block_tables, at::Tensor context_lens, double scale,
                            int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && kv_layer.device().is_cpu(), "paged decode attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be [B, H, D] float32");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(0) == 2 && kv_layer.size(4) == q.size(2), "kv_layer must be [2, KVH, blocks, block_size, D]");
  TORCH_CHECK(kv_layer.is_contiguous(), "kv_layer must be contiguous");
  TORCH_CHECK(q.size(1) % kv_layer.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && block_tables.scalar_type() == at::kInt, "block_tables must be [B, max_blocks] int32");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no window)");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == q.size(0) && context_lens.scalar_type() == at::kInt, "context_lens must be [B] int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = at::empty_like(q);
  if (kv_layer.scalar_type() == at::kFloat) {
    run<float>(q, kv_layer, block_tables, context_lens, scale, window, out);
  } else if (kv_layer.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(q, kv_layer, block_tables, context_lens, scale, window, out);
  } else {
    TORCH_CHECK(false, "paged decode attention: cache dtype must be float32 or bfloat16, got ", kv_layer.scalar_type());
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(disagg_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor kv_layer, Tensor block_tables, Tensor context_lens, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(disagg_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
