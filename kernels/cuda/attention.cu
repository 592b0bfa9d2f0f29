// CudaBackend: causal attention with our own kernels (cuDNN's fused attention
// would need its graph API). One warp per row, streaming over the keys (or,
// for dK/dV, the queries) that row meets; each lane holds the lane-strided
// elements d = lane + 32·i of the row's head vectors in registers, so the head
// dimension is at most 32·kMaxPerLane = 256 (ops:: checks this). Dot products
// are warp sums; the per-row math (online softmax, recomputed probabilities,
// score gradients, delta) is kernels/functors/attention.h, shared with the CPU.
//
//   forward:  warp per query row t: online softmax over keys s ≤ t → out, logsumexp.
//   backward: delta = rowsum(dO∘O) (row functor); dQ: warp per query row over
//             keys s ≤ t; dK, dV: warp per key row s over queries t ≥ s.
// Every output element is written by exactly one lane: no atomics,
// deterministic results.
//
//   with a cache (generation): the shared index functor appends the new keys
//             and values (a thread per element); then each query row's cache
//             positions are split into blocks (cache_blocks), a warp per
//             (row, block) computes the block's partials (CachedAttentionBlock)
//             and a thread per output element merges them by log-sum-exp
//             (CachedAttentionMerge): a decode step of a dozen rows still
//             occupies the whole GPU, reads each key row coalesced, and keeps
//             the head vectors in registers.
#include <type_traits>

#include "core/cuda/launch.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/cuda/row_launch.cuh"
#include "kernels/functors/attention.h"

namespace tessera {
namespace {

constexpr int kMaxPerLane = 8;  // 256 / 32

// Where one (b, h)'s rows live; warp rows are numbered (b·H + h)·T + t, which
// is also the index of (b, h, t) in logsumexp and delta [B, H, T].
struct HeadRows {
  int64_t seq_len, heads;
  int head_dim;

  __device__ int64_t qkv_stride() const { return packed_qkv_token_stride(heads, head_dim); }  // token t → t + 1
  // Element offset of (b, t, which, h, 0) in qkv [B, T, 3, H, Dh] for warp row `row` at token t.
  __device__ int64_t qkv_offset(int64_t row, int64_t t, int which) const {
    const int64_t bh = row / seq_len, b = bh / heads, h = bh % heads;
    return packed_qkv_offset(b, t, which, h, seq_len, heads, head_dim);
  }
  __device__ int64_t out_offset(int64_t row) const {
    const int64_t bh = row / seq_len, b = bh / heads, h = bh % heads, t = row % seq_len;
    return ((b * seq_len + t) * heads + h) * head_dim;
  }
  __device__ int64_t first_row_of_head(int64_t row) const { return row - row % seq_len; }
};

// dst[i] = scale·src[lane + 32·i] (0 past the head dimension).
template <int kPerLane, typename T>
__device__ void load_lanes(const T* src, int head_dim, int lane, float scale, float (&dst)[kPerLane]) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    dst[i] = d < head_dim ? scale * to_float(src[d]) : 0.0f;
  }
}

template <int kPerLane, typename T>
__device__ void store_lanes(T* dst, int head_dim, int lane, float scale, const float (&src)[kPerLane]) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < head_dim) dst[d] = from_float<T>(scale * src[i]);
  }
}

// Σ_d a[d]·src[d] over the whole warp, a in registers, src in memory.
template <int kPerLane, typename T>
__device__ float warp_dot(const cuda::WarpGroup& g, const float (&a)[kPerLane], const T* src, int head_dim) {
  float partial = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = g.lane() + 32 * i;
    if (d < head_dim) partial += a[i] * to_float(src[d]);
  }
  return g.sum(partial);
}

// Forward, warp per query row: out and logsumexp.
template <typename T, int kPerLane>
struct ForwardRow {
  const T* qkv;
  T* out;
  float* logsumexp;
  HeadRows rows;
  float scale;

