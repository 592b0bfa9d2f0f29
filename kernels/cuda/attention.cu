// CudaBackend: causal attention with our own kernels (cuDNN's fused attention
// would need its graph API). One warp per row, streaming over the keys (or,
// for dK/dV, the queries) that row meets; each lane holds the lane-strided
// elements d = lane + 32·i of the row's head vectors in registers, so the head
// dimension is at most 256 (8 per lane; ops:: checks this). Dot products
// are warp sums. The row functors and the per-row math (online softmax,
// recomputed probabilities, score gradients, delta) are
// kernels/functors/attention.h, shared with the CPU (which runs the row
// functors in the tests). Both layouts of the projections (the GPT's packed
// [B, T, 3, H, Dh], Llama's grouped [B, T, G, R + 2, Dh]) go through QkvLayout.
//
//   forward:  warp per query row t: online softmax over keys s ≤ t → out, logsumexp.
//   backward: delta = rowsum(dO∘O) (index functor); dQ: warp per query row
//             over keys s ≤ t; dK, dV: warp per key row s of a key/value
//             group, over the group's query heads and their queries t ≥ s.
// Every output element is written by exactly one lane: no atomics,
// deterministic results. Dropout on the probabilities (ops::AttentionDropout)
// is drawn inside the same row functors, the forward's mask again in the
// backward (attention_dropout_multiplier).
//
//   with a cache (generation): the shared index functor appends the new keys
//             and values (a thread per element); then each query row's cache
//             positions are split into blocks (cache_blocks), a warp per
//             (row, block) computes the block's partials (CachedAttentionBlock)
//             and a thread per output element merges them by log-sum-exp
//             (CachedAttentionMerge): a decode step of a dozen rows still
//             occupies the whole GPU, reads each key row coalesced, and keeps
//             the head vectors in registers.
#include "core/cuda/launch.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/cuda/row_launch.cuh"
#include "kernels/functors/attention.h"

namespace tessera {
namespace {

void run_forward(const Tensor& qkv, const QkvLayout& layout, Tensor& out, Tensor& logsumexp, float scale,
                 const ops::AttentionDropout& dropout, const char* op) {
  const cudaStream_t stream = cuda::device_stream(qkv);
  const AttentionRows rows{qkv.size(0), qkv.size(1), layout};
  const int64_t n = rows.batch * layout.heads * rows.seq_len;
  const float s = attention_scale(scale, layout.head_dim);
  dispatch_float(qkv.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    dispatch_attention_head_dim(layout.head_dim, [&](auto max_head_dim) {
      const AttentionForwardRow<T, decltype(max_head_dim)::value> forward{
          qkv.data<T>(), out.data<T>(), logsumexp.data<float>(), rows, s, dropout};
      cuda::for_each_row(n, forward, stream);
    });
  });
}

void run_backward(const Tensor& grad_out, const Tensor& qkv, const QkvLayout& layout, const Tensor& out,
                  const Tensor& logsumexp, Tensor& grad_qkv, float scale, const ops::AttentionDropout& dropout,
                  const char* op) {
  const cudaStream_t stream = cuda::device_stream(qkv);
  const AttentionRows rows{qkv.size(0), qkv.size(1), layout};
  const int64_t query_rows = rows.batch * layout.heads * rows.seq_len;
  const int64_t key_rows = rows.batch * layout.groups * rows.seq_len;
  const float s = attention_scale(scale, layout.head_dim);
  Tensor delta = qkv.context().empty(Shape{rows.batch, layout.heads, rows.seq_len}, DType::f32, qkv.device());
  dispatch_float(qkv.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(query_rows,
                         AttentionDelta<T>{grad_out.data<T>(), out.data<T>(), delta.data<float>(), rows.seq_len,
                                           layout.heads, layout.head_dim},
                         stream);
    const AttentionBackwardArgs<T> args{grad_out.data<T>(),
                                        qkv.data<T>(),
                                        logsumexp.data<float>(),
                                        delta.data<float>(),
                                        grad_qkv.data<T>(),
                                        rows,
                                        s,
                                        dropout};
    dispatch_attention_head_dim(layout.head_dim, [&](auto max_head_dim) {
      constexpr int kMaxHeadDim = decltype(max_head_dim)::value;
      cuda::for_each_row(query_rows, AttentionGradQueryRow<T, kMaxHeadDim>{args}, stream);
      cuda::for_each_row(key_rows, AttentionGradKeyValueRow<T, kMaxHeadDim>{args}, stream);
    });
  });
}

void run_with_cache(const Tensor& qkv, const QkvLayout& layout, Tensor& keys, Tensor& values, int64_t position,
                    Tensor& out, float scale, const char* op) {
  const cudaStream_t stream = cuda::device_stream(qkv);
  const CacheLayout cache{AttentionRows{qkv.size(0), qkv.size(1), layout}, keys.size(2), position};
  const float s = attention_scale(scale, layout.head_dim);
  dispatch_float(qkv.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    const int64_t batch_tokens = qkv.size(0) * cache.new_tokens(), rows = batch_tokens * layout.heads;
    cuda::for_each_index(batch_tokens * layout.groups * layout.head_dim,
                         KvAppend<T>{qkv.data<T>(), keys.data<T>(), values.data<T>(), cache}, stream);
    const CacheBlocks blocks = cache_blocks(rows, position + cache.new_tokens());
    const int64_t items = rows * blocks.per_row;
    Tensor scratch = qkv.context().empty(Shape{items * (layout.head_dim + 2)}, DType::f32, qkv.device());
    const CachePartials partials{scratch.data<float>(), scratch.data<float>() + items * layout.head_dim,
                                 scratch.data<float>() + items * (layout.head_dim + 1)};
    dispatch_attention_head_dim(layout.head_dim, [&](auto max_head_dim) {
      const CachedAttentionBlock<T, decltype(max_head_dim)::value> block{
          qkv.data<T>(), keys.data<T>(), values.data<T>(), partials, cache, blocks, s};
      cuda::for_each_row(items, block, stream);
    });
    cuda::for_each_index(rows * layout.head_dim, CachedAttentionMerge<T>{partials, out.data<T>(), cache, blocks},
                         stream);
  });
}

}  // namespace

void CudaBackend::attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale,
                                    const ops::AttentionDropout& dropout) {
  run_forward(qkv, packed_qkv_layout(qkv.shape()), out, logsumexp, scale, dropout, "attention_forward");
}

void CudaBackend::attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                                     const Tensor& logsumexp, Tensor& grad_qkv, float scale,
                                     const ops::AttentionDropout& dropout) {
  run_backward(grad_out, qkv, packed_qkv_layout(qkv.shape()), out, logsumexp, grad_qkv, scale, dropout,
               "attention_backward");
}

void CudaBackend::attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out,
                                       float scale) {
  run_with_cache(qkv, packed_qkv_layout(qkv.shape()), keys, values, position, out, scale, "attention_with_cache");
}

void CudaBackend::grouped_attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale,
                                            const ops::AttentionDropout& dropout) {
  run_forward(qkv, grouped_qkv_layout(qkv.shape()), out, logsumexp, scale, dropout, "grouped_attention_forward");
}

void CudaBackend::grouped_attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                                             const Tensor& logsumexp, Tensor& grad_qkv, float scale,
                                             const ops::AttentionDropout& dropout) {
  run_backward(grad_out, qkv, grouped_qkv_layout(qkv.shape()), out, logsumexp, grad_qkv, scale, dropout,
               "grouped_attention_backward");
}

void CudaBackend::grouped_attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position,
                                               Tensor& out, float scale) {
  run_with_cache(qkv, grouped_qkv_layout(qkv.shape()), keys, values, position, out, scale,
                 "grouped_attention_with_cache");
}

}  // namespace tessera