  __device__ void operator()(const cuda::WarpGroup& g, int64_t row) const {
    const int lane = g.lane(), dh = rows.head_dim;
    const int64_t t = row % rows.seq_len, stride = rows.qkv_stride();
    float q[kPerLane], acc[kPerLane];
    load_lanes(qkv + rows.qkv_offset(row, t, 0), dh, lane, scale, q);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = 0.0f;
    const T* key = qkv + rows.qkv_offset(row, 0, 1);
    const T* value = qkv + rows.qkv_offset(row, 0, 2);
    OnlineSoftmax softmax;
    for (int64_t s = 0; s <= t; ++s, key += stride, value += stride) {
      const float score = warp_dot(g, q, key, dh);
      const float factor = softmax.raise_max(score);
      const float w = softmax.weight(score);
      softmax.add(w);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int d = lane + 32 * i;
        acc[i] = acc[i] * factor + (d < dh ? w * to_float(value[d]) : 0.0f);
      }
    }
    store_lanes(out + rows.out_offset(row), dh, lane, softmax.normaliser(), acc);
    if (lane == 0) logsumexp[row] = softmax.logsumexp();
  }
};

// Backward, warp per query row t: dQ = scale·Σ_{s≤t} dS[t, s]·k_s.
template <typename T, int kPerLane>
struct GradQueryRow {
  const T* grad_out;
  const T* qkv;
  const float* logsumexp;
  const float* delta;
  T* grad_qkv;
  HeadRows rows;
  float scale;

  __device__ void operator()(const cuda::WarpGroup& g, int64_t row) const {
    const int lane = g.lane(), dh = rows.head_dim;
    const int64_t t = row % rows.seq_len, stride = rows.qkv_stride();
    float q[kPerLane], dout[kPerLane], grad[kPerLane];
    load_lanes(qkv + rows.qkv_offset(row, t, 0), dh, lane, scale, q);
    load_lanes(grad_out + rows.out_offset(row), dh, lane, 1.0f, dout);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) grad[i] = 0.0f;
    const float lse = logsumexp[row], row_delta = delta[row];
    const T* key = qkv + rows.qkv_offset(row, 0, 1);
    const T* value = qkv + rows.qkv_offset(row, 0, 2);
    for (int64_t s = 0; s <= t; ++s, key += stride, value += stride) {
      const float p = attention_probability(warp_dot(g, q, key, dh), lse);
      const float ds = attention_score_grad(p, warp_dot(g, dout, value, dh), row_delta);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < dh) grad[i] += ds * to_float(key[d]);
      }
    }
    store_lanes(grad_qkv + rows.qkv_offset(row, t, 0), dh, lane, scale, grad);
  }
};

// Backward, warp per key row s: dV = Σ_{t≥s} P[t, s]·dO_t, dK = scale·Σ_{t≥s} dS[t, s]·q_t.
template <typename T, int kPerLane>
struct GradKeyValueRow {
  const T* grad_out;
  const T* qkv;
  const float* logsumexp;
  const float* delta;
  T* grad_qkv;
  HeadRows rows;
  float scale;

  __device__ void operator()(const cuda::WarpGroup& g, int64_t row) const {
    const int lane = g.lane(), dh = rows.head_dim;
    const int64_t s = row % rows.seq_len, first = rows.first_row_of_head(row);
    float k[kPerLane], v[kPerLane], grad_k[kPerLane], grad_v[kPerLane];
    load_lanes(qkv + rows.qkv_offset(row, s, 1), dh, lane, 1.0f, k);
    load_lanes(qkv + rows.qkv_offset(row, s, 2), dh, lane, 1.0f, v);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) grad_k[i] = grad_v[i] = 0.0f;
    for (int64_t t = s; t < rows.seq_len; ++t) {
      float q[kPerLane], dout[kPerLane];
      load_lanes(qkv + rows.qkv_offset(row, t, 0), dh, lane, scale, q);
      load_lanes(grad_out + rows.out_offset(first + t), dh, lane, 1.0f, dout);
      float score = 0.0f, dp = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) score += q[i] * k[i], dp += dout[i] * v[i];
      const float p = attention_probability(g.sum(score), logsumexp[first + t]);
      const float ds = attention_score_grad(p, g.sum(dp), delta[first + t]);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) grad_v[i] += p * dout[i], grad_k[i] += ds * q[i];
    }
    store_lanes(grad_qkv + rows.qkv_offset(row, s, 1), dh, lane, 1.0f, grad_k);  // q was scaled already
    store_lanes(grad_qkv + rows.qkv_offset(row, s, 2), dh, lane, 1.0f, grad_v);
  }
};

// Calls fn(std::integral_constant<int, kPerLane>) with the smallest of 1, 2, 4, 8 holding head_dim.
template <typename Fn>
void dispatch_per_lane(int64_t head_dim, Fn&& fn) {
  TESSERA_CHECK(head_dim <= 32 * kMaxPerLane, "attention: head dimension ", head_dim, " exceeds ", 32 * kMaxPerLane);
  if (head_dim <= 32) return fn(std::integral_constant<int, 1>{});
  if (head_dim <= 64) return fn(std::integral_constant<int, 2>{});
  if (head_dim <= 128) return fn(std::integral_constant<int, 4>{});
  return fn(std::integral_constant<int, 8>{});
}

HeadRows head_rows(const Tensor& qkv) {
  return HeadRows{qkv.size(1), qkv.size(3), int(qkv.size(4))};
}

}  // namespace

void CudaBackend::attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale) {
  const cudaStream_t stream = cuda::device_stream(qkv);
  const HeadRows rows = head_rows(qkv);
  const int64_t n = qkv.size(0) * rows.heads * rows.seq_len;
  const float s = attention_scale(scale, rows.head_dim);
  dispatch_float(qkv.dtype(), "attention_forward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_per_lane(rows.head_dim, [&](auto per_lane) {
      const ForwardRow<T, decltype(per_lane)::value> op{qkv.data<T>(), out.data<T>(), logsumexp.data<float>(), rows, s};
      cuda::for_each_row(n, op, stream);
    });
  });
}

void CudaBackend::attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                                     const Tensor& logsumexp, Tensor& grad_qkv, float scale) {
  const cudaStream_t stream = cuda::device_stream(qkv);
  const HeadRows rows = head_rows(qkv);
  const int64_t batch = qkv.size(0), n = batch * rows.heads * rows.seq_len;
  const float s = attention_scale(scale, rows.head_dim);
  Tensor delta = qkv.context().empty(Shape{batch, rows.heads, rows.seq_len}, DType::f32, qkv.device());
  dispatch_float(qkv.dtype(), "attention_backward", [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(n,
                         AttentionDelta<T>{grad_out.data<T>(), out.data<T>(), delta.data<float>(), rows.seq_len,
                                           rows.heads, rows.head_dim},
                         stream);
    dispatch_per_lane(rows.head_dim, [&](auto per_lane) {
      const GradQueryRow<T, decltype(per_lane)::value> grad_q{
          grad_out.data<T>(), qkv.data<T>(), logsumexp.data<float>(), delta.data<float>(), grad_qkv.data<T>(), rows, s};
      cuda::for_each_row(n, grad_q, stream);
      const GradKeyValueRow<T, decltype(per_lane)::value> grad_kv{
          grad_out.data<T>(), qkv.data<T>(), logsumexp.data<float>(), delta.data<float>(), grad_qkv.data<T>(), rows, s};
      cuda::for_each_row(n, grad_kv, stream);
    });
  });
}

void CudaBackend::attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out,
                                       float scale) {
  const cudaStream_t stream = cuda::device_stream(qkv);
  const CacheLayout cache{qkv.size(1), qkv.size(3), qkv.size(4), keys.size(2), position};
  const float s = attention_scale(scale, cache.head_dim);
  dispatch_float(qkv.dtype(), "attention_with_cache", [&](auto tag) {
    using T = decltype(tag);
    const int64_t rows = qkv.size(0) * cache.new_tokens * cache.heads;
    cuda::for_each_index(rows * cache.head_dim, KvAppend<T>{qkv.data<T>(), keys.data<T>(), values.data<T>(), cache},
                         stream);
    const CacheBlocks blocks = cache_blocks(rows, position + cache.new_tokens);
    const int64_t items = rows * blocks.per_row;
    Tensor scratch = qkv.context().empty(Shape{items * (cache.head_dim + 2)}, DType::f32, qkv.device());
    const CachePartials partials{scratch.data<float>(), scratch.data<float>() + items * cache.head_dim,
                                 scratch.data<float>() + items * (cache.head_dim + 1)};
    dispatch_per_lane(cache.head_dim, [&](auto per_lane) {
      const CachedAttentionBlock<T, 32 * decltype(per_lane)::value> block{
          qkv.data<T>(), keys.data<T>(), values.data<T>(), partials, cache, blocks, s};
      cuda::for_each_row(items, block, stream);
    });
    cuda::for_each_index(rows * cache.head_dim, CachedAttentionMerge<T>{partials, out.data<T>(), cache, blocks},
                         stream);
  });
}

}  // namespace tessera
